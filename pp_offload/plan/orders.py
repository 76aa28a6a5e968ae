"""The compute order of every schedule the planner evaluates, ours and torch's, without processes.

Which stage sits where:
- V placement (ours, torch's ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV``): ``2d`` stages, rank ``r``
  holds stages ``r`` and ``2d-1-r``;
- ``Schedule1F1B``: ``d`` stages, one per rank (our textbook order from `pp_offload.order.baselines`: torch
  2.13's ``Schedule1F1B.pipeline_order`` is misnumbered);
- loop placement (``ScheduleInterleaved1F1B``, ``ScheduleInterleavedZeroBubble``): ``v * d`` stages, stage
  ``s`` on rank ``s % d`` (``v = virtual_stages``, 2 by default).

How our orders are made (``search``):
- ``"full"``: the schedule classes' own generators (`pp_offload.order.vshape`): every candidate family,
  compacted, the best kept. About 1 s per order at d=8, m=32; 3-4 s at d=16; 20-45 s at d=32.
- ``"fast"``: the candidates that win at large d, without the search around them: V-Min and V-Half are the
  papers' building blocks, V-ZB the 1F1B-rhythm V order, each compacted under its cap; the adaptive
  schedule takes the fastest building block / rhythm order under its cap, compacted. ~1-3 s per order at
  d=32. Measured at d=32, m=64 with F:I:W = 1:1.1:0.9 and comm 5%: the same bubble as ``"full"`` for all
  three (33.2%, 23.2%, 9.8%); as the search keeps the best candidate, ``"fast"`` can only be slower.
- ``"auto"``: full up to d=8, fast above.

torch's orders come from its schedule classes built with mock stages (`pp_offload.runtime.compat`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from pp_offload.order.actions import Costs, Order

__all__ = [
    "OURS",
    "SCHEDULES",
    "TORCH",
    "Layout",
    "build_order",
    "canonical_schedule",
    "layout",
    "microbatch_problem",
    "resolve_search",
]

OURS = ("ScheduleVMin", "ScheduleVHalf", "ScheduleVZB", "ScheduleVAdaptive")
TORCH = (
    "Schedule1F1B",
    "ScheduleInterleaved1F1B",
    "ScheduleZBVZeroBubble",
    "ScheduleInterleavedZeroBubble",
    "ScheduleDualPipeV",
)
SCHEDULES = OURS + TORCH
SEARCHES = ("auto", "full", "fast")
_FULL_SEARCH_MAX_RANKS = 8

_ALIASES = {
    "vmin": "ScheduleVMin",
    "vhalf": "ScheduleVHalf",
    "vzb": "ScheduleVZB",
    "vadaptive": "ScheduleVAdaptive",
    "adaptive": "ScheduleVAdaptive",
    "1f1b": "Schedule1F1B",
    "interleaved1f1b": "ScheduleInterleaved1F1B",
    "zbvzerobubble": "ScheduleZBVZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "interleavedzerobubble": "ScheduleInterleavedZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}


def canonical_schedule(name: str) -> str:
    """``"ScheduleVHalf"``, ``"V-Half"``, ``"vhalf"`` -> ``"ScheduleVHalf"`` (torch's names likewise)."""
    if not isinstance(name, str):
        raise TypeError(f"schedule names are strings like 'ScheduleVHalf', got {name!r}")
    key = name.strip().lower().replace("-", "").replace("_", "")
    key = key.removeprefix("schedule")
    found = _ALIASES.get(key)
    if found is None:
        raise ValueError(f"unknown schedule {name!r}; choose from {', '.join(SCHEDULES)}")
    return found


@dataclass(frozen=True)
class Layout:
    """Where a schedule puts its stages: ``rank_of_stage[s]`` for each of its ``num_stages`` stages."""

    schedule: str
    num_ranks: int
    rank_of_stage: tuple[int, ...]
    placement: str  # "v", "one" (one stage per rank) or "loop"

    @property
    def num_stages(self) -> int:
        return len(self.rank_of_stage)

    @property
    def chunks_per_stage(self) -> float:
        """The simulator's scale: a stage is ``2d / num_stages`` chunks (chunk = one V stage)."""
        return 2.0 * self.num_ranks / self.num_stages

    def stages_of(self, rank: int) -> list[int]:
        return [s for s, r in enumerate(self.rank_of_stage) if r == rank]


def layout(schedule: str, num_ranks: int, *, virtual_stages: int = 2) -> Layout:
    schedule = canonical_schedule(schedule)
    d = num_ranks
    if schedule == "Schedule1F1B":
        return Layout(schedule, d, tuple(range(d)), "one")
    if schedule in ("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble"):
        return Layout(schedule, d, tuple(s % d for s in range(virtual_stages * d)), "loop")
    return Layout(schedule, d, tuple(s if s < d else 2 * d - 1 - s for s in range(2 * d)), "v")


def resolve_search(search: str, num_ranks: int) -> str:
    if search not in SEARCHES and search != "memory":
        raise ValueError(f"search must be one of {', '.join(map(repr, SEARCHES))}, got {search!r}")
    if search == "auto":
        return "full" if num_ranks <= _FULL_SEARCH_MAX_RANKS else "fast"
    return search


def microbatch_problem(
    schedule: str, num_ranks: int, num_microbatches: int, *, virtual_stages: int = 2
) -> str | None:
    """Why torch's schedule class would refuse ``num_microbatches``, or None. Mirrors torch 2.13's checks
    (building a large order only to see it refused costs tens of seconds); tests compare with torch."""
    schedule = canonical_schedule(schedule)
    d, m = num_ranks, num_microbatches
    if schedule in ("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble"):
        rounds = max(1, m // d)
        if m % rounds:
            return (
                f"{schedule} needs the number of microbatches to be a multiple of its rounds "
                f"(max(1, m // pp) = {rounds}); m = {m} is not"
            )
    if schedule == "ScheduleDualPipeV" and m < 2 * d:
        return f"ScheduleDualPipeV needs at least as many microbatches as stages ({2 * d}); m = {m}"
    if schedule in OURS and d < 2:
        return f"{schedule} needs at least 2 pipeline ranks"
    return None


def build_order(
    schedule: str,
    num_ranks: int,
    num_microbatches: int,
    costs: Costs | Mapping[str, float],
    *,
    search: str = "full",
    memory_cap: float | None = None,
    virtual_stages: int = 2,
) -> Order | dict[int, list[Any]]:
    """rank -> compute actions of ``schedule`` (``memory_cap``: the adaptive schedule's cap, chunk units)."""
    schedule = canonical_schedule(schedule)
    d, m = num_ranks, num_microbatches
    costs = Costs.coerce(costs)
    if schedule == "Schedule1F1B":
        from pp_offload.order.baselines import one_f_one_b_order

        return one_f_one_b_order(d, m)
    if schedule in TORCH:
        per_rank = (
            virtual_stages if schedule in ("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble") else 2
        )
        return {r: list(actions) for r, actions in enumerate(_torch_order(schedule, d, m, per_rank))}
    from pp_offload.order import vshape

    caps = {
        "ScheduleVMin": vshape.v_min_cap(d),
        "ScheduleVHalf": vshape.v_half_cap(d),
        "ScheduleVZB": 2 * d,
    }
    cap = float(caps.get(schedule, memory_cap if memory_cap is not None else 2 * d))
    if search == "full":
        if schedule in caps:
            gen = {"ScheduleVMin": vshape.v_min_order, "ScheduleVHalf": vshape.v_half_order}.get(
                schedule, vshape.v_zb_order
            )
            return gen(d, m, costs)
        reference = vshape.one_f_one_b_peak(d, m)
        return vshape.adaptive_v_order(d, m, cap / reference, costs)
    return _fast_order(schedule, d, m, costs, cap, compacted=search != "memory")


@lru_cache(maxsize=64)
def _torch_order(schedule: str, d: int, m: int, per_rank: int) -> tuple[tuple[Any, ...], ...]:
    """torch's order of ``schedule``, built once per size: it does not depend on the costs, and the planner
    and ``schedule: auto`` judge every schedule once per recompute plan (its actions are immutable named
    tuples; `build_order` hands out fresh lists)."""
    from pp_offload.runtime import compat

    return tuple(tuple(a) for a in compat.schedule_ops(schedule.removeprefix("Schedule"), d, m, per_rank))


def _fast_order(schedule: str, d: int, m: int, costs: Costs, cap: float, *, compacted: bool) -> Order:
    """``compacted=False`` (search "memory", used to size alternatives in error messages): the same
    candidates uncompacted, which have the same peak and cost a fraction of the time."""
    from pp_offload.order.blocks import v_block
    from pp_offload.order.compact import compact
    from pp_offload.order.rhythm import rhythm_v_order
    from pp_offload.order.v_candidates import _candidates
    from pp_offload.sim import OrderDeadlockError, simulate

    if schedule == "ScheduleVMin":
        x = 2 if d % 3 == 0 else 0
        candidates = [v_block(d, down=[1] * (d - 1), backward_delay=1 + x, turn_f=1, turn_b=1).repeat(m)]
    elif schedule == "ScheduleVHalf":
        x = 3 if d % 2 == 0 else 0
        candidates = [v_block(d, down=[2] * (d - 1), backward_delay=1 + x, turn_f=1, turn_b=2).repeat(m)]
    elif schedule == "ScheduleVZB":
        candidates = [rhythm_v_order(d, m, 0)]
    else:  # adaptive: the offset-pattern blocks of the paper's adaptive scheduler and the rhythm orders
        candidates = [c.block.repeat(m) for c in _candidates(d)]
        candidates += [rhythm_v_order(d, m, t) for t in range(2 * d - 1)]
    best = None
    for order in candidates:
        try:
            result = simulate(order, costs)
        except OrderDeadlockError:
            continue
        if result.peak <= cap + 1e-9 and (best is None or result.makespan < best[0] - 1e-12):
            best = (result.makespan, order)
    if best is None:
        # the greedy scheduler reaches any cap >= 2 chunk units (see vshape.smallest_feasible_peak)
        from pp_offload.order import vshape

        return vshape.adaptive_v_order(d, m, cap / vshape.one_f_one_b_peak(d, m), costs)
    if not compacted:
        return best[1]
    return compact(best[1], costs, memory_cap=dict.fromkeys(range(d), cap))
