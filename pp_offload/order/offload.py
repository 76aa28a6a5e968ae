"""Activation offload planning (PipeOffload): which chunks go to host memory, and when they come back.

Why this exists: even V-Min keeps several microbatches' activations on every rank, and the number grows
with pipeline depth. Between a chunk's forward and its backward those activations are dead weight on the
device; PipeOffload copies them to host memory right after the forward (OFFLOAD) and back shortly before
the backward (RELOAD), on copy lanes that run beside compute. When the copies hide behind compute the
device keeps only a few chunks whatever the depth; when they can't (slow host link, short chunks), a
share of the chunks is offloaded, chosen to lower the peak most (the longest-lived first where that
decides), which can cut the peak more than linearly in the offloaded share.

This module is pure Python: it takes any compute order (ours or torch's ``pipeline_order``), simulates it
with `pp_offload.sim.simulate`, and inserts ``OFFLOAD``/``RELOAD`` actions:

- ``OFFLOAD(s, j)`` right after ``F(s, j)`` on its rank (the copy starts when the forward has ended);
- ``RELOAD(s, j)`` before the chunk's first backward pass (``I`` or ``B``; stage 0's ``I`` included,
  since both I and W unpack saved tensors and the reloaded copy must live until W), at the latest
  position where the simulated reload still ends ``reload_margin`` backward passes (one, by default)
  before that backward starts, and at least one compute pass before it when the chunk's window allows.
  Positions are then checked by a replay with the copy lanes and moved earlier where a queued copy
  would end too late.

A transfer is *issued* where it sits: when the compute pass before it ends (see `pp_offload.sim`).

Budgeted, layer-granular offload (``mode="budget"``): whole chunks are all or nothing, and at real model
sizes (a transfer/compute ratio k of 4-7 on PCIe hosts) no whole chunk fits its forward-to-backward
window, so nothing moves. A budget moves part of *every* chunk: its earliest layers (their backward comes
last), each layer's copy starting as soon as that layer's forward has produced its tensors, and reloaded
last layer first so the chunk's own backward of its later layers hides part of the reload (the
simulator's ``layered`` model, `pp_offload.sim.LayeredChunk`; the runtime does the same from hooks on
the stage's layers). ``fraction`` fixes the share of each chunk's layers; without it (``"budget"``) each
chunk moves as many layers as its window hides with idle copy lanes, under a cap on layers per chunk
raised as long as the replayed step stays within ``max_slowdown`` of the order without offload.

Entry points: `resolve_offload` (parse the user's ``offload=`` argument into an `OffloadPolicy`) and
`plan_offload` (policy + order + costs -> `OffloadPlan`). `transfer_compute_ratio`, `auto_offload` and
`auto_from_measurements` give the ``auto`` mode its ratio ``k``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from pp_offload.order.actions import OFFLOAD, Action, Costs, I, W
from pp_offload.order.offload_placement import (
    _Chunk,
    _chunks,
    _compute_order,
    _how_many,
    _initial_slot,
    _insert,
    _layered_slot,
    _layers_that_fit,
    _longest_first,
    _lower_peak_first,
    _move_late_layered,
    _move_late_reloads,
    _unit_shares,
    _w_slot,
)
from pp_offload.order.offload_policy import (
    _DEFAULT_MAX_SLOWDOWN,
    _EPS,
    _REFINE_ROUNDS,
    OFFLOAD_FORMS,
    OffloadForm,
    OffloadPolicy,
    _per_stage,
    auto_from_measurements,
    auto_offload,
    offload_examples,
    resolve_offload,
    transfer_compute_ratio,
)
from pp_offload.order.offload_replay import STATS, PlacementReplay, snapshot, trial_memo
from pp_offload.sim import LayeredChunk, SimResult, simulate

__all__ = [
    "OFFLOAD_FORMS",
    "offload_examples",
    "OffloadForm",
    "OffloadPlan",
    "OffloadPolicy",
    "auto_from_measurements",
    "auto_offload",
    "plan_offload",
    "resolve_offload",
    "transfer_compute_ratio",
]


@dataclass
class OffloadPlan:
    """An order with OFFLOAD/RELOAD inserted, and what was chosen.

    order: rank -> actions (`pp_offload.order.Action`, compute passes in the input's order, torch
    actions converted, ``None`` slots and OVERLAP_F_B wrappers flattened) with ``OFFLOAD``/``RELOAD``.
    offloaded: rank -> (stage, microbatch) chunks offloaded, in the order they were chosen.
    policy: the policy used (auto resolved, with its ``k``).
    sim: the replay of ``order`` with the planning costs and the policy's lanes.
    layered: budget mode: (stage, microbatch) -> how many of its layers move (`pp_offload.sim.LayeredChunk`);
        empty for whole-chunk policies. Pass it to `pp_offload.sim.simulate` to replay ``order``
        (or use `replay`).
    pulled: ``close_w``: rank -> (stage, microbatch) chunks whose W the plan's ``order`` runs right after
        their I instead of where the input order had it (`pp_offload.order.zb_offload`); empty otherwise.
    """

    order: dict[int, list[Action]]
    offloaded: dict[int, list[tuple[int, int]]]
    policy: OffloadPolicy
    sim: SimResult | None = field(default=None, repr=False)
    layered: dict[tuple[int, int], LayeredChunk] = field(default_factory=dict, repr=False)
    pulled: dict[int, list[tuple[int, int]]] = field(default_factory=dict)

    def replay(self, costs: Costs | Mapping[str, float] | None = None, **changes: Any) -> SimResult:
        """Simulate this plan's order again (other ``costs``, e.g. per-stage), as the runtime runs it.
        ``changes``: `dataclasses.replace` the layered chunks' fields (``layer_copy=0.0``)."""
        layered = self.layered
        if changes:
            layered = {k: replace(v, **changes) for k, v in layered.items()}
        return simulate(self.order, costs, copy_lanes=self.policy.lanes, layered=layered)

    def dropped_after_i(self, rank: int | None = None) -> list[tuple[int, int]]:
        """(stage, microbatch) of the chunks this plan copies again between their I and their W (a second
        OFFLOAD, after I), on ``rank`` or on every rank: under deferred W their W queue goes to host memory
        and back; under torch's split their saved tensors are dropped and reloaded for W."""
        again = []
        for r in sorted(self.order) if rank is None else [rank]:
            seen: set[tuple[int, int]] = set()
            for action in self.order[r]:
                if action.computation_type == OFFLOAD:
                    key = (action.stage_index, action.microbatch_index)
                    if key in seen:
                        again.append(key)
                    seen.add(key)
        return again

    def moved_layers(self, rank: int) -> dict[tuple[int, int], int]:
        """Budget mode: layers moved per chunk of ``rank`` (0 for chunks of whole-chunk policies)."""
        return {
            key: self.layered[key].moved if key in self.layered else 0 for key in self.offloaded.get(rank, ())
        }


def plan_offload(
    order: Mapping[int, Iterable[Any]] | Iterable[Iterable[Any]],
    costs: Costs | Mapping[str, float] | None = None,
    policy: Any = "full",
    *,
    layers: int | Sequence[int] | Mapping[int, int] | None = None,
    layer_copy: float | Sequence[float] | Mapping[int, float] | None = None,
    peaks: Callable[[SimResult, Mapping[tuple[int, int], LayeredChunk]], Mapping[int, float]] | None = None,
    unit_compute: Sequence[Sequence[float] | None] | Mapping[int, Sequence[float] | None] | None = None,
) -> OffloadPlan:
    """Choose the chunks to offload in ``order`` and insert their OFFLOAD/RELOAD actions.

    ``order``: rank -> actions, or a list of per-rank action lists (torch's ``pipeline_order`` or
    ``get_schedule_ops`` output included); only compute passes matter. ``costs.transfer`` is one chunk's
    one-way copy time; ``policy``: anything `resolve_offload` accepts.

    The compute-only order is simulated with ``costs``. On every rank, the chunks worth offloading
    (lifespan >= ``min_lifespan``, and a forward-to-backward window longer than an offload plus a
    reload) are taken all (full) or by the policy's share of the rank's chunks (see
    ``OffloadPolicy.choose``). Each OFFLOAD goes right after its F; each RELOAD at the latest position
    that ends ``reload_margin`` backward passes before the chunk's first backward in the timeline, then
    replayed with the copy lanes and moved earlier while a queued copy still ends too late.

    Budget mode (layer by layer, module doc) needs ``layers``: the number of layers of every stage (one
    int for all, or per stage index); ``layer_copy``: one layer's one-way copy time in cost units (one
    number or per stage, a stage's entry possibly one per layer where its layers differ, which the replay
    then times each; default: the chunk's ``costs.transfer`` share of one layer); ``peaks``: the
    per-rank peak the budget lowers, from a replay and its layered chunks (the planner passes the peak
    in bytes, with each stage's real bytes; default: the simulator's chunk units, in which every chunk
    weighs the same); ``unit_compute``: per stage, each unit's share of the stage's passes (None entries:
    equal shares), where the units differ in compute (sub-layer units: `OffloadPolicy.granularity`; then
    ``layers`` counts units and ``layer_copy`` gives each unit's copy). Whole-chunk modes ignore all four,
    so a caller can pass them whatever the policy.
    """
    compute = _compute_order(order)
    costs = Costs.coerce(costs)
    policy = resolve_offload(policy).resolved(costs)
    offloaded: dict[int, list[tuple[int, int]]] = {r: [] for r in compute}
    if not policy.enabled:
        return OffloadPlan(compute, offloaded, policy, simulate(compute, costs, copy_lanes=policy.lanes))
    if policy.close_w:
        from pp_offload.order.zb_offload import plan_close_w

        def budget(order: Mapping[int, list[Action]], inner: OffloadPolicy) -> OffloadPlan:
            return plan_offload(
                order,
                costs,
                inner,
                layers=layers,
                layer_copy=layer_copy,
                peaks=peaks,
                unit_compute=unit_compute,
            )

        def peaks_of(p: OffloadPlan) -> Mapping[int, float]:
            return dict(p.sim.peak_memory) if peaks is None else peaks(p.sim, p.layered)

        return plan_close_w(compute, costs, policy, budget, peaks_of)
    if policy.mode == "budget":
        plan = _plan_budget(compute, costs, policy, layers, layer_copy, peaks, unit_compute)
        if policy.fraction is None and policy.max_slowdown > _DEFAULT_MAX_SLOWDOWN:
            # the search is greedy: a looser limit can end at the same peak for more time than the default
            # one reaches; never return worse than the default limit's plan
            strict = replace(policy, max_slowdown=_DEFAULT_MAX_SLOWDOWN)
            other = _plan_budget(compute, costs, strict, layers, layer_copy, peaks, unit_compute)
            if _plan_lower(other, plan, peaks):
                plan = replace(other, policy=policy)
        return plan

    plan, drops = _plan_whole(compute, costs, policy, drop_after_i=policy.drop_after_i)
    if drops:  # the drop is kept only where it lowers the peak without slowing the step
        kept, _ = _plan_whole(compute, costs, policy, drop_after_i=False)
        if not (plan.sim.makespan <= kept.sim.makespan + _EPS and plan.sim.peak < kept.sim.peak - _EPS):
            plan = kept
    return plan


def _plan_whole(
    compute, costs: Costs, policy: OffloadPolicy, *, drop_after_i: bool
) -> tuple[OffloadPlan, bool]:
    """Whole-chunk modes (full, selective, auto): which chunks move, and where their RELOADs go (and, with
    ``drop_after_i``, where the chunks whose W runs well after their I are reloaded again for it). Also
    whether any candidate chunk could be dropped after its I: where none could, the plan is the one
    without ``drop_after_i``, choice included."""
    drops = False
    offloaded: dict[int, list[tuple[int, int]]] = {r: [] for r in compute}
    base = simulate(compute, costs)
    num_stages = 1 + max(a.stage_index for acts in compute.values() for a in acts)
    scale = 2.0 * len(compute) / num_stages  # chunks per stage, as in the simulator
    copy = costs.transfer * scale
    min_lifespan = 4.0 * copy if policy.min_lifespan is None else policy.min_lifespan

    reloads: dict[int, dict[tuple[int, int], _Chunk]] = {}
    for rank in compute:
        timeline = base.timeline[rank]
        chunks = _chunks(timeline)
        eligible = [
            c for c in chunks.values() if c.lifespan >= min_lifespan - _EPS and c.window > 2.0 * copy + _EPS
        ]
        for c in eligible:
            c.slot = _initial_slot(c, timeline, copy, policy)
        if drop_after_i:  # where each chunk would be reloaded again for its W (-1: it stays from I to W)
            w_of = {(st, mb): i for i, ((st, kind, mb), _, _) in enumerate(timeline) if kind == W}
            for c in eligible:
                if timeline[c.back_index][0][1] == I and c.key in w_of:
                    c.i_index, c.w_index = c.back_index, w_of[c.key]
                    queue = costs.queue_of(c.key[0])
                    c.w_copy = None if queue is None else queue * copy
                    c.w_slot = _w_slot(c, timeline, policy.reload_margin, copy)
                    drops = drops or c.w_slot >= 0
        n = _how_many(policy, len(chunks), len(eligible))
        if n >= len(eligible):
            chosen = sorted(eligible, key=lambda c: (-c.lifespan, c.f_start))
        elif policy.choose == "lifespan":
            chosen = _longest_first(eligible, n)
        else:
            chosen = _lower_peak_first(list(chunks.values()), eligible, n, copy, scale, timeline)
        offloaded[rank] = [c.key for c in chosen]
        reloads[rank] = {c.key: c for c in chosen}

    planned = _insert(compute, reloads)
    result = simulate(planned, costs, copy_lanes=policy.lanes)
    if policy.reload_lead is None:
        for _ in range(_REFINE_ROUNDS):
            if not _move_late_reloads(result, reloads, policy.reload_margin):
                break
            planned = _insert(compute, reloads)
            result = simulate(planned, costs, copy_lanes=policy.lanes)
    return OffloadPlan(planned, offloaded, policy, result), drops


def _plan_budget(
    compute, costs: Costs, policy: OffloadPolicy, layers, layer_copy, peaks_of=None, unit_compute=None
) -> OffloadPlan:
    """Budget mode: every chunk moves its earliest layers, as many as ``policy`` allows (module doc)."""
    num_stages = 1 + max(a.stage_index for acts in compute.values() for a in acts)
    counts = _per_stage(layers, num_stages, "layers", integer=True)
    if counts is None:
        raise ValueError(
            "offload mode 'budget' moves layers: pass layers= (the number of layers of every stage, one int "
            "or one per stage) to plan_offload; enable_offload counts them on the stage modules"
        )
    copies = _per_stage(layer_copy, num_stages, "layer_copy", integer=False)
    shares = _unit_shares(unit_compute, counts)
    base = simulate(compute, costs)
    scale = 2.0 * len(compute) / num_stages
    chunks: dict[int, list[_Chunk]] = {}
    for rank in compute:
        timeline = base.timeline[rank]
        w_of = {(st, mb): i for i, ((st, kind, mb), _, _) in enumerate(timeline) if kind == W}
        mine = []
        for c in _chunks(timeline).values():
            n = counts[c.key[0]]
            if n == 0:
                continue
            c.layers = n
            c.layer_copy = copies[c.key[0]] if copies is not None else costs.transfer * scale / n
            if isinstance(c.layer_copy, (list, tuple)):  # per layer: exact in the replay, the first for
                c.layer_copies, c.layer_copy = tuple(c.layer_copy), c.layer_copy[0]  # the placement
            c.shares = shares[c.key[0]]
            _, b_start, b_end = timeline[c.back_index]
            c.back_duration = b_end - b_start
            c.fit = _layers_that_fit(c, c.back_start, policy.reload_margin)
            if timeline[c.back_index][0][1] == I and c.key in w_of:
                c.i_index, c.w_index = c.back_index, w_of[c.key]
                queue = costs.queue_of(c.key[0])
                if queue is not None:  # deferred W: the queue's copy, a share of the whole chunk's
                    whole = sum(c.layer_copies) if c.layer_copies else c.layer_copy * n
                    c.w_copy = queue * whole
            mine.append(c)
        chunks[rank] = mine

    replays = PlacementReplay(compute, costs, policy.lanes)
    memo = trial_memo(compute, costs, policy, repr((counts, copies, shares)), peaks_of)

    def attempt(
        cap: int | None, drop_after_i: bool, extra: Mapping[tuple[int, int], int] | None = None
    ) -> tuple:
        """``(placement, offloaded, replay, moved layers, peaks)`` of one trial (its placement's chunks
        are written into the order by `placed`)."""
        extra = extra or {}
        moved: dict[tuple[int, int], LayeredChunk] = {}
        reloads: dict[int, dict[tuple[int, int], _Chunk]] = {}
        for rank, mine in chunks.items():
            reloads[rank] = {}
            for c in mine:
                if policy.fraction is not None:
                    c.moved = min(c.fit, math.floor(policy.fraction * c.layers + 0.5))
                else:
                    c.moved = min(cap, c.fit)
                    if c.moved > 0:  # extra layers (or fewer) go to chunks whose window hides one at least
                        c.moved = max(0, min(c.layers, c.moved + extra.get((c.key[0], c.key[1] % 2), 0)))
                if c.moved == 0:
                    continue
                reloads[rank][c.key] = c
        # the trial is decided by the layers each chunk moves (`trial_memo`)
        key = (drop_after_i, tuple((k, c.moved) for mine in reloads.values() for k, c in mine.items()))
        if key in memo:
            STATS["repeats"] += 1
            return memo[key]
        STATS["trials"] += 1
        for rank, mine in reloads.items():
            for c in mine.values():
                moved[c.key] = LayeredChunk(c.moved, c.layers, c.layer_copies or c.layer_copy, c.compute)
                c.slot = _layered_slot(c, base.timeline[rank], policy)
                c.w_slot = _w_slot(c, base.timeline[rank], policy.reload_margin) if drop_after_i else -1
        result = replays.run(reloads, moved)
        if policy.reload_lead is None:
            for _ in range(_REFINE_ROUNDS):
                if not _move_late_layered(result, reloads, policy.reload_margin):
                    break
                result = replays.rerun(reloads)
        result = replays.kept(result)
        offloaded = {r: sorted(reloads[r], key=lambda k: (-moved[k].moved, k)) for r in compute}
        peaks = dict(result.peak_memory) if peaks_of is None else dict(peaks_of(result, moved))
        memo[key] = found = (snapshot(reloads), offloaded, result, moved, peaks)
        return found

    def placed(found: tuple) -> OffloadPlan:
        """The plan of a trial: its placement written into the order (fresh containers: the memo keeps
        the trial's)."""
        reloads, offloaded, result, moved, _ = found
        order = replays.order(reloads)
        return OffloadPlan(order, {r: list(k) for r, k in offloaded.items()}, policy, result, dict(moved))

    if policy.fraction is not None:
        return placed(attempt(None, policy.drop_after_i))
    limit = base.makespan * (1.0 + policy.max_slowdown) + _EPS
    top = max((c.fit for mine in chunks.values() for c in mine), default=0)
    best = None
    halves: list[tuple] = []  # every-other-microbatch starts within the limit
    # per setting of drop_after_i (its second reloads compete for the host->device lane), bisection on
    # the cap of layers per chunk: the largest cap within the slowdown; the lower peak of the two wins
    setting = None
    stages = {c.key[0] for mine in chunks.values() for c in mine}
    for drop in (False, True) if policy.drop_after_i else (False,):
        tried = set()
        low, high = 1, top
        while low <= high:
            mid = (low + high) // 2
            tried.add(mid)
            found = attempt(mid, drop)
            if found[2].makespan <= limit:
                low = mid + 1
                if best is None or _lower(found, best):
                    best, setting = found, (mid, drop, {})
            else:
                high = mid - 1
        # the smallest settings too, since a larger cap may lower the peak no further for more time:
        # one layer per chunk, and one layer on every other microbatch (when one per chunk is already
        # too much for the copy lanes)
        half = {(s, 1): -1 for s in stages}
        for cap, extra in ((1, {}), (1, half)) if top >= 1 else ():
            if extra or cap not in tried:
                found = attempt(cap, drop, extra)
                if found[2].makespan <= limit:
                    if extra:
                        halves.append((found, (cap, drop, extra)))
                    if best is None or _lower(found, best):
                        best, setting = found, (cap, drop, extra)
    if best is not None:
        # second phase from the best first-phase setting and from the every-other-microbatch ones: adding
        # layers where the peak is can beat a uniform cap that reached the same peak at more cost
        raised = [_raise_peak_stages(attempt, best, setting, chunks, limit)]
        others = [(f, st) for f, st in halves if st != setting]
        if others:  # the best every-other-microbatch start only, with fewer tries (each one is a replay)
            start = others[0]
            for f, st in others[1:]:
                if _lower(f, start[0]):
                    start = (f, st)
            raised.append(_raise_peak_stages(attempt, *start, chunks, limit, max_tries=8))
        best = raised[0]
        for found in raised[1:]:
            if _lower(found, best):
                best = found
    if best is None:
        return OffloadPlan(
            compute, {r: [] for r in compute}, policy, simulate(compute, costs, copy_lanes=policy.lanes)
        )
    return placed(best)


def _plan_lower(plan: OffloadPlan, than: OffloadPlan, peaks_of) -> bool:
    """`_lower` for two budget plans (their peaks from ``peaks_of``, else the simulator's chunk units)."""

    def key(p: OffloadPlan) -> tuple:
        found = dict(p.sim.peak_memory) if peaks_of is None else dict(peaks_of(p.sim, p.layered))
        return (None, None, p.sim, None, found)

    return _lower(key(plan), key(than))


def _lower(found: tuple, than: tuple, tolerance: float = 1e-3) -> bool:
    """Whether budget attempt ``found`` beats ``than``: a highest peak lower by more than ``tolerance``
    (relative), or the same peak within it in less time. Why the tolerance: the peaks are in bytes, and a
    larger cap can shave a few bytes off the peak for several percent more step time."""
    a, b = max(found[4].values()), max(than[4].values())
    if a < b * (1.0 - tolerance):
        return True
    return a <= b * (1.0 + tolerance) and found[2].makespan < than[2].makespan - _EPS


def _raise_peak_stages(attempt, best, setting, chunks, limit: float, max_tries: int = 24):
    """Budget auto, second phase: one more layer for the chunks of one stage at a time on a rank at the
    highest peak, longest-lived stages first, kept while the step stays within ``limit``, the rank's peak
    falls and the highest peak does not rise: on every microbatch of the stage, else on every other one
    (even, then odd microbatches).
    A rank whose chunks' windows hide no more (the V's turn, where F and B follow each other closely)
    stops the search once it holds the highest peak (``peaks``: in bytes when the caller gives them).

    Why: copy lanes carry a fixed number of layers per step; a uniform cap spends them on every chunk
    alike, while the peak sits on one rank and the long-lived chunks there gain most. Why every other
    microbatch: at real sizes one layer's copy takes several layers' compute (k of 4-7), so one more
    layer on every chunk of a stage can take the copy lanes from half busy to saturated; on half the
    chunks it lowers the peak by about half as much for half the traffic, the granularity between."""
    cap, drop, extra = setting
    lifespans: dict[int, dict[int, list[float]]] = {}
    for rank, mine in chunks.items():
        for c in mine:
            lifespans.setdefault(rank, {}).setdefault(c.key[0], []).append(c.lifespan)
    tries = 0
    improved = True
    stuck: set[int] = set()
    chosen = best  # returned: the lowest highest peak seen (a tie lowered on one rank costs time for nothing)
    while improved and tries < max_tries:
        improved = False
        peaks = best[4]
        top = max(peaks.values())
        # the ranks at the highest peak (within 2%: a tie in all but rounding); lowering another costs
        # copy-lane time and lowers nothing that counts
        for rank in sorted((r for r in peaks if peaks[r] >= 0.98 * top), key=lambda r: -peaks[r]):
            if rank in stuck:
                continue
            stages = sorted(lifespans.get(rank, {}).items(), key=lambda kv: -sum(kv[1]) / len(kv[1]))
            for keys in [
                parities
                for stage, _ in stages
                for parities in (((stage, 0), (stage, 1)), ((stage, 0),), ((stage, 1),))
            ]:
                if tries >= max_tries:
                    break
                tries += 1
                trial = dict(extra)
                for key in keys:
                    trial[key] = trial.get(key, 0) + 1
                found = attempt(cap, drop, trial)
                new = found[4]
                # this rank's peak falls and no other's rises above the highest
                if (
                    found[2].makespan <= limit
                    and max(new.values()) <= top + _EPS
                    and new[rank] < peaks[rank] - _EPS
                ):
                    best, extra, improved = found, trial, True
                    if _lower(found, chosen):
                        chosen = found
                    break
            if improved:
                break
            stuck.add(rank)  # nothing of this rank helped: not retried after other ranks' changes
    return chosen
