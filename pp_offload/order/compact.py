"""Squeeze an order with real costs and fill its idle gaps without raising any rank's memory peak.

Repeating a building block gives a good *stable phase* but a ragged warm-up and cool-down. Squeezing
(start every pass as early as its rank and its dependencies allow, same per-rank order) is what
`pp_offload.sim.simulate` does. On top of that, `compact` lets a rank that would sit idle waiting for
its next pass run a later pass of its own list that is ready now and *ends before the waited-for pass
could start anyway*. Such a move never delays anything, so the makespan can only shrink; F moves are
only allowed while the rank stays under its memory cap (by default the peak the squeezed order already
has), so memory never grows. Per (stage, kind), microbatches keep their order, which torch's
runtime and lowering expect.
"""

from __future__ import annotations

import heapq

from pp_offload.order.actions import Action, B, Costs, F, I, Order, W
from pp_offload.order.replay import is_v_order, replay_ranks
from pp_offload.sim import dependency, simulate

_EPS = 1e-9


def compact(
    order: Order,
    costs: Costs,
    *,
    memory_cap: dict[int, float] | None = None,
    lookahead: int | None = None,
    rounds: int = 3,
) -> Order:
    """Return ``order`` with gaps filled (see module doc); never slower, never above ``memory_cap``.

    ``memory_cap`` (rank -> chunk units) defaults to each rank's peak in the squeezed ``order``.
    ``lookahead`` bounds how far down its list a rank looks for a filler (default: 6 x ranks).
    """
    return compact_bound(order, costs, memory_cap=memory_cap, lookahead=lookahead, rounds=rounds)[0]


def compact_bound(
    order: Order,
    costs: Costs,
    *,
    memory_cap: dict[int, float] | None = None,
    lookahead: int | None = None,
    rounds: int = 3,
) -> tuple[Order, bool]:
    """`compact`, and whether ``memory_cap`` decided anything (turned a forward down or rejected a round).

    Why: when it did not, compacting the same order under any larger cap takes exactly the same
    decisions, so the adaptive search (which compacts one candidate under cap after cap) can reuse the
    result instead of recomputing it.
    """
    measure = _replay_ranks if is_v_order(order) else _simulate_ranks
    base_time, base_peaks = measure(order, costs)
    caps = dict(base_peaks) if memory_cap is None else dict(memory_cap)
    best, bound, _, _ = _compact_from(order, costs, caps, lookahead, rounds, measure, base_time, base_peaks)
    return best, bound


def compact_measured(
    order: Order, costs: Costs, *, makespan: float, peak: int, memory_cap: float, rounds: int = 3
) -> tuple[Order, bool, float, int]:
    """`compact_bound` of a V order the caller has replayed already (``makespan``, ``peak``), under one
    cap for every rank; also returns the result's makespan and peak.

    Why: the adaptive search replays every candidate before it compacts it and every result after;
    compaction replays both anyway, so passing the first in and the second out saves two of the few
    replays each compaction costs (the same numbers: the same replay of the same order).
    """
    if not is_v_order(order):
        best, bound = compact_bound(
            order, costs, memory_cap=dict.fromkeys(order, float(memory_cap)), rounds=rounds
        )
        best_time, peaks = _simulate_ranks(best, costs)
        return best, bound, best_time, int(max(peaks.values()))
    caps = dict.fromkeys(order, float(memory_cap))
    best, bound, best_time, best_peaks = _compact_from(
        order, costs, caps, None, rounds, _replay_ranks, makespan, None
    )
    if best_peaks is None:  # no round improved: ``order`` itself, as measured by the caller
        return best, bound, makespan, peak
    return best, bound, best_time, int(max(best_peaks.values()))


def _compact_from(order, costs, caps, lookahead, rounds, measure, base_time, base_peaks):
    """The compaction rounds of `compact_bound` from a measured ``order``: (best order, bound, its
    makespan, its per-rank peaks or None when it is ``order`` itself and ``base_peaks`` was None)."""
    best, best_time, best_peaks = order, base_time, base_peaks
    bound = False
    for _ in range(rounds):
        improved = False
        for promote in (False, True):
            candidate, hit = _fill_once(best, costs, caps, lookahead or 6 * len(order), promote)
            bound = bound or hit
            makespan, peaks = measure(candidate, costs)
            fits = all(peaks[r] <= caps[r] + _EPS for r in candidate)
            bound = bound or not fits
            if fits and makespan < best_time - _EPS:
                best, best_time, best_peaks, improved = candidate, makespan, peaks, True
        if not improved:
            break
    return best, bound, best_time, best_peaks


def _replay_ranks(order: Order, costs: Costs) -> tuple[float, dict[int, float]]:
    makespan, peaks = replay_ranks(order, costs)
    return makespan, dict(enumerate(peaks))


def _simulate_ranks(order: Order, costs: Costs) -> tuple[float, dict[int, float]]:
    result = simulate(order, costs)
    return result.makespan, result.peak_memory


def _fill_once(
    order: Order, costs: Costs, caps: dict[int, float], lookahead: int, promote_input_grads: bool
) -> tuple[Order, bool]:
    """One pass of gap filling, and whether the memory cap turned any forward down. With
    ``promote_input_grads`` a ready I also jumps ahead of a pending W: I passes are on the critical path
    of the other ranks, W passes only free memory, and moving an I earlier changes no rank's memory.

    Event-driven: the rank that runs next is the one whose head pass can start first (lowest rank on
    ties), kept in a heap; a commit only changes the start of its own rank's head and of the heads
    waiting on the pass it ends, so each pass costs O(log d) instead of a scan of every rank.

    Ranks are numbered by position (in rank order, so ties break the same way) and every pass, and every
    dependency named, gets an integer id (a B pass stands for its I): end times, producers and waiters
    are lists indexed by it, and each rank's passes know their kind, lane, duration, memory change, own
    id and dependency's id (-1: none) by position, so the hot loop hashes nothing.
    """
    ranks = sorted(order)
    n = len(ranks)
    num_stages = max(a.stage_index for r in ranks for a in order[r]) + 1
    scale = 2.0 * n / num_stages
    comm = costs.comm
    cost_of = {kind: costs.of(kind) * scale for kind in (F, I, W, B)}
    change = {F: scale, W: -scale, B: -scale}
    queues = [list(order[r]) for r in ranks]
    kinds = [[a.computation_type for a in q] for q in queues]
    lanes_of = [[(a.stage_index, a.computation_type) for a in q] for q in queues]
    durations = [[cost_of[k] for k in ks] for ks in kinds]
    changes = [[change.get(k, 0.0) for k in ks] for ks in kinds]
    ids: dict[tuple[int, str, int], int] = {}
    own: list[list[int]] = []
    needs: list[list[int]] = []
    for q in queues:
        mine, deps = [], []
        for a in q:
            kind = a.computation_type
            mine.append(
                ids.setdefault((a.stage_index, I if kind == B else kind, a.microbatch_index), len(ids))
            )
            dep = dependency(a.stage_index, kind, a.microbatch_index, num_stages)
            deps.append(-1 if dep is None else ids.setdefault(dep, len(ids)))
        own.append(mine)
        needs.append(deps)
    end: list[float | None] = [None] * len(ids)
    producer = [0] * len(ids)
    waiters: list[list[int]] = [[] for _ in ids]  # pass id -> ranks holding a pass that needs it
    for p in range(n):
        for dep in needs[p]:
            if dep >= 0:
                waiters[dep].append(p)
    lanes = [_lanes(lane_list) for lane_list in lanes_of]
    sizes = [len(q) for q in queues]
    done = [[False] * size for size in sizes]
    head = [0] * n
    clock = [0.0] * n
    live = [0.0] * n
    cap_of = [caps[r] for r in ranks]
    result: list[list[Action]] = [[] for _ in range(n)]

    def ready_time(p: int, idx: int) -> float | None:
        dep = needs[p][idx]
        if dep < 0:
            return 0.0
        finish = end[dep]
        if finish is None:
            return None
        return finish + (comm if producer[dep] != p else 0.0)

    heap: list[tuple[float, int]] = []
    current: list[float | None] = [None] * n
    push = heapq.heappush

    def refresh(p: int) -> None:
        start = None
        h = head[p]
        if h < sizes[p]:
            dep = needs[p][h]
            if dep < 0:
                ready = 0.0
            else:
                ready = end[dep]
                if ready is not None and producer[dep] != p:
                    ready += comm
            if ready is not None:
                start = clock[p] if clock[p] > ready else ready
        if start != current[p]:
            current[p] = start
            if start is not None:
                push(heap, (start, p))

    def commit(p: int, idx: int, start: float) -> None:
        finish = start + durations[p][idx]
        key = own[p][idx]
        end[key] = finish
        producer[key] = p
        clock[p] = finish
        live[p] += changes[p][idx]
        flags = done[p]
        flags[idx] = True
        result[p].append(queues[p][idx])
        h, size = head[p], sizes[p]
        while h < size and flags[h]:
            h += 1
        head[p] = h
        refresh(p)
        for other in waiters[key]:
            if other != p:
                refresh(other)

    for p in range(n):
        refresh(p)
    cap_bound = [False]
    remaining = sum(sizes)
    pop = heapq.heappop
    while remaining:
        while heap and current[heap[0][1]] != heap[0][0]:
            pop(heap)  # stale: that rank's head start changed since
        if not heap:
            stuck = {ranks[p]: str(queues[p][head[p]]) for p in range(n) if head[p] < sizes[p]}
            raise ValueError(f"order cannot complete; blocked actions per rank: {stuck}")
        head_start, p = heap[0]
        filler = None
        if promote_input_grads and kinds[p][head[p]] == W:
            filler = _find_ready_input_grad(
                p, kinds[p], lanes_of[p], done[p], head[p], lookahead, ready_time, clock[p], lanes[p]
            )
        if filler is None and head_start > clock[p] + _EPS:
            filler = _find_filler(
                p,
                head_start,
                kinds[p],
                lanes_of[p],
                durations[p],
                done[p],
                head[p],
                lookahead,
                ready_time,
                clock[p],
                live[p],
                cap_of[p],
                scale,
                lanes[p],
                cap_bound,
            )
        if filler is not None:
            commit(p, *filler)
        else:
            commit(p, head[p], head_start)
        remaining -= 1
    return {r: result[p] for p, r in enumerate(ranks)}, cap_bound[0]


def _lanes(lane_list: list[tuple[int, str]]) -> tuple[int, int]:
    """How many (stage, kind) lanes a rank's list has in all, and how many of them are input gradients:
    a window scan can stop once it has met them all (later passes are blocked behind their lane)."""
    kinds = set(lane_list)
    return len(kinds), sum(1 for _, kind in kinds if kind in (I, B))


def _find_filler(
    rank,
    head_start,
    kinds,
    lane_list,
    durations,
    done,
    head,
    lookahead,
    ready_time,
    now,
    live,
    cap,
    scale,
    lanes,
    bound,
):
    """First pass after the head that is ready, fits before ``head_start`` and keeps memory <= cap.
    Sets ``bound[0]`` when the cap alone turned a forward down (a larger cap could decide otherwise).

    Candidates are the not-yet-run passes after the head, at most ``lookahead`` of them, each the
    earliest of its (stage, kind) lane: a pass may overtake others, but never one of its own lane
    (microbatch order)."""
    blocked = {lane_list[head]}
    num_lanes = lanes[0]
    seen = 0
    for idx in range(head + 1, len(kinds)):
        if done[idx]:
            continue
        seen += 1
        if seen > lookahead or len(blocked) >= num_lanes:
            return None
        lane = lane_list[idx]
        if lane in blocked:
            continue
        blocked.add(lane)
        ready = ready_time(rank, idx)
        if ready is None:
            continue
        start = now if now > ready else ready
        if start + durations[idx] > head_start + _EPS:
            continue
        if kinds[idx] == F and not _fits_earlier(kinds, done, head, idx, live, scale, cap):
            bound[0] = True
            continue
        return idx, start
    return None


def _find_ready_input_grad(rank, kinds, lane_list, done, head, lookahead, ready_time, now, lanes):
    """First I/B after the head that can start right now, keeping per-lane microbatch order."""
    seen = 0
    met = set()
    for idx in range(head, len(kinds)):
        if done[idx]:
            continue
        seen += 1
        if seen > lookahead or len(met) >= lanes[1]:
            return None
        if kinds[idx] not in (I, B):
            continue
        lane = lane_list[idx]
        if lane in met:
            continue
        met.add(lane)
        ready = ready_time(rank, idx)
        if ready is not None and ready <= now + _EPS:
            return idx, now
    return None


def _fits_earlier(kinds, done, head, idx, live, scale, cap) -> bool:
    """Would running the F at ``idx`` now keep every later point of the rank's sequence under ``cap``?

    Moving an F earlier adds one chunk to the rank's memory at every pass between its new and its old
    position (and nowhere else), so checking those points is exact.
    """
    level = live + scale
    if level > cap + _EPS:
        return False
    for j in range(head, idx):
        if done[j]:
            continue
        kind = kinds[j]
        if kind == F:
            level += scale
            if level > cap + _EPS:
                return False
        elif kind in (W, B):
            level -= scale
    return True
