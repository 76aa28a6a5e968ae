"""Reference orders of classic schedules, for comparison with the V-shape ones.

Why this exists: benchmarks and tests measure every V order against 1F1B, and the natural source of a
1F1B order, ``torch.distributed.pipelining._schedule_visualizer.get_schedule_ops(Schedule1F1B, ...)``,
is wrong in torch 2.13: ``Schedule1F1B.pipeline_order`` is misnumbered on the last rank (its forwards
start at ``F1`` and it invents ``F{m}``, a microbatch that does not exist, while ``F0`` never runs).
torch's runtime for single-stage schedules does not execute that table, so training is unaffected, but
replaying it measures a schedule that is not 1F1B. `one_f_one_b_order` is the textbook order instead.
"""

from __future__ import annotations

from pp_offload.order.actions import Action, B, F, Order

__all__ = ["one_f_one_b_order"]


def one_f_one_b_order(num_ranks: int, num_microbatches: int) -> Order:
    """1F1B (PipeDream-flush) with one stage per rank and full backward passes (``B``).

    Rank ``r`` runs ``min(d - 1 - r, m)`` warm-up forwards, then alternates one forward and one
    backward until every forward has run, then the remaining backwards (cool-down). Rank 0 holds
    ``min(d, m)`` microbatches at its peak, the memory every V schedule is measured against.
    """
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
        raise ValueError(f"num_ranks must be an integer >= 1, got {num_ranks!r}")
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"num_microbatches must be an integer >= 1, got {num_microbatches!r}")
    d, m = num_ranks, num_microbatches
    order: Order = {}
    for rank in range(d):
        warmup = min(d - 1 - rank, m)
        actions = [Action(rank, F, j) for j in range(warmup)]
        for j in range(m - warmup):  # steady phase: F of microbatch warmup+j, then B of microbatch j
            actions.append(Action(rank, F, warmup + j))
            actions.append(Action(rank, B, j))
        actions.extend(Action(rank, B, j) for j in range(m - warmup, m))  # cool-down
        order[rank] = actions
    return order
