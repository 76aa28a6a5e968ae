"""PROVISIONAL: a simple valid V order behind the final API; replaced by the building-block generators."""

from __future__ import annotations

from pp_offload.order.actions import Action, Costs, Order, v_stages


def _simple_v_order(num_ranks: int, num_microbatches: int) -> Order:
    order: Order = {}
    for r in range(num_ranks):
        s0, s1 = v_stages(r, num_ranks)
        acts = [Action(s0, "F", j) for j in range(num_microbatches)]
        acts += [Action(s1, "F", j) for j in range(num_microbatches)]
        for j in range(num_microbatches):
            acts += [Action(s1, "I", j), Action(s1, "W", j)]
        for j in range(num_microbatches):
            acts += [Action(s0, "I", j), Action(s0, "W", j)]
        order[r] = acts
    return order


def v_min_order(num_ranks: int, num_microbatches: int, costs: Costs | None = None) -> Order:
    return _simple_v_order(num_ranks, num_microbatches)


def v_half_order(num_ranks: int, num_microbatches: int, costs: Costs | None = None) -> Order:
    return _simple_v_order(num_ranks, num_microbatches)


def v_zb_order(num_ranks: int, num_microbatches: int, costs: Costs | None = None) -> Order:
    return _simple_v_order(num_ranks, num_microbatches)


def adaptive_v_order(
    num_ranks: int, num_microbatches: int, memory_limit: float, costs: Costs | None = None
) -> Order:
    return _simple_v_order(num_ranks, num_microbatches)
