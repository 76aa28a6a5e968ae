"""Memory caps and bounds of V orders, in chunk units per rank: the yardsticks of the V search.

Why a module of its own: the search (`pp_offload.order.v_curve`), its candidate families
(`pp_offload.order.v_candidates`), the entry points (`pp_offload.order.vshape`), the planner and the tests
all measure against the same few numbers (1F1B's peak, V-Min's and V-Half's caps, the smallest feasible
peak, the makespan lower bound); keeping them apart from the search lets each of those import them without
importing the search.
"""

from __future__ import annotations

from pp_offload.order.actions import Costs


def one_f_one_b_peak(num_ranks: int, num_microbatches: int) -> int:
    """1F1B's peak activation memory in chunk units: rank 0 holds min(d, m) microbatches of 2 chunks."""
    return 2 * min(num_ranks, num_microbatches)


def v_min_cap(num_ranks: int) -> int:
    return 2 * ((num_ranks + 4) // 3)


def v_half_cap(num_ranks: int) -> int:
    return 2 * ((num_ranks + 2) // 2)


def _check_sizes(num_ranks: int, num_microbatches: int) -> None:
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 2:
        raise ValueError(
            f"V schedules need at least 2 pipeline ranks (4 stages), got num_ranks={num_ranks!r}"
        )
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"num_microbatches must be an integer >= 1, got {num_microbatches!r}")


def smallest_feasible_peak(num_ranks: int, num_microbatches: int) -> float:
    """Lowest per-rank activation peak (chunk units) any V order can have: 2, for every d and m.

    A floor: on rank r, F(2d-1-r, j) runs while stage r still holds microbatch j (its W comes after the
    whole backward chain), so some rank holds two chunks at once. Reached: the greedy scheduler under a
    cap of 2 completes for every d and m (tests check both sides), so the smallest feasible
    ``memory_limit`` of the adaptive scheduler is ``2 / one_f_one_b_peak(d, m) = 1 / min(d, m)``.
    """
    _check_sizes(num_ranks, num_microbatches)
    return 2.0


def makespan_lower_bound(num_ranks: int, num_microbatches: int, costs: Costs, cap: int) -> float:
    """No V order with every rank's peak within ``cap`` chunk units finishes sooner than this.

    Every rank computes ``2m (F + I + W)``; the last rank, d-1, also idles. It cannot start before its
    first forward input arrives, ``(d-1)(F + comm)``. Its first pass of any other kind is the input
    gradient of stage d for microbatch 0, whose chain (forwards to the end of the V, input gradients back
    to stage d) cannot start it before ``T1 = 2dF + (d-1)I + 3(d-1) comm``. Before T1 it can run only
    forwards, and at most ``cap`` of them (no weight pass has freed a chunk yet), so it idles at least
    ``T1 - cap F``. With per-stage costs the bound is not derived: the compute alone is returned.

    Tight at d=8, m=32, F=I=W=1 for limits 12 to 16 (bubbles 5.42 to 3.52%, which the search reaches),
    and it shows the reference adaptive scheduler's 4.0% at limit 13 is out of reach (bound 4.95%).
    """
    d, m = num_ranks, num_microbatches
    work = 2 * m * (costs.F + costs.I + costs.W)
    if costs.stages is not None:
        return work
    fill = (d - 1) * (costs.F + costs.comm)
    first_gradient = 2 * d * costs.F + (d - 1) * costs.I + 3 * (d - 1) * costs.comm
    forwards = min(cap, 2 * m) * costs.F
    return work + max(fill, first_gradient - forwards)
