"""V-shape orders under a memory cap: V-Min, V-Half, V-ZB and the adaptive scheduler.

One mechanism serves all four, which are points on one curve of bubble against memory: generate
candidates, judge them with the *real* costs, keep the fastest within the memory cap.

- building blocks (`pp_offload.order.blocks`): the paper's V-Min (offsets 1/1) and V-Half (2/1)
  patterns, plus every "first K ranks on down-offset a, the rest on b" pattern (mixed offsets give
  every integer peak between d and 2d), repeated over the microbatches;
- greedy orders (`pp_offload.order.greedy`) built under a range of caps, a few policy variants;
- 1F1B-rhythm orders (`pp_offload.order.rhythm`), full to shortest fill: robust to comm latency and
  skewed F/I/W costs (this is the structure of torch's ZBV schedule);
- each of the above with its drain rewritten (`pp_offload.order.cooldown`): input gradients of the two
  chunks interleaved on diagonals, weight passes held back to fill the drain;
- each of the above with its warm-up rewritten (`pp_offload.order.warmup`), alone and with the drain
  rewrite after it;
- per cap, the fastest finalist polished along its critical chain (`pp_offload.order.polish`): passes
  that found their rank busy with a pass that could wait go ahead of it.

The best are compacted (`pp_offload.order.compact`: idle gaps filled without raising any rank's peak
above the cap it is compacted under). The search is grown cap by cap (`_Curve`) and none of its choices
depends on the requested limit, so a larger limit never gives a slower order. Every order respects its
cap (its replayed peak is checked). Results can be cached on disk (`pp_offload.order.cache`).

This module holds the entry points; the caps and bounds are in `pp_offload.order.v_caps`, the candidate
families in `pp_offload.order.v_candidates`, and the search (`_Curve`) in `pp_offload.order.v_curve`.

Ranks that all need the same order can search together (``gather=``, `pp_offload.order.spread`): each
batch of independent tasks (scoring the candidates that join at a cap, compacting a cap's shortlist,
finishing its finalists) is split between them and exchanged, so every rank holds every result and
takes every decision exactly as a single process would.

Caps, in chunk units per rank (1F1B holds ``2 * min(d, m)``):
- V-Min:  ``2 * floor((d + 4) / 3)``, about 1/3 of 1F1B;
- V-Half: ``2 * floor((d + 2) / 2)``, about 1/2;
- V-ZB:   ``2 * d``, 1F1B's memory, spent on removing the bubble;
- adaptive: ``memory_limit * 1F1B``, for any limit in (0, 1].
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import lru_cache

from pp_offload.order import cache as order_cache
from pp_offload.order.actions import Costs, Order
from pp_offload.order.spread import Gather
from pp_offload.order.v_caps import (
    _check_sizes,
    makespan_lower_bound,
    one_f_one_b_peak,
    smallest_feasible_peak,
    v_half_cap,
    v_min_cap,
)
from pp_offload.order.v_curve import _Curve

__all__ = [
    "adaptive_v_order",
    "makespan_lower_bound",
    "one_f_one_b_peak",
    "smallest_feasible_peak",
    "v_half_cap",
    "v_half_order",
    "v_min_cap",
    "v_min_order",
    "v_zb_order",
]


def v_min_order(
    num_ranks: int,
    num_microbatches: int,
    costs: Costs | Mapping | None = None,
    *,
    gather: Gather | None = None,
) -> Order:
    """V-Min: about 1/3 of 1F1B's activation memory (the paper's 1/1 offsets), lowest bubble at that cap.

    ``gather`` (all ranks of a group calling together) spreads the search over the group's ranks: the
    same order, for a share of the work (`pp_offload.order.spread`); the same holds for the other three.
    """
    return _best_order(num_ranks, num_microbatches, costs, v_min_cap(num_ranks), "V-Min", gather)


def v_half_order(
    num_ranks: int,
    num_microbatches: int,
    costs: Costs | Mapping | None = None,
    *,
    gather: Gather | None = None,
) -> Order:
    """V-Half: about 1/2 of 1F1B's activation memory (the paper's 2/1 offsets), lowest bubble at that cap."""
    return _best_order(num_ranks, num_microbatches, costs, v_half_cap(num_ranks), "V-Half", gather)


def v_zb_order(
    num_ranks: int,
    num_microbatches: int,
    costs: Costs | Mapping | None = None,
    *,
    gather: Gather | None = None,
) -> Order:
    """V-ZB: 1F1B's activation memory, spent on a near-zero bubble."""
    return _best_order(num_ranks, num_microbatches, costs, 2 * num_ranks, "V-ZB", gather)


def adaptive_v_order(
    num_ranks: int,
    num_microbatches: int,
    memory_limit: float,
    costs: Costs | Mapping | None = None,
    *,
    gather: Gather | None = None,
) -> Order:
    """Lowest-makespan V order whose every rank stays within ``memory_limit`` x 1F1B's peak.

    Raises ``ValueError`` naming the smallest feasible limit when ``memory_limit`` is below it.
    """
    if isinstance(memory_limit, bool) or not isinstance(memory_limit, (int, float)):
        raise TypeError(f"memory_limit must be a float in (0, 1], got {memory_limit!r}")
    if not 0 < memory_limit <= 1:
        raise ValueError(
            f"memory_limit must be a fraction of 1F1B's peak activation memory in (0, 1], got {memory_limit}"
        )
    reference = one_f_one_b_peak(num_ranks, num_microbatches)
    cap = memory_limit * reference
    label = f"adaptive(memory_limit={memory_limit})"
    return _best_order(num_ranks, num_microbatches, costs, cap, label, gather)


def _best_order(
    num_ranks: int, num_microbatches: int, costs, cap: float, label: str, gather: Gather | None = None
) -> Order:
    _check_sizes(num_ranks, num_microbatches)
    costs = Costs.coerce(costs)
    smallest = smallest_feasible_peak(num_ranks, num_microbatches)
    order = None
    if cap >= smallest - 1e-9:
        whole = int(math.floor(cap + 1e-9))  # peaks are whole chunk units
        cached = order_cache.load(num_ranks, num_microbatches, costs, whole)
        if gather is not None and gather.size > 1:
            order = _search_together(num_ranks, num_microbatches, costs, whole, gather, cached)
        else:
            order = cached if cached is not None else _search(num_ranks, num_microbatches, costs, whole)
        if order is not None and cached is None:
            order_cache.store(num_ranks, num_microbatches, costs, whole, order)
    if order is None:
        reference = one_f_one_b_peak(num_ranks, num_microbatches)
        limit = math.ceil(smallest / reference * 1e4) / 1e4  # rounded up: the printed limit must work
        raise ValueError(
            f"{label}: no V order for d={num_ranks}, m={num_microbatches} fits in {cap:g} chunk units "
            f"per rank; the smallest feasible peak is {smallest:g} chunk units, i.e. memory_limit >= "
            f"{limit:.4f} of 1F1B's {reference} (raise the limit, or offload activations)"
        )
    return {rank: list(actions) for rank, actions in order.items()}


@lru_cache(maxsize=16)
def _curve(num_ranks: int, num_microbatches: int, costs: Costs) -> _Curve:
    return _Curve(num_ranks, num_microbatches, costs)


def _search(
    num_ranks: int, num_microbatches: int, costs: Costs, cap: int, gather: Gather | None = None
) -> Order | None:
    """Fastest order found within ``cap`` chunk units per rank, or None."""
    best = _curve(num_ranks, num_microbatches, costs).best(cap, gather)
    return None if best is None else best.order


def _search_together(
    num_ranks: int, num_microbatches: int, costs: Costs, cap: int, gather: Gather, cached: Order | None
) -> Order | None:
    """`_search` spread over ``gather``'s ranks, which must all call this together.

    The ranks search together only from the same state: every one missing the disk cache (a rank that
    has the entry still searches, to take its share) and its in-process curve grown equally far.
    Otherwise each finishes alone (the same order, with no exchange to wait on).
    """
    curve = _curve(num_ranks, num_microbatches, costs)
    states = gather.all_gather((cached is not None, curve.done_cap))
    if all(hit for hit, _ in states):
        return cached
    if len({done for _, done in states}) > 1:
        return cached if cached is not None else _search(num_ranks, num_microbatches, costs, cap)
    try:
        return _search(num_ranks, num_microbatches, costs, cap, gather)
    except BaseException:
        _curve.cache_clear()  # a search cut short leaves its curve half grown: never serve from it
        raise
