"""Replays of one compute order under many budget offload placements: where budget offload spends its time.

Why this exists: budget offload (`pp_offload.order.offload`, ``mode="budget"``) searches the layers each
chunk moves by trial: every trial places its RELOADs, replays the order with the copy lanes, moves the
reloads that end late one pass earlier and replays again (up to ``_REFINE_ROUNDS`` times). The planner's
README example (Llama-3-8B, seq 8192, pp 4, 16 microbatches) ran ~4,500 trials and ~40,000 replays, 93% of
its time. Three things here cut that work without changing any decision:

- `PlacementReplay`: what every replay of one compute order shares (its passes, their dependencies and
  durations) is prepared once, and a placement's OFFLOAD/RELOAD positions are handed to the simulator as
  they are, instead of being written into a new order (`_insert`) that the simulator then reads back. The
  order with its copies is written once, for the placement kept (`PlacementReplay.order`), and memory
  curves are computed for the replay a trial keeps only (`PlacementReplay.kept`).
- `PlacementReplay.rerun`: a refinement round moves a few RELOADs; each rank is replayed again only from
  its first moved transfer or its first pass whose dependency on another rank now ends at another time
  (`pp_offload.sim._TransferReplay.rerun`). Every replay is the simulator's own, so every time and peak
  is the one `simulate` gives the written order (tests/test_offload_replay.py checks each replay, reruns
  included, on placements of every kind).
- `trial_memo`: a trial's outcome depends only on the order, the costs, the policy's placement fields, the
  layer inputs, the peak function, whether chunks are dropped after I, and how many layers each chunk
  moves. The planner asks for the same trials several times (``budget``, then ``budget:auto:0.1`` whose
  plan is compared with the default limit's, then ``budget:close-w`` whose first plan is the order as
  given): the memo answers the repeats (40% of the trials of the README example).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from operator import itemgetter
from typing import Any

from pp_offload.order.actions import OFFLOAD, RELOAD, Action, Costs
from pp_offload.sim import (
    LayeredChunk,
    SimResult,
    _durations,
    _flatten,
    _TransferReplay,
    dependency,
    simulate,
)

__all__ = ["STATS", "PlacementReplay", "reference_replays", "trial_memo"]

_MEMO_ORDERS = 4  # orders whose trials are kept: the policies of one schedule ask in a row
_POSITION = itemgetter(0, 1, 2)  # a transfer's place in the order: position, OFFLOAD first, backward
STATS: Counter[str] = Counter()
"""Work done in this process: ``replays`` (of placements), ``trials`` (run) and ``repeats`` (answered
by `trial_memo`); bench/bench_plan_speed.py prints them."""
_reference = False


@contextmanager
def reference_replays() -> Iterator[None]:
    """Within the block, every placement is written into its order and replayed by `simulate` (checks
    included), and no trial is remembered: the search as it ran before this module, the yardstick the
    fast path is compared with (tests/test_offload_replay.py, bench/bench_plan_speed.py). One process
    only: worker processes started before the block do not see it."""
    global _reference
    before, _reference = _reference, True
    try:
        yield
    finally:
        _reference = before


class PlacementReplay:
    """Replays of ``compute`` (rank -> compute `Action`s, as `plan_offload` holds it) with ``costs`` on
    ``lanes`` copy lanes, under placements given as chunks (`pp_offload.order.offload_placement._Chunk`:
    ``slot``, ``w_slot``, ``f_index``, ``i_index``, ``back_index``, ``w_index``), rank -> {key: chunk}."""

    def __init__(self, compute: Mapping[int, list[Action]], costs: Costs, lanes: str) -> None:
        self.compute, self.costs, self.lanes = compute, costs, lanes
        # what `simulate` derives from the order's compute passes, which every placement shares
        self.ranks = sorted(compute)
        self.passes = {r: _flatten(compute[r], None) for r in self.ranks}
        num_stages = max(s for r in self.ranks for s, _, _ in self.passes[r]) + 1
        self.scale = 2.0 * len(self.ranks) / num_stages
        self.rank_of_stage = {s: r for r in self.ranks for s, _, _ in self.passes[r]}
        self.deps = {r: [dependency(s, k, j, num_stages) for s, k, j in self.passes[r]] for r in self.ranks}
        self.duration = _durations(self.passes, costs, self.scale, num_stages)
        self.engine = _TransferReplay(
            self.ranks, self.passes, self.deps, self.duration, costs, self.scale, self.rank_of_stage, lanes
        )
        self.layered: Mapping = {}
        self.resumable = False
        self.transfers_of: dict[tuple[int, int], tuple] = {}  # (stage, microbatch) -> OFFLOAD, RELOAD

    def run(self, reloads: Mapping[int, Mapping[tuple[int, int], Any]], layered: Mapping) -> SimResult:
        """``simulate(_insert(compute, reloads), costs, copy_lanes=lanes, layered=layered)``, the same
        result for less work (the module doc), its memory curves and peaks left to `kept`."""
        STATS["replays"] += 1
        self.layered, self.resumable = layered, False
        if _reference:
            return simulate(self.order(reloads), self.costs, copy_lanes=self.lanes, layered=layered)
        found = {r: self._transfers(r, reloads.get(r, {})) for r in self.ranks}
        if not any(found.values()):  # nothing placed: the plain replay, as `simulate` takes it
            return simulate(self.compute, self.costs, copy_lanes=self.lanes, layered=layered)
        self.resumable = True
        # `_transfers` places every copy between its F and its backward: `simulate`'s check would pass
        return self.engine.run(found, dict(layered), memory=False)

    def rerun(self, reloads: Mapping[int, Mapping[tuple[int, int], Any]]) -> SimResult:
        """`run` with the last run's ``layered`` and a placement that differs from the last one in a few
        RELOADs (the search's refinement rounds): the same result, the ranks replayed only from where the
        placements differ (`pp_offload.sim._TransferReplay.rerun`)."""
        found = None if _reference else {r: self._transfers(r, reloads.get(r, {})) for r in self.ranks}
        if found is None or not self.resumable or not any(found.values()):
            return self.run(reloads, self.layered)
        STATS["replays"] += 1
        return self.engine.rerun(found, memory=False)

    def kept(self, result: SimResult) -> SimResult:
        """``result``, the latest replay, with its memory curves and peaks: `run` and `rerun` leave them out
        (the search replays a trial up to 33 times and keeps the last)."""
        if self.resumable and not _reference and not result.peak_memory:
            self.engine.add_memory(result)
        return result

    def _transfers(self, rank: int, chunks: Mapping[tuple[int, int], Any]) -> list[tuple]:
        """The rank's OFFLOAD/RELOAD actions as `pp_offload.sim._flatten` collects them from `_insert`'s
        order: ``(compute passes before it, action, kind, stage, microbatch)``, in the order's sequence
        (at one position: the OFFLOAD after the pass before it first, then the RELOADs in the order of
        their backwards)."""
        if not chunks:
            return []
        events = []
        append = events.append
        made = self.transfers_of
        for c in chunks.values():
            pair = made.get(c.key)
            if pair is None:  # the chunk's OFFLOAD and RELOAD as the simulator reads them, made once
                stage, mb = c.key
                pair = made[c.key] = tuple((Action(stage, k, mb), k, stage, mb) for k in (OFFLOAD, RELOAD))
            offload, reload = pair
            append((c.f_index + 1, 0, 0, offload))
            append((c.slot, 1, c.back_index, reload))
            if c.w_slot >= 0:  # dropped after its I (the OFFLOAD after the I), reloaded before its W
                append((c.i_index + 1, 0, 0, offload))
                append((c.w_slot, 1, c.w_index, reload))
        events.sort(key=_POSITION)
        return [(at, *copy) for at, _, _, copy in events]

    def order(self, reloads: Mapping[int, Mapping[tuple[int, int], Any]]) -> dict[int, list[Action]]:
        """The compute order with the placement's OFFLOAD/RELOAD actions written in (`_insert`)."""
        from pp_offload.order.offload_placement import _insert

        return _insert(self.compute, reloads)


def snapshot(reloads: Mapping[int, Mapping[tuple[int, int], Any]]) -> dict[int, dict[tuple[int, int], Any]]:
    """A copy of a placement's chunks, to write its order later: the search moves the chunks' slots on."""
    return {r: {k: replace(c) for k, c in chunks.items()} for r, chunks in reloads.items()}


_MEMO_PASSES = 1_000_000
"""Compute passes of the trials' replays the memo keeps, all orders together (each kept trial holds its
replay's timeline and copies): ~100 MB at most. The README example keeps ~300 trials of ~400 passes; a
pp 16, m 256 order (~25,000 passes) keeps 40."""


class _Memo(dict):
    """One order's trials (`trial_memo`), each counted as its order's passes against ``_MEMO_PASSES``: older
    orders' trials make room, and a trial that does not fit is not kept (it is run again if asked)."""

    def __init__(self, passes: int) -> None:
        super().__init__()
        self.passes = passes

    def __setitem__(self, key: Any, value: Any) -> None:
        while sum(len(m) * m.passes for m in _MEMO.values()) + self.passes > _MEMO_PASSES:
            oldest = next(iter(_MEMO.values()), None)
            if oldest is None or oldest is self:
                return
            _MEMO.popitem(last=False)
        super().__setitem__(key, value)


_MEMO: OrderedDict[Any, _Memo] = OrderedDict()


class _Forgetful(dict):
    """A memo that remembers nothing (`reference_replays`: every trial is run, repeats included)."""

    def __setitem__(self, key: Any, value: Any) -> None:
        pass


def trial_memo(
    compute: Mapping[int, list[Action]],
    costs: Costs,
    policy: Any,
    inputs: tuple,
    peaks_of: Callable[[SimResult, Mapping[tuple[int, int], LayeredChunk]], Mapping[int, float]] | None,
) -> dict:
    """The outcomes of budget trials already run on these inputs (the module doc), keyed by the caller
    (whether chunks are dropped after I, and the layers each chunk moves); empty where the inputs cannot be
    told apart by value (a peak function that is not a method of a hashable object or a plain function)."""
    if _reference:
        return _Forgetful()
    owner = getattr(peaks_of, "__self__", None)
    peaks_key = (owner, getattr(peaks_of, "__func__", None)) if owner is not None else peaks_of
    # what a trial depends on in the policy: where its reloads go, not the slowdown it is held to
    placing = (policy.fraction, policy.reload_margin, policy.reload_lead, policy.lanes)
    key = (tuple((r, tuple(a)) for r, a in compute.items()), costs, placing, inputs, peaks_key)
    try:
        hash(key)
    except TypeError:  # unhashable inputs: no memo
        return {}
    memo = _MEMO.get(key)
    if memo is None:
        memo = _MEMO[key] = _Memo(sum(len(a) for a in compute.values()))
        while len(_MEMO) > _MEMO_ORDERS:
            _MEMO.popitem(last=False)
    _MEMO.move_to_end(key)
    return memo
