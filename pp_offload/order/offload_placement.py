"""Where OFFLOAD and RELOAD actions go in a simulated order: the per-chunk windows, copy slots and the
moves that keep a reload ahead of its backward (package-internal helpers of `pp_offload.order.offload`).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from pp_offload.order.actions import OFFLOAD, RELOAD, Action, B, F, W
from pp_offload.order.offload_policy import _EPS, OffloadPolicy, _per_stage
from pp_offload.sim import SimResult, flatten


def _unit_shares(unit_compute: Any, counts: list[int]) -> list[tuple[float, ...]]:
    """Per stage, each unit's share of the stage's passes (``unit_compute`` entries, else equal shares)."""
    given = None
    if unit_compute:  # a stage without units (no decoder layers: the LM head's) has None
        entries = list(unit_compute.values()) if isinstance(unit_compute, Mapping) else list(unit_compute)
        _per_stage([0.0 if e is None else e for e in entries], len(counts), "unit_compute", integer=False)
        given = unit_compute
    out = []
    for s, n in enumerate(counts):
        entry = given[s] if given is not None else None
        if entry is None:
            out.append((1.0 / n,) * n if n else ())
            continue
        entry = tuple(float(x) for x in entry)
        if len(entry) != n or abs(sum(entry) - 1.0) > 1e-6:
            raise ValueError(
                f"unit_compute[{s}] must hold {n} shares summing to 1 (one per unit), got {entry!r}"
            )
        out.append(entry)
    return out


def _offload_end(c: _Chunk, k: int) -> float:
    """When the copy of the chunk's first ``k`` units ends, each issued at its unit's forward end
    (idle lane)."""
    t = c.f_start
    done = 0.0
    for i in range(k):
        done += c.shares[i]
        t = max(c.f_start + done * (c.f_end - c.f_start), t) + c.copy_of(i)
    return t


def _latest_reload_start(
    c: _Chunk, k: int, back_start: float, margin: float, duration: float | None = None
) -> float:
    """The latest start of a reload of units k-1..0 (in that order) that still ends every unit
    ``margin`` unit-backwards before the backward (of ``duration``, default the first) reaches it."""
    span = c.back_duration if duration is None else duration
    latest, copied = math.inf, 0.0
    after = c.after
    for j in range(k - 1, -1, -1):
        copied += c.copy_of(j)
        latest = min(latest, back_start + (after[j] - margin * c.shares[j]) * span - copied)
    return latest


def _layers_that_fit(c: _Chunk, back_start: float, margin: float) -> int:
    """The most layers whose round trip the chunk's window hides with idle copy lanes."""
    best = 0
    for k in range(1, c.layers + 1):
        if _offload_end(c, k) <= _latest_reload_start(c, k, back_start, margin) + _EPS:
            best = k
    return best


def _layered_slot(c: _Chunk, timeline, policy: OffloadPolicy) -> int:
    """Budget mode's `_initial_slot`: the latest slot (up to right before the backward, whose later
    layers hide part of the reload) whose reload starts early enough."""
    first, last = c.f_index + 1, c.back_index
    if policy.reload_lead is not None:
        return max(first, last - policy.reload_lead)
    offload_end = _offload_end(c, c.moved)
    latest = _latest_reload_start(c, c.moved, c.back_start, policy.reload_margin)
    for candidate in range(last, first - 1, -1):
        if max(timeline[candidate - 1][2], offload_end) <= latest + _EPS:
            return candidate
    return first


def _move_late_layered(
    result: SimResult, reloads: dict[int, dict[tuple[int, int], _Chunk]], margin: float
) -> bool:
    """Budget mode's `_move_late_reloads`: a RELOAD whose replayed start is later than its layers allow
    moves one pass earlier; a late RELOAD before W that cannot move earlier drops its I-to-W pair."""
    moved = False
    for rank, chunks in reloads.items():
        if not chunks:
            continue
        timeline = result.timeline[rank]
        seen: set[tuple[int, int]] = set()
        for action, start, _ in result.transfers[rank]:
            if action.computation_type != RELOAD:
                continue
            key = (action.stage_index, action.microbatch_index)
            c = chunks[key]
            if key not in seen:  # the first RELOAD, before I (or B)
                seen.add(key)
                back_start = timeline[c.back_index][1]
                if (
                    start > _latest_reload_start(c, c.moved, back_start, margin) + _EPS
                    and c.slot > c.f_index + 1
                ):
                    c.slot -= 1
                    moved = True
                continue
            _, w_start, w_end = timeline[c.w_index]
            if c.w_copy is not None:  # deferred W: one copy of the queue, needed whole when W starts
                latest = w_start - margin * (w_end - w_start) - c.w_copy
            else:
                latest = _latest_reload_start(c, c.moved, w_start, margin, w_end - w_start)
            if start > latest + _EPS:
                c.w_slot = c.w_slot - 1 if c.w_slot > c.i_index + 1 else -1
                moved = True
    return moved


def _w_slot(c: _Chunk, timeline, margin: float, copy: float | None = None) -> int:
    """Where a chunk dropped after its I is reloaded for its W: the latest slot whose reload (issued when
    the pass before the slot ends) still ends in time, if the chunk then stays off the device at least as
    long as the reload takes; else -1 (it stays on the device from I to W). Budget mode (``copy`` None):
    its moved units, each needed ``margin`` unit-backwards before W reaches it; whole chunks: one copy of
    ``copy``, ending ``margin`` W-durations before W starts. Deferred W (``c.w_copy`` set): one copy of the
    chunk's W queue, whatever the policy."""
    if c.i_index < 0 or c.w_index < 0 or c.w_index <= c.i_index + 1:
        return -1
    i_end = timeline[c.i_index][2]
    _, w_start, w_end = timeline[c.w_index]
    if c.w_copy is not None:  # deferred W: the pair moves the chunk's W queue, which W needs whole
        copy = c.w_copy
    if copy is None:
        latest = _latest_reload_start(c, c.moved, w_start, margin, w_end - w_start)
        copy = sum(map(c.copy_of, range(c.moved)))
    else:
        latest = w_start - margin * (w_end - w_start) - copy
    for slot in range(c.w_index, c.i_index, -1):
        issue = timeline[slot - 1][2]
        if issue <= latest + _EPS:
            return slot if issue - i_end >= copy - _EPS else -1
    return -1


@dataclass
class _Chunk:
    """One (stage, microbatch) on its rank: indices into the rank's compute passes and simulated times."""

    key: tuple[int, int]
    f_index: int
    f_start: float
    f_end: float
    back_index: int = -1  # first backward pass (I or B; W when there is neither)
    back_start: float = math.inf
    free_end: float = -math.inf  # end of W or B, when the activations die
    slot: int = -1  # RELOAD goes right before compute pass `slot`
    reload_start: float = math.inf  # estimated from the compute-only timeline
    # budget mode: the stage's layers, one layer's copy time, the backward's duration, layers moved
    layers: int = 0
    layer_copy: float = 0.0
    layer_copies: tuple[float, ...] | None = None  # per layer, when they differ (the replay uses them)
    shares: tuple[float, ...] = ()  # each unit's share of the chunk's passes
    back_duration: float = 0.0
    fit: int = 0
    moved: int = 0
    # budget mode, zero-bubble orders: the I and W passes, and the second RELOAD's slot before W (-1: none)
    i_index: int = -1
    w_index: int = -1
    w_slot: int = -1
    w_copy: float | None = None  # deferred W (`Costs.queue`): the queue's one-way copy time, which the
    # I-to-W pair moves instead of the chunk (its saved tensors are freed when I ends)

    @property
    def lifespan(self) -> float:
        return self.free_end - self.f_start

    @property
    def compute(self) -> tuple[float, ...] | None:
        """The shares for `LayeredChunk.compute` (None where they are equal: the plain layer model)."""
        return None if len(set(self.shares)) <= 1 else self.shares

    def copy_of(self, unit: int) -> float:
        """Unit ``unit``'s one-way copy time."""
        return self.layer_copies[unit] if self.layer_copies is not None else self.layer_copy

    @property
    def window(self) -> float:
        return self.back_start - self.f_end

    @cached_property
    def after(self) -> tuple[float, ...]:
        """Per unit j, the share of the backward before it reaches unit j (it runs later units first);
        computed once: the budget search asks for it at every refinement round (`_latest_reload_start`)."""
        before, after = 0.0, [0.0] * self.layers
        for j in range(self.layers - 1, -1, -1):
            after[j] = before
            before += self.shares[j]
        return tuple(after)


def _chunks(timeline) -> dict[tuple[int, int], _Chunk]:
    chunks: dict[tuple[int, int], _Chunk] = {}
    for index, ((stage, kind, mb), start, finish) in enumerate(timeline):
        key = (stage, mb)
        if kind == F:
            chunks[key] = _Chunk(key, index, start, finish)
            continue
        chunk = chunks.get(key)
        if chunk is None:
            continue
        if chunk.back_index < 0:  # I or B; W only when the chunk has neither (I always precedes W)
            chunk.back_index, chunk.back_start = index, start
        if kind in (W, B):
            chunk.free_end = max(chunk.free_end, finish)
    return {k: c for k, c in chunks.items() if c.back_index >= 0 and c.free_end > -math.inf}


def _how_many(policy: OffloadPolicy, total: int, eligible: int) -> int:
    if policy.mode == "full":
        return eligible
    if policy.count is not None:
        return min(policy.count, eligible)
    return min(math.floor(policy.fraction * total + 0.5), eligible)


def _longest_first(chunks: list[_Chunk], n: int) -> list[_Chunk]:
    """The ``n`` longest-lived chunks; ties at the cut are spread evenly over forward time."""
    if n <= 0:
        return []
    ranked = sorted(chunks, key=lambda c: (-c.lifespan, c.f_start))
    if n >= len(ranked):
        return ranked
    cut = ranked[n - 1].lifespan
    tol = 1e-6 * max(1.0, abs(cut))
    sure = [c for c in ranked if c.lifespan > cut + tol]
    tied = sorted((c for c in ranked if abs(c.lifespan - cut) <= tol), key=lambda c: c.f_start)
    need = n - len(sure)
    picks = [tied[int((i + 0.5) * len(tied) / need)] for i in range(need)]
    return sure + picks


def _lower_peak_first(
    chunks: list[_Chunk], eligible: list[_Chunk], n: int, copy: float, scale: float, timeline=None
) -> list[_Chunk]:
    """``n`` of ``eligible`` that bring the rank's device-resident peak lowest, then longest-lived.

    In the compute-only timeline an offloaded chunk is off the device from its offload's end to its
    reload's start (its *gap*). For a target peak P, every instant whose level exceeds P needs that many
    chunk units of gaps over it: a multi-cover of points by intervals, which the left-to-right sweep
    taking, where cover is missing, the gap reaching furthest right (the longest-lived among equal ones)
    solves with the fewest chunks. The lowest P reachable within ``n`` is found by bisection; the rest of
    the share goes to the longest-lived chunks left.

    Why not plain longest-first: lifespans of a compacted or interleaved order differ by a pass or two
    between neighbouring microbatches, and longest-first then offloads every other microbatch of the
    steady phase and nothing of the warm-up or cool-down, where the peak may sit unchanged.

    A chunk that is dropped after its I and reloaded for its W (``w_slot``, with the rank's ``timeline``)
    has a second gap, from its I's end to that reload's issue; taking the chunk for one gap takes the
    other too (the sweep counts it where it starts), so the cover sees what the drop frees in the cool-down.
    """
    second = {id(c): _w_gap(c, timeline) for c in eligible if timeline is not None and c.w_slot >= 0}
    times = sorted(
        {t for c in chunks for t in (c.f_start, c.free_end)}
        | {t for c in eligible for t in _gap(c, copy)}
        | {t for gap in second.values() for t in gap}
    )
    index = {t: i for i, t in enumerate(times)}
    delta = [0.0] * (len(times) + 1)
    for c in chunks:
        delta[index[c.f_start]] += scale
        delta[index[c.free_end]] -= scale
    level, running = [], 0.0
    for i in range(len(times)):
        running += delta[i]
        level.append(running)  # on [times[i], times[i + 1])
    spans = []  # (lo, hi, chunk): the gap covers segments lo .. hi-1
    linked: dict[int, list[tuple[int, int]]] = {}  # chunk -> all its gaps (lo, hi)
    for c in eligible:
        for start, end in (_gap(c, copy), *((second[id(c)],) if id(c) in second else ())):
            if index[end] > index[start]:
                spans.append((index[start], index[end], c))
                linked.setdefault(id(c), []).append((index[start], index[end]))
    spans.sort(key=lambda s: s[0])

    def cover(target: float) -> list[_Chunk] | None:
        """Fewest gaps keeping every segment at or below ``target``; None if more than ``n`` needed."""
        heap: list[tuple[int, float, float, int]] = []
        ends = [0] * (len(times) + 1)
        begins = [0] * (len(times) + 1)  # a taken chunk's later gap, counted from where it starts
        chosen: list[_Chunk] = []
        taken: set[int] = set()
        active = nxt = 0
        for i, value in enumerate(level):
            active += begins[i] - ends[i]
            while nxt < len(spans) and spans[nxt][0] <= i:
                heapq.heappush(heap, (-spans[nxt][1], -spans[nxt][2].lifespan, spans[nxt][2].f_start, nxt))
                nxt += 1
            need = math.ceil((value - target) / scale - 1e-9)
            while active < need:
                while heap and (-heap[0][0] <= i or id(spans[heap[0][3]][2]) in taken):
                    heapq.heappop(heap)  # gaps ending before this segment, or of a chunk already taken
                if not heap or len(chosen) == n:
                    return None
                _, _, _, k = heapq.heappop(heap)
                c = spans[k][2]
                chosen.append(c)
                taken.add(id(c))
                for lo, hi in linked[id(c)]:
                    if lo <= i < hi:
                        active += 1
                        ends[hi] += 1
                    elif lo > i:
                        begins[lo] += 1
                        ends[hi] += 1
        return chosen

    peak = max(level)
    best: list[_Chunk] = []
    low, high = 0, round(peak / scale)  # bisect on the number of chunk units removed from the peak
    while low < high:
        mid = (low + high + 1) // 2
        found = cover(peak - mid * scale)
        if found is None:
            high = mid - 1
        else:
            low, best = mid, found
    if low == 0:
        best = []
    taken = {id(c) for c in best}
    rest = sorted((c for c in eligible if id(c) not in taken), key=lambda c: (-c.lifespan, c.f_start))
    return best + rest[: n - len(best)]


def _gap(chunk: _Chunk, copy: float) -> tuple[float, float]:
    """When an offloaded chunk is off the device: its offload's end to its reload's start."""
    return chunk.f_end + copy, max(chunk.f_end + copy, chunk.reload_start)


def _w_gap(chunk: _Chunk, timeline) -> tuple[float, float]:
    """When a chunk dropped after its I is off the device again: its I's end to the issue of its reload for
    W (the end of the pass before ``w_slot``) in the compute-only timeline."""
    i_end = timeline[chunk.i_index][2]
    return i_end, max(i_end, timeline[chunk.w_slot - 1][2])


def _initial_slot(chunk: _Chunk, timeline, copy: float, policy: OffloadPolicy) -> int:
    """Where the RELOAD goes, from the compute-only timeline: before compute pass ``slot``.

    Latest slot whose reload (issued when the pass before the slot ends, started no earlier than the
    OFFLOAD's end) ends ``reload_margin`` backward passes before the backward starts; at least one pass
    before it when the window has room; otherwise right after the OFFLOAD. Also records the estimated
    reload start on ``chunk``.
    """
    first = chunk.f_index + 1  # right after the F (and its OFFLOAD)
    last = chunk.back_index
    offload_end = chunk.f_end + copy
    if policy.reload_lead is not None:
        slot = max(first, last - policy.reload_lead)
    else:
        _, b_start, b_end = timeline[last]
        deadline = b_start - policy.reload_margin * (b_end - b_start) + _EPS
        top = last - 1 if last - 1 >= first else last
        slot = first
        for candidate in range(top, first - 1, -1):
            if max(timeline[candidate - 1][2], offload_end) + copy <= deadline:
                slot = candidate
                break
    chunk.reload_start = max(timeline[slot - 1][2], offload_end)
    return slot


def _move_late_reloads(
    result: SimResult, reloads: dict[int, dict[tuple[int, int], _Chunk]], margin: float
) -> bool:
    """Move one pass earlier every RELOAD that, replayed with the lanes, ends later than ``margin``
    backward passes before its backward starts. Returns whether anything moved."""
    moved = False
    for rank, chunks in reloads.items():
        if not chunks:
            continue
        timeline = result.timeline[rank]
        seen: set[tuple[int, int]] = set()
        for action, _, finish in result.transfers[rank]:
            if action.computation_type != RELOAD:
                continue
            key = (action.stage_index, action.microbatch_index)
            chunk = chunks[key]
            if key in seen:  # the second RELOAD, before W (drop_after_i): earlier, or drop the pair
                _, w_start, w_end = timeline[chunk.w_index]
                if finish > w_start - margin * (w_end - w_start) + _EPS:
                    chunk.w_slot = chunk.w_slot - 1 if chunk.w_slot > chunk.i_index + 1 else -1
                    moved = True
                continue
            seen.add(key)
            _, b_start, b_end = timeline[chunk.back_index]
            if finish > b_start - margin * (b_end - b_start) + _EPS and chunk.slot > chunk.f_index + 1:
                chunk.slot -= 1
                moved = True
    return moved


def _insert(compute: dict[int, list[Action]], reloads: dict[int, dict[tuple[int, int], _Chunk]]):
    """``compute`` with OFFLOAD right after each chosen F and RELOAD right before compute pass ``slot``
    (after any OFFLOAD at the same place; RELOADs sharing a slot in the order of their backwards)."""
    out: dict[int, list[Action]] = {}
    for rank, actions in compute.items():
        chunks = reloads.get(rank, {})
        if not chunks:
            out[rank] = list(actions)
            continue
        before: dict[int, list[_Chunk]] = {}
        for c in chunks.values():
            before.setdefault(c.slot, []).append(c)
            if c.w_slot >= 0:  # budget, zero-bubble orders: dropped after I, reloaded before W
                before.setdefault(c.w_slot, []).append(c)
        for index, group in before.items():
            group.sort(key=lambda c: c.back_index if c.slot == index else c.w_index)
        after_i = {c.i_index: c for c in chunks.values() if c.w_slot >= 0}
        seq: list[Action] = []
        for index, action in enumerate(actions):
            seq.extend(Action(c.key[0], RELOAD, c.key[1]) for c in before.get(index, ()))
            seq.append(action)
            if action.computation_type == F and (action.stage_index, action.microbatch_index) in chunks:
                # the RELOAD of a chunk whose slot is the next pass still comes after this OFFLOAD
                seq.append(Action(action.stage_index, OFFLOAD, action.microbatch_index))
            elif index in after_i:
                seq.append(Action(action.stage_index, OFFLOAD, action.microbatch_index))
        seq.extend(Action(c.key[0], RELOAD, c.key[1]) for c in before.get(len(actions), ()))
        out[rank] = seq
    return out


def _compute_order(order: Mapping[int, Iterable[Any]] | Iterable[Iterable[Any]]) -> dict[int, list[Action]]:
    """Any order (ours, torch's ``_Action`` lists with ``None`` slots) as rank -> compute `Action`s."""
    items = order.items() if isinstance(order, Mapping) else enumerate(order)
    out: dict[int, list[Action]] = {}
    for rank, actions in items:
        actions = list(actions)
        for a in actions:
            if a is not None:
                kind = str(getattr(a.computation_type, "value", a.computation_type))
                if kind in (OFFLOAD, RELOAD):
                    raise ValueError(
                        f"order already holds {a} on rank {rank}; plan_offload takes the compute-only order"
                    )
        out[int(rank)] = [Action(s, k, j) for s, k, j in flatten(actions)]
    if not any(out.values()):
        raise ValueError("order has no compute actions")
    return out
