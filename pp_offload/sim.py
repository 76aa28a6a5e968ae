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
  compared on the same model. With ``costs.stages`` every pass takes its own stage's per-chunk F/I/W
  (``Costs.of_stage``) times the same scale, so imbalanced stages (embedding, LM head) are timed as such;
  torch's stage 0 B (`as_executed_by_torch`) takes stage 0's own I + W.
- Activation memory of a (stage, microbatch) is held from the start of its F until the end of its W
  (or B): torch keeps saved tensors until W because both I and W unpack them. Under deferred weight
  gradients (``costs.queue``, `pp_offload.runtime.deferred_w`) I frees the saved tensors and only the W
  queue, ``costs.queue_of(stage)`` of a chunk unit, is held from the end of I to the end of W.

Offload (PipeOffload): an order may also hold ``OFFLOAD``/``RELOAD`` actions per (stage, microbatch). They
are *issued* when the rank's compute stream reaches them (the end of the compute pass before them) but
run on copy lanes beside it, one per direction (``copy_lanes="duplex"``) or one for both
(``"shared"``), first come first served, each taking ``costs.transfer`` (per chunk, scaled like the
passes). OFFLOAD frees the chunk's device memory when its copy ends; RELOAD starts once its OFFLOAD has
ended, takes device memory back when it starts, and the chunk's I/B/W cannot start before it ends (the
wait is reported per rank in ``reload_wait`` and lengthens the makespan). Memory curves and peaks are
then the *device-resident* activation memory.

Layer-granular offload (``layered``): a chunk listed there moves only its first ``moved`` of its stage's
``layers`` layers (earliest first: their backward comes last), one copy per layer, each taking
``layer_copy`` (default: the chunk's ``costs.transfer`` share of one layer). The copy of layer ``i`` is
issued when that layer's forward ends, i.e. at ``i + 1`` layers' share of the F pass (the runtime starts it
from a forward hook on the layer), and frees that layer's memory when it ends. The chunk's OFFLOAD action,
right after its F, then issues nothing; its RELOAD copies the moved layers back last layer first (the
order the backward needs them), and the backward pass runs layer by layer, each layer's share of the
pass starting no earlier than that layer's reload has ended: the chunk's own backward of its later
layers hides part of the reload.
The "layers" may be finer offload units (``granularity="sublayer"``: each decoder layer's attention half,
then the rest); units differ in compute, so `LayeredChunk.compute` gives each unit's share of the passes
(default: equal shares), which times both its copy's issue and its part of the backward.

A second OFFLOAD of a chunk after its RELOAD (zero-bubble orders, between I and W: W still needs the
saved tensors) copies nothing: the host copy is still exact, so the device copy is dropped at once; a
second RELOAD before W copies it back as the first did. Under deferred W (``costs.queue``) that pair moves
the chunk's W queue instead, whole-chunk and layered chunks alike: one copy each way of ``queue`` times the
chunk's copy time, the OFFLOAD freeing the queue's share when it ends, the RELOAD taking it back when it
starts, and W waiting for the RELOAD's end.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pp_offload.order.actions import OFFLOAD, RELOAD, B, Costs, F, I, W
from pp_offload.order.torch_execution import as_executed_by_torch as as_executed_by_torch  # re-exported
from pp_offload.order.transfer_checks import OffloadOrderError as OffloadOrderError  # re-exported
from pp_offload.order.transfer_checks import check_transfers

_COMPUTE = (F, I, W, B)
_TRANSFER = (OFFLOAD, RELOAD)
_COPY_LANES = ("duplex", "shared")


_KINDS: dict[Any, str] = {}


def _kind(action: Any) -> str:
    kind = action.computation_type
    found = _KINDS.get(kind)
    if found is None:  # one lookup per kind: replays of large orders call this once per action
        found = _KINDS[kind] = str(getattr(kind, "value", kind))
    return found


def flatten(actions: Iterable[Any]) -> list[tuple[int, str, int]]:
    """A rank's actions as ``(stage, kind, microbatch)`` compute passes, in order.

    ``None`` slots and non-compute actions (SEND/RECV/UNSHARD/...) are skipped; torch's OVERLAP_F_B
    runs its sub-actions one after the other, as torch's runtime does.
    """
    return _flatten(actions, None)


def _flatten(actions: Iterable[Any], transfers: list | None) -> list[tuple[int, str, int]]:
    """`flatten`, also collecting OFFLOAD/RELOAD actions into ``transfers`` (when given) as
    ``(number of compute passes before it, action, kind, stage, microbatch)``."""
    passes: list[tuple[int, str, int]] = []
    append = passes.append
    for action in actions:
        if action is None:
            continue
        subs = getattr(action, "sub_actions", None)
        if subs:
            passes.extend(_flatten(subs, None))
            continue
        kind = _kind(action)
        if kind in _COMPUTE:
            append((int(action.stage_index), kind, int(action.microbatch_index)))
        elif transfers is not None and kind in _TRANSFER:
            transfers.append(
                (len(passes), action, kind, int(action.stage_index), int(action.microbatch_index))
            )
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


@dataclass(frozen=True)
class LayeredChunk:
    """How a chunk offloads layer by layer (see the module doc): its first ``moved`` of ``layers`` layers,
    each copy one way taking ``layer_copy`` cost units (None: the chunk's one-way copy time over
    ``layers``; a sequence: each layer's own, first layer first, where layers save different bytes, e.g.
    under a recompute plan on a share of the layers). ``moved = 0`` means the chunk's transfers move
    nothing."""

    moved: int
    layers: int
    layer_copy: float | tuple[float, ...] | None = None
    compute: tuple[float, ...] | None = None
    """Each unit's share of the chunk's passes, first unit first (summing to 1), where units differ in
    compute: sub-layer units (a layer's attention half, then its MLP half, `pp_offload.order.offload`
    ``granularity="sublayer"``). Unit ``i``'s copy out is issued when the forward has run the shares of
    units ``0..i``, and the backward runs unit ``i`` for its share of the pass. None: equal shares."""

    def __post_init__(self) -> None:
        if isinstance(self.layers, bool) or not isinstance(self.layers, int) or self.layers < 1:
            raise ValueError(f"layers must be an int >= 1 (the stage's layers), got {self.layers!r}")
        if (
            isinstance(self.moved, bool)
            or not isinstance(self.moved, int)
            or not 0 <= self.moved <= self.layers
        ):
            raise ValueError(f"moved must be an int in [0, layers={self.layers}], got {self.moved!r}")
        copies = self.layer_copy
        if isinstance(copies, (list, tuple)):
            copies = tuple(copies)
            object.__setattr__(self, "layer_copy", copies)
            if len(copies) != self.layers:
                raise ValueError(f"layer_copy has {len(copies)} entries for {self.layers} layers")
        for c in copies if isinstance(copies, tuple) else (copies,):
            if c is not None and not c >= 0:
                raise ValueError(f"layer_copy must be a number >= 0 (cost units), got {self.layer_copy!r}")
        if self.compute is not None:
            shares = tuple(float(x) for x in self.compute)
            object.__setattr__(self, "compute", shares)
            if len(shares) != self.layers or any(not x >= 0 for x in shares) or abs(sum(shares) - 1) > 1e-6:
                raise ValueError(
                    f"compute must hold {self.layers} shares >= 0 summing to 1 (one per unit), got "
                    f"{self.compute!r}"
                )

    def shares(self) -> tuple[float, ...]:
        """Each unit's share of the chunk's passes (equal without ``compute``)."""
        return self.compute if self.compute is not None else (1.0 / self.layers,) * self.layers

    def copy_time(self, layer: int, default: float) -> float:
        """One-way copy time of ``layer`` (``default``: the chunk's copy time over its layers)."""
        if self.layer_copy is None:
            return default
        return self.layer_copy[layer] if isinstance(self.layer_copy, tuple) else self.layer_copy


@dataclass
class SimResult:
    """What one replay of an order measured. Times are in cost units, memory in chunk units."""

    makespan: float
    busy: dict[int, float]
    peak_memory: dict[int, float]
    timeline: dict[int, list[tuple[tuple[int, str, int], float, float]]]
    memory_curve: dict[int, list[tuple[float, float]]] = field(repr=False)
    transfers: dict[int, list[tuple[Any, float, float]]] = field(default_factory=dict, repr=False)
    """rank -> (OFFLOAD/RELOAD action, copy start, copy end), in issue order; empty without offload."""
    reload_wait: dict[int, float] = field(default_factory=dict)
    """rank -> time its compute stream waited for reloads that ended after the pass could have started."""
    layer_transfers: dict[int, list[tuple[Any, int, float, float]]] = field(default_factory=dict, repr=False)
    """rank -> (OFFLOAD/RELOAD action, layer, copy start, copy end) of layered chunks, one per layer copy;
    their ``transfers`` entry spans the first copy's start to the last copy's end."""

    @property
    def total_reload_wait(self) -> float:
        """Time all ranks together waited for reloads (0 when every reload was early enough)."""
        return sum(self.reload_wait.values())

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
    order: Mapping[int, Iterable[Any]],
    costs: Costs | Mapping[str, float] | None = None,
    *,
    copy_lanes: str = "duplex",
    layered: Mapping[tuple[int, int], LayeredChunk] | None = None,
) -> SimResult:
    """Replay ``order`` (rank -> actions) with ``costs`` and measure time and memory.

    ``copy_lanes`` matters only for orders with OFFLOAD/RELOAD actions: ``"duplex"`` gives every rank
    one copy lane per direction (device->host and host->device run at the same time), ``"shared"``
    one lane for both. ``layered``: (stage, microbatch) -> `LayeredChunk` for chunks offloaded layer by
    layer (module doc); other offloaded chunks move whole. Raises `OrderDeadlockError` naming the stuck
    actions if the order can't complete, and `OffloadOrderError` naming the chunk if OFFLOAD/RELOAD
    actions are misplaced.
    """
    if copy_lanes not in _COPY_LANES:
        raise ValueError(f"copy_lanes must be 'duplex' or 'shared', got {copy_lanes!r}")
    costs = Costs.coerce(costs)
    ranks = sorted(order)
    found: dict[int, list] = {r: [] for r in ranks}
    passes = {r: _flatten(order[r], found[r]) for r in ranks}
    all_passes = [p for r in ranks for p in passes[r]]
    if not all_passes:
        raise ValueError("order has no compute actions")
    num_stages = max(s for s, _, _ in all_passes) + 1
    scale = 2.0 * len(ranks) / num_stages  # chunks per stage
    rank_of_stage = {s: r for r in ranks for s, _, _ in passes[r]}

    deps = {r: [dependency(s, k, j, num_stages) for s, k, j in passes[r]] for r in ranks}
    duration = _durations(passes, costs, scale, num_stages)
    if any(found.values()):
        return _simulate_with_transfers(
            ranks, passes, found, deps, duration, costs, scale, rank_of_stage, copy_lanes, dict(layered or {})
        )
    # the plain replay, the planner's inner loop: each rank runs its passes in order until one waits on a
    # pass not yet ended (locals only: a pp 16, m 256 order has ~25,000 passes, replayed once per candidate)
    end: dict[tuple[int, str, int], float] = {}
    producer_rank: dict[tuple[int, str, int], int] = {}
    timeline: dict[int, list] = {r: [] for r in ranks}
    clock = {r: 0.0 for r in ranks}
    pos = {r: 0 for r in ranks}
    comm = costs.comm
    remaining = len(all_passes)
    while remaining:
        progressed = False
        for r in ranks:
            seq, rank_deps, spans, line = passes[r], deps[r], duration[r], timeline[r]
            first = p = pos[r]
            now = clock[r]
            while p < len(seq):
                dep = rank_deps[p]
                ready = 0.0
                if dep is not None:
                    done = end.get(dep)
                    if done is None:
                        break
                    ready = done + comm if producer_rank[dep] != r else done
                start = now if now >= ready else ready
                now = start + spans[p]
                pass_ = seq[p]
                key = (pass_[0], I, pass_[2]) if pass_[1] == B else pass_
                end[key] = now
                producer_rank[key] = r
                line.append((pass_, start, now))
                p += 1
            if p != first:
                pos[r], clock[r] = p, now
                remaining -= p - first
                progressed = True
        if not progressed:
            _raise_deadlock(passes, pos, rank_of_stage)

    busy = {r: sum(e - s for _, s, e in timeline[r]) for r in ranks}
    curves, peaks = {}, {}
    for r in ranks:
        curves[r], peaks[r] = _memory(timeline[r], scale, [], costs)
    makespan = max(clock.values())
    return SimResult(makespan, busy, peaks, timeline, curves, {r: [] for r in ranks}, {r: 0.0 for r in ranks})


def _durations(passes, costs: Costs, scale: float, num_stages: int) -> dict[int, list[float]]:
    """rank -> the duration of each of its compute passes, in order (per-stage when ``costs.stages``)."""
    if costs.stages is None:
        by_kind = {kind: costs.of(kind) * scale for kind in _COMPUTE}
        return {r: [by_kind[k] for _, k, _ in seq] for r, seq in passes.items()}
    if len(costs.stages) < num_stages:
        raise ValueError(
            f"costs.stages has {len(costs.stages)} entries but the order has {num_stages} stages; "
            "give one [F, I, W] per stage"
        )
    table = {(s, k): costs.of_stage(s, k) * scale for s in range(num_stages) for k in _COMPUTE}
    return {r: [table[s, k] for s, k, _ in seq] for r, seq in passes.items()}


def _raise_deadlock(passes, pos, rank_of_stage) -> None:
    stuck = {r: "".join(map(str, seq[pos[r]])) for r, seq in passes.items() if pos[r] < len(seq)}
    raise OrderDeadlockError(
        f"order cannot complete: each rank's next action waits on a pass that never runs "
        f"before it (rank -> blocked action: {stuck}); stage -> rank: {rank_of_stage}"
    )


def _memory(timeline, scale: float, extra: list[tuple[float, float]], costs: Costs | None = None):
    """A rank's (curve, peak): F start +scale, W/B end -scale, plus ``extra`` (time, delta) events. Under
    deferred W (``costs.queue``) I's end frees the chunk but its queue's share, which W's end frees."""
    events = list(extra)
    append = events.append
    deferred = costs is not None and costs.queue is not None
    for (stage, kind, _), start, finish in timeline:
        if kind == F:
            append((start, scale))
        elif kind == B:
            append((finish, -scale))
        elif deferred and kind in (I, W):
            queued = costs.queue_of(stage) * scale
            append((finish, queued - scale if kind == I else -queued))
        elif kind == W:
            append((finish, -scale))
    events.sort()  # by time, then delta: frees before allocations at the same instant
    level, peak, curve = 0.0, 0.0, [(0.0, 0.0)]
    point = curve.append
    for t, delta in events:
        level += delta
        if level > peak:
            peak = level
        point((t, level))
    return curve, peak


def _simulate_with_transfers(
    ranks, passes, found, deps, duration, costs, scale, rank_of_stage, lanes, layered, *, check=True
):
    """`simulate`'s replay for orders with OFFLOAD/RELOAD: the same compute model plus copy lanes.
    ``check=False``: the transfers are known to be well placed (`pp_offload.order.transfer_checks.
    check_transfers` would pass), as `pp_offload.order.offload_replay` builds them."""
    if check:
        for r in ranks:
            check_transfers(r, passes[r], found[r])
    replay = _TransferReplay(ranks, passes, deps, duration, costs, scale, rank_of_stage, lanes)
    return replay.run(found, layered)


_MISSING = object()


class _TransferReplay:
    """Replays of one compute order with transfers (`_simulate_with_transfers`): `run` replays it with one
    set of transfers, `rerun` with another (the same ``layered``) from where they first change.

    Why resumable: budget offload's search (`pp_offload.order.offload`) replays a placement, moves the
    RELOADs that end late one pass earlier and replays again, up to 32 times per trial, and much of each
    rank's replay is the last one's. A rank's replay depends only on its own transfers and on the end times
    of its passes' dependencies on other ranks, so each rank first checks its passes against the last
    replay (`_check`) and is replayed live only from its first changed transfer or its first pass whose
    dependency on another rank now ends at another time; its state there is restored from what the last
    replay recorded (lane times, list lengths, the chunks' copy ends it overwrote, the reload wait so far),
    so the result is exactly a fresh replay's."""

    def __init__(self, ranks, passes, deps, duration, costs, scale, rank_of_stage, lanes) -> None:
        self.ranks, self.passes, self.deps, self.duration = ranks, passes, deps, duration
        self.comm, self.scale, self.rank_of_stage = costs.comm, scale, rank_of_stage
        self.costs, self.copy = costs, costs.transfer * scale
        self.h2d = 0 if lanes == "shared" else 1
        self.found: dict[int, list] = {}
        self.remote: dict[int, list[int]] = {}  # for `rerun`, built once (`_prepare`)

    def run(
        self, found: dict[int, list], layered: Mapping[tuple[int, int], LayeredChunk], *, memory: bool = True
    ) -> SimResult:
        """A fresh replay with ``found`` (rank -> transfers, as `_flatten` collects them); ``memory=False``:
        without memory curves and peaks (`add_memory`)."""
        ranks, self.memory = self.ranks, memory
        self.found, self.layered = found, layered
        self.shares: dict[tuple[int, int], tuple[float, ...]] = {}  # layered: each unit's share of passes
        self.copies: dict[tuple[int, int], list[float]] = {}  # layered: each unit's copy time, per chunk
        self.end: dict[tuple[int, str, int], float] = {}
        self.producer_rank: dict[tuple[int, str, int], int] = {}
        self.timeline: dict[int, list] = {r: [] for r in ranks}
        self.transfers: dict[int, list] = {r: [] for r in ranks}
        self.wait = {r: 0.0 for r in ranks}
        self.extra: dict[int, list[tuple[float, float]]] = {r: [] for r in ranks}
        self.clock = {r: 0.0 for r in ranks}
        self.pos = {r: 0 for r in ranks}
        self.tpos = {r: 0 for r in ranks}
        # lane[r] = [device->host free at, host->device free at]; a shared lane uses index 0 for both
        self.lane = {r: [0.0, 0.0] for r in ranks}
        self.offload_end: dict[tuple[int, int], float] = {}
        self.reload_end: dict[tuple[int, int], float] = {}
        self.layer_ready: dict[tuple[int, int], list[float]] = {}  # layered: per layer, its reload's end
        self.f_span: dict[tuple[int, int], tuple[float, float]] = {}
        self.layer_transfers: dict[int, list] = {r: [] for r in ranks}
        # for `rerun`: per rank, after each transfer its lanes, list lengths and the chunk state it
        # overwrote; after each pass the rank's reload wait so far
        self.issued: dict[int, list[tuple]] = {r: [] for r in ranks}
        self.waits: dict[int, list[float]] = {r: [] for r in ranks}
        self.mode = {r: "live" for r in ranks}  # live: replayed; check, done: see `rerun`
        return self._replay()

    def rerun(self, found: dict[int, list], *, memory: bool = True) -> SimResult:
        """`run` with ``found`` instead of the last replay's transfers, the same ``layered``: the same
        result, replaying only what can differ (the class doc). The last `SimResult` is left as it was."""
        self.old, self.found, passes, self.memory = self.found, found, self.passes, memory
        self.own = {}  # per rank, where its own transfers first differ (past its last issue: nowhere)
        for r in self.ranks:
            a, b = self.old[r], found[r]
            k = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            counts = [t[0] for t in a[k : k + 1] + b[k : k + 1]]
            self.own[r] = min(counts) if counts else len(passes[r]) + 1
        # the last SimResult keeps its containers: the ones it shares are copied before any change
        self.timeline, self.transfers = dict(self.timeline), dict(self.transfers)
        self.layer_transfers, self.wait = dict(self.layer_transfers), dict(self.wait)
        # end times are published again as ranks check or replay their passes (`_check`, `_advance`)
        self.old_end, self.end = self.end, {}
        self._prepare()
        self.checked = {r: 0 for r in self.ranks}  # per rank, its remote dependencies checked so far
        for r in self.ranks:  # every rank checks its passes against the last replay, from the first
            self.mode[r], self.pos[r] = "check", 0
        return self._replay()

    def _check(self, r: int) -> bool:
        """Rank r's passes from ``pos[r]`` on are the last replay's while their transfers are the same and
        every dependency on another rank ends when it did (their end times are then published as they
        were); at the first that is not, the rank is restored to its state there (`_restore`) and replayed
        live. Returns whether it got anywhere."""
        remote, n, own, keys = self.remote[r], len(self.passes[r]), self.own[r], self.keys[r]
        end, old_end = self.end, self.old_end
        i, start = self.checked[r], self.pos[r]
        while True:
            if i >= len(remote) or remote[i] >= own:
                for key in keys[start : min(own, n)]:
                    end[key] = old_end[key]
                if own > n:  # the same as the last replay to its end
                    self.pos[r], self.mode[r] = n, "done"
                else:
                    self._restore(r, own)
                return True
            p = remote[i]
            dep = self.deps[r][p]
            now = end.get(dep)
            if now is None or now != old_end[dep]:
                for key in keys[start:p]:
                    end[key] = old_end[key]
                if now is None:  # not replayed (or checked) that far yet
                    self.pos[r], self.checked[r] = p, i
                    return p > start
                self._restore(r, p)
                return True
            i += 1

    def _restore(self, r: int, q: int) -> None:
        """Rank r as the last replay left it before its pass ``q`` (its transfers there not yet issued),
        then replayed live from there."""
        old = self.old[r]
        for stage, kind, mb in self.passes[r][q:]:
            if kind == F:
                del self.f_span[(stage, mb)]
        t = 0
        while t < len(old) and old[t][0] < q:
            t += 1
        for _, undo in reversed(self.issued[r][t:]):
            for table, key, before in reversed(undo):
                if before is _MISSING:
                    del table[key]
                else:
                    table[key] = before
        lanes, n_extra, n_layers = self.issued[r][t - 1][0] if t else ((0.0, 0.0), 0, 0)
        self.lane[r] = list(lanes)
        self.extra[r] = self.extra[r][:n_extra]
        self.layer_transfers[r] = self.layer_transfers[r][:n_layers]
        self.transfers[r] = self.transfers[r][:t]
        self.issued[r] = self.issued[r][:t]
        self.timeline[r] = self.timeline[r][:q]
        self.waits[r] = self.waits[r][:q]
        self.wait[r] = self.waits[r][q - 1] if q else 0.0
        self.clock[r] = self.timeline[r][q - 1][2] if q else 0.0
        self.pos[r], self.tpos[r], self.mode[r] = q, t, "live"

    def _prepare(self) -> None:
        """For `rerun`: per rank, the key each pass's end time is published under and the positions of its
        passes that depend on a pass of another rank."""
        if not self.remote:
            self.keys = {
                s: [(stage, I, mb) if kind == B else (stage, kind, mb) for stage, kind, mb in self.passes[s]]
                for s in self.ranks
            }
            rank_of = {key: s for s in self.ranks for key in self.keys[s]}
            self.remote = {
                s: [p for p, dep in enumerate(self.deps[s]) if dep is not None and rank_of[dep] != s]
                for s in self.ranks
            }

    def _issue_layered(self, r: int, action, kind: str, key: tuple[int, int], spec, now: float, undo) -> None:
        free, unit = self.lane[r], self.scale / spec.layers
        extra, layer_transfers = self.extra[r], self.layer_transfers[r]
        offload_end, reload_end, layer_ready = self.offload_end, self.reload_end, self.layer_ready
        c = self.copies.get(key)
        if c is None:
            self.shares[key] = spec.shares()
            c = self.copies[key] = [spec.copy_time(i, self.copy / spec.layers) for i in range(spec.layers)]
        if kind == OFFLOAD:
            undo.append((offload_end, key, offload_end.get(key, _MISSING)))
        else:
            undo.append((reload_end, key, reload_end.get(key, _MISSING)))
            undo.append((layer_ready, key, layer_ready.get(key, _MISSING)))
        if spec.moved == 0:
            self.transfers[r].append((action, now, now))
            if kind == OFFLOAD:
                offload_end[key] = now
            else:
                reload_end[key] = now
                layer_ready[key] = [now] * spec.layers
            return
        first = last = None
        queue = self.costs.queue_of(key[0]) if key in reload_end else None
        if queue is not None:  # deferred W, after I: one copy of the chunk's W queue, needed whole by W
            first, last = self._copy(r, kind, key, queue * sum(c), queue * self.scale, now)
            if kind == RELOAD:
                layer_ready[key] = [last] * spec.layers
            self.transfers[r].append((action, first, last))
            return
        if kind == OFFLOAD and key in reload_end:  # again, after I: the host copy is exact, just drop
            for i in range(spec.moved):
                extra.append((now, -unit))
                layer_transfers.append((action, i, now, now))
            offload_end[key] = now
            self.transfers[r].append((action, now, now))
            return
        if kind == OFFLOAD:  # layer i's copy was issued when its forward ended, during the F pass
            f_start, f_end = self.f_span[key]
            share = self.shares[key]
            done = 0.0
            for i in range(spec.moved):
                done += share[i]
                start = max(f_start + done * (f_end - f_start), free[0])
                free[0] = finish = start + c[i]
                extra.append((finish, -unit))
                layer_transfers.append((action, i, start, finish))
                first = start if first is None else first
                last = finish
            offload_end[key] = last
        else:  # last moved layer first: the backward needs it first
            h2d = self.h2d
            ready = [now] * spec.layers
            for i in range(spec.moved - 1, -1, -1):
                start = max(now, free[h2d], offload_end[key])
                free[h2d] = finish = start + c[i]
                extra.append((start, unit))
                layer_transfers.append((action, i, start, finish))
                ready[i] = finish
                first = start if first is None else first
                last = finish
            reload_end[key] = last
            layer_ready[key] = ready
        self.transfers[r].append((action, first, last))

    def _copy(
        self, r: int, kind: str, key: tuple[int, int], copy: float, nbytes: float, now: float
    ) -> tuple[float, float]:
        """One copy of ``copy`` time on rank r's lanes, issued at ``now`` (a whole chunk, or a deferred-W
        queue between I and W): an OFFLOAD frees ``nbytes`` when it ends, a RELOAD starts once the chunk's
        OFFLOAD has ended, takes them when it starts, and the chunk's next pass waits for its end. Returns
        (start, end)."""
        free = self.lane[r]
        if kind == OFFLOAD:
            start = max(now, free[0])
            free[0] = finish = start + copy
            self.offload_end[key] = finish
            self.extra[r].append((finish, -nbytes))
        else:
            start = max(now, free[self.h2d], self.offload_end[key])
            free[self.h2d] = finish = start + copy
            self.reload_end[key] = finish
            self.extra[r].append((start, nbytes))
        return start, finish

    def _issue(self, r: int) -> None:
        """Issue rank r's transfers that sit before its next compute pass, at its compute clock."""
        todo, i, now, free, at = self.found[r], self.tpos[r], self.clock[r], self.lane[r], self.pos[r]
        extra, scale, copy = self.extra[r], self.scale, self.copy
        offload_end, reload_end, issued = self.offload_end, self.reload_end, self.issued[r]
        while i < len(todo) and todo[i][0] == at:
            _, action, kind, stage, mb = todo[i]
            key = (stage, mb)
            undo: list = []
            spec = self.layered.get(key)
            if spec is not None:
                self._issue_layered(r, action, kind, key, spec, now, undo)
            else:
                table = offload_end if kind == OFFLOAD else reload_end
                undo.append((table, key, table.get(key, _MISSING)))
                queue = self.costs.queue_of(stage) if key in reload_end else None
                if queue is not None:  # deferred W, after I: the copy moves the chunk's W queue
                    start, finish = self._copy(r, kind, key, queue * copy, queue * scale, now)
                elif kind == OFFLOAD and key in reload_end:  # again, after I: drop, no copy
                    start = finish = now
                    offload_end[key] = now
                    extra.append((now, -scale))
                else:
                    start, finish = self._copy(r, kind, key, copy, scale, now)
                self.transfers[r].append((action, start, finish))
            issued.append((((free[0], free[1]), len(extra), len(self.layer_transfers[r])), undo))
            i += 1
        self.tpos[r] = i

    def _advance(self, r: int) -> bool:
        """Rank r's passes replayed in order until one waits on a pass not replayed yet (live mode);
        returns whether it ran any."""
        pos, tpos, clock, end, producer_rank = self.pos, self.tpos, self.clock, self.end, self.producer_rank
        layer_ready, shares, reload_end, f_span = self.layer_ready, self.shares, self.reload_end, self.f_span
        wait, comm = self.wait, self.comm
        seq, todo, rank_deps = self.passes[r], self.found[r], self.deps[r]
        spans, line, waits = self.duration[r], self.timeline[r], self.waits[r]
        first = pos[r]
        while pos[r] < len(seq):
            p = pos[r]
            t_next = tpos[r]
            if t_next < len(todo) and todo[t_next][0] == p:
                self._issue(r)
            pass_ = seq[p]
            stage, kind, mb = pass_
            dep = rank_deps[p]
            ready = clock[r]
            if dep is not None:
                done = end.get(dep)
                if done is None:
                    break
                ready = max(ready, done + (comm if producer_rank[dep] != r else 0.0))
            start = ready
            finish = None
            span = spans[p]
            if kind != F:
                ready_layers = layer_ready.get((stage, mb))
                if ready_layers is not None:  # layer by layer, last layer first
                    n = len(ready_layers)
                    share = shares[(stage, mb)]
                    t = ready
                    for layer in range(n - 1, -1, -1):
                        t = max(t, ready_layers[layer]) + share[layer] * span
                    finish = t
                    wait[r] += finish - (ready + span)
                else:
                    reloaded = reload_end.get((stage, mb))
                    if reloaded is not None and reloaded > ready:
                        start = reloaded
                        wait[r] += reloaded - ready
            if finish is None:
                finish = start + span
            key = (stage, I, mb) if kind == B else pass_
            end[key] = finish
            producer_rank[key] = r
            line.append((pass_, start, finish))
            waits.append(wait[r])
            if kind == F:
                f_span[(stage, mb)] = (start, finish)
            clock[r] = finish
            pos[r] = p + 1
        if pos[r] == len(seq):
            self._issue(r)  # transfers after the rank's last compute pass
        return pos[r] != first

    def _replay(self) -> SimResult:
        ranks, mode, pos, passes = self.ranks, self.mode, self.pos, self.passes
        while True:
            progressed = False
            for r in ranks:
                if mode[r] == "check":
                    progressed |= self._check(r)
                if mode[r] == "live":
                    progressed |= self._advance(r)
            if all(mode[r] == "done" or pos[r] == len(passes[r]) for r in ranks):
                break
            if not progressed:
                _raise_deadlock(passes, pos, self.rank_of_stage)
        for r in ranks:
            if mode[r] == "live":
                self._issue(r)

        busy = {r: sum(self.duration[r]) for r in ranks}  # a layered backward's span includes its waits
        makespan = max(self.clock.values())
        result = SimResult(
            makespan, busy, {}, self.timeline, {}, self.transfers, self.wait, self.layer_transfers
        )
        if self.memory:
            self.add_memory(result)
        return result

    def add_memory(self, result: SimResult) -> None:
        """Fill the memory curves and peaks of ``result``, this object's latest replay (`run` and `rerun`
        leave them empty with ``memory=False``: a search that replays a placement several times before it
        keeps one needs them only for the one it keeps)."""
        for r in self.ranks:
            result.memory_curve[r], result.peak_memory[r] = _memory(
                self.timeline[r], self.scale, self.extra[r], self.costs
            )
