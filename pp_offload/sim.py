"""Replay any pipeline order with costs: makespan, bubble and per-rank activation memory.

This is the one yardstick shared by the order generators, the tests, the benchmarks and (later) the
planner. It reads our `Action`s and torch's `_Action`s alike (same field names), so torch's own
schedules (`get_schedule_ops(...)`) and ours are measured the same way.

Model (the papers'):
- Every rank runs its actions in the given order; an action starts when the previous action on its
  rank has ended and its dependencies have ended (plus ``costs.comm`` if the dependency ran on another
  rank). F(s, j) needs F(s-1, j); I(s, j) or B(s, j) needs the input-gradient pass of stage s+1 (the last
  stage needs its own F); W(s, j) needs I(s, j).
- Costs are per *chunk* (one V stage = half a rank's layers). A schedule with ``n`` stages on ``d`` ranks
  has stages of ``2d/n`` chunks, so 1F1B's stage costs 2F and holds 2 chunk units: all schedules are
  compared on the same model.
- Activation memory of a (stage, microbatch) is held from the start of its F until the end of its W
  (or B): torch keeps saved tensors until W because both I and W unpack them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from pp_offload.order.actions import B, Costs, F, I, W

_COMPUTE = (F, I, W, B)


def _kind(action: Any) -> str:
    kind = action.computation_type
    return str(getattr(kind, "value", kind))


def flatten(actions: Iterable[Any]) -> list[tuple[int, str, int]]:
    """A rank's actions as ``(stage, kind, microbatch)`` compute passes, in order.

    ``None`` slots and non-compute actions (SEND/RECV/UNSHARD/...) are skipped; torch's OVERLAP_F_B
    runs its sub-actions one after the other, as torch's runtime does.
    """
    passes: list[tuple[int, str, int]] = []
    for action in actions:
        if action is None:
            continue
        subs = getattr(action, "sub_actions", None)
        if subs:
            passes.extend(flatten(subs))
            continue
        kind = _kind(action)
        if kind in _COMPUTE:
            passes.append((int(action.stage_index), kind, int(action.microbatch_index)))
    return passes


def dependency(stage: int, kind: str, mb: int, num_stages: int) -> tuple[int, str, int] | None:
    """The pass that must end before ``(stage, kind, mb)`` can start, keyed like `flatten`'s output.

    Input-gradient passes are keyed with kind ``"I"`` whether they ran as I or as a full B.
    """
    if kind == F:
        return (stage - 1, F, mb) if stage > 0 else None
    if kind in (I, B):
        return (stage, F, mb) if stage == num_stages - 1 else (stage + 1, I, mb)
    return (stage, I, mb)  # W


@dataclass
class SimResult:
    """What one replay of an order measured. Times are in cost units, memory in chunk units."""

    makespan: float
    busy: dict[int, float]
    peak_memory: dict[int, float]
    timeline: dict[int, list[tuple[tuple[int, str, int], float, float]]]
    memory_curve: dict[int, list[tuple[float, float]]] = field(repr=False)

    @property
    def bubble(self) -> float:
        """1 - busiest rank's compute time / makespan."""
        return 1.0 - max(self.busy.values()) / self.makespan if self.makespan > 0 else 0.0

    @property
    def peak(self) -> float:
        """Largest per-rank activation peak."""
        return max(self.peak_memory.values())


class OrderDeadlockError(ValueError):
    """Raised when no rank can make progress: a dependency is missing or ordered after its user."""


def simulate(
    order: Mapping[int, Iterable[Any]], costs: Costs | Mapping[str, float] | None = None
) -> SimResult:
    """Replay ``order`` (rank -> actions) with ``costs`` and measure time and memory.

    Raises `OrderDeadlockError` naming the stuck actions if the order can't complete.
    """
    costs = Costs.coerce(costs)
    ranks = sorted(order)
    passes = {r: flatten(order[r]) for r in ranks}
    all_passes = [p for r in ranks for p in passes[r]]
    if not all_passes:
        raise ValueError("order has no compute actions")
    num_stages = max(s for s, _, _ in all_passes) + 1
    scale = 2.0 * len(ranks) / num_stages  # chunks per stage
    rank_of_stage = {s: r for r in ranks for s, _, _ in passes[r]}

    deps = {r: [dependency(s, k, j, num_stages) for s, k, j in passes[r]] for r in ranks}
    duration = {kind: costs.of(kind) * scale for kind in _COMPUTE}
    end: dict[tuple[int, str, int], float] = {}
    producer_rank: dict[tuple[int, str, int], int] = {}
    timeline: dict[int, list] = {r: [] for r in ranks}
    clock = {r: 0.0 for r in ranks}
    pos = {r: 0 for r in ranks}
    remaining = len(all_passes)
    while remaining:
        progressed = False
        for r in ranks:
            seq = passes[r]
            while pos[r] < len(seq):
                stage, kind, mb = seq[pos[r]]
                dep = deps[r][pos[r]]
                ready = 0.0
                if dep is not None:
                    if dep not in end:
                        break
                    ready = end[dep] + (costs.comm if producer_rank[dep] != r else 0.0)
                start = max(clock[r], ready)
                finish = start + duration[kind]
                key = (stage, I if kind == B else kind, mb)
                end[key] = finish
                producer_rank[key] = r
                timeline[r].append(((stage, kind, mb), start, finish))
                clock[r] = finish
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: "".join(map(str, passes[r][pos[r]])) for r in ranks if pos[r] < len(passes[r])}
            raise OrderDeadlockError(
                f"order cannot complete: each rank's next action waits on a pass that never runs "
                f"before it (rank -> blocked action: {stuck}); stage -> rank: {rank_of_stage}"
            )

    busy = {r: sum(e - s for _, s, e in timeline[r]) for r in ranks}
    curves, peaks = {}, {}
    for r in ranks:
        events = []
        for (_, kind, _), start, finish in timeline[r]:
            if kind == F:
                events.append((start, scale))
            elif kind in (W, B):
                events.append((finish, -scale))
        events.sort(key=lambda e: (e[0], e[1]))  # frees before allocations at the same instant
        level, peak, curve = 0.0, 0.0, [(0.0, 0.0)]
        for t, delta in events:
            level += delta
            peak = max(peak, level)
            curve.append((t, level))
        curves[r], peaks[r] = curve, peak
    makespan = max(clock.values())
    return SimResult(makespan, busy, peaks, timeline, curves)


def as_executed_by_torch(order: Mapping[int, Iterable[Any]]) -> dict[int, list[Any]]:
    """``order`` as torch's runtime executes it: stage 0's I actions dropped, its W actions run as B.

    With split backward, torch's first stage computes nothing at I (there is no input gradient to send)
    and runs one full backward at its W, so simulating this rewrite predicts real runs better than the
    papers' model, where stage 0's I and W cost what any stage's do. Works on torch ``_Action``
    (sub-actions of OVERLAP_F_B included) and on ``pp_offload.order.Action``.
    """

    def convert(action):
        if action is None:
            return None
        subs = getattr(action, "sub_actions", None)
        if subs:
            new_subs = tuple(a for a in (convert(s) for s in subs) if a is not None)
            return action._replace(sub_actions=new_subs)
        kind = str(getattr(action.computation_type, "value", action.computation_type))
        if action.stage_index != 0 or kind not in ("I", "W"):
            return action
        if kind == "I":
            return None
        ctype = action.computation_type
        return action._replace(computation_type=type(ctype)("B") if isinstance(ctype, Enum) else "B")

    out: dict[int, list[Any]] = {}
    for rank, actions in order.items():
        out[rank] = [c for c in (convert(a) for a in actions) if c is not None]
    return out
