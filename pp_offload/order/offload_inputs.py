"""What an offload plan depends on beyond the order and the policy: the figures the planner predicts with.

Why this exists: `pp_offload.order.offload.plan_offload` places budget offload (which layers of which
chunks move, where each RELOAD goes) from the costs, each stage's layer count, each stage's per-layer copy
time and a per-rank peak to lower. The planner (`pp_offload.plan`) knows all four per stage: pass times
per stage (``Costs.stages``; the embedding's and the LM head's stages weigh differently), layers per stage
from its split, the bytes one layer saves and how long their copy takes on the machine, and the peak in
real bytes (a stage holding the LM head and the loss holds more per microbatch). A runtime that knows only
its own stages' layer counts and scalar costs places offload elsewhere than the planner predicted.
`OffloadInputs` carries the planner's figures to `pp_offload.runtime.offload.enable_offload` (and the V
schedules' ``offload_inputs=``), so the runtime plans exactly what the planner reported.

Pure Python and JSON-safe (`OffloadInputs.to_dict` / `from_dict`): the recipe's ``schedule: auto`` path
broadcasts it from rank 0. The planner builds it with `pp_offload.plan.offload_inputs` (from a model
config and a machine preset) or `pp_offload.plan.evaluate.Setup.offload_inputs` (any setup, measured ones
included).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pp_offload.order.actions import OFFLOAD, RELOAD, B, Costs, F, I, W

__all__ = ["OffloadInputs", "StageBytes", "activation_level", "activation_peaks"]


@dataclass(frozen=True)
class StageBytes:
    """One stage's activation bytes for one microbatch.

    saved: what autograd saves in the stage's forward (what the activation store captures and offload
        moves); held from the start of its F to the end of its W (or B).
    resident: what stays on the device whatever is offloaded (the stage's output, the loss's tensors),
        held from the start of its F to the end of its input-gradient pass (I, or B).
    layer: the bytes one moved layer carries (budget offload moves whole layers).
    per_layer: the bytes of each of the stage's layers, first layer first, where they differ (a recompute
        plan on a share of the layers, `pp_offload.recompute_plan`; the first layer reading its receive
        buffer): a moved layer ``i`` then carries ``per_layer[i]`` off the device, and ``layer`` is only the
        size its copy time is taken from. ``None``: every layer carries ``layer``.
    held_after_input: what a ``+once`` recompute plan recomputes in the input-gradient pass and keeps for
        the weight pass (`pp_offload.runtime.recompute_once`), on the device from the start of I to the end
        of W under torch's retained-graph split; 0 otherwise (a full backward B recomputes and frees within
        the pass; deferred W's I releases the graph).
    queued: deferred weight gradients (`pp_offload.runtime.deferred_w`, `pp_offload.plan.memory.
        queued_bytes`): the W queue's bytes, held from the end of I to the end of W, while ``saved`` and
        ``resident`` leave when I ends. ``None``: torch's retained-graph split, ``saved`` held until W ends.
    """

    saved: int
    resident: int = 0
    layer: int = 0
    per_layer: tuple[int, ...] | None = None
    held_after_input: int = 0
    queued: int | None = None

    def __post_init__(self) -> None:
        for name in ("saved", "resident", "layer", "held_after_input", "queued"):
            value = getattr(self, name)
            if name == "queued" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"StageBytes.{name} must be an int >= 0 (bytes), got {value!r}")
        if self.per_layer is not None:
            object.__setattr__(self, "per_layer", tuple(self.per_layer))
            if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in self.per_layer):
                raise ValueError(f"StageBytes.per_layer must hold ints >= 0 (bytes), got {self.per_layer!r}")

    def moved_bytes(self, index: int) -> int:
        """Bytes layer ``index`` (0: the stage's first) carries off the device when it moves."""
        return self.layer if self.per_layer is None else self.per_layer[index]

    @property
    def total(self) -> int:
        return self.saved + self.resident


@dataclass(frozen=True)
class OffloadInputs:
    """The planner's figures for placing offload on one schedule: pass them to ``enable_offload(...,
    inputs=...)`` to place exactly the offload the planner predicted for this order.

    costs: the per-chunk costs plans are simulated with, with each stage's own F/I/W (``Costs.stages``) and
        ``transfer`` (one chunk unit's copy time one way), in any unit shared with ``layer_copy``.
    layers: decoder layers of every stage (index = stage); the runtime checks its own stages hold these.
    layer_copy: one moved layer's one-way copy time per stage, in the unit of ``costs``; a stage's entry may
        be one per layer (its layers save different bytes: a recompute plan on a share of them).
    stage_bytes: every stage's bytes (`StageBytes`); budget offload then lowers the per-rank peak in bytes
        (`activation_peaks`), as the planner reports it. ``None``: the simulator's chunk units (every chunk
        weighs the same).
    granularity: the offload unit these figures count (`pp_offload.order.offload.OffloadPolicy.granularity`):
        ``"layer"``, or ``"sublayer"``, where ``layers`` counts each stage's units (two per decoder layer
        that splits at its attention, one per layer that does not), and ``layer_copy`` and
        ``StageBytes.per_layer`` hold one entry per unit. A budget policy must use the granularity its
        inputs were built for.
    unit_compute: per stage, each unit's share of the stage's passes (None: equal shares), where units
        differ in compute (sub-layer units: an attention half and an MLP half).
    """

    costs: Costs
    layers: tuple[int, ...]
    layer_copy: tuple[float | tuple[float, ...], ...]
    stage_bytes: tuple[StageBytes, ...] | None = field(default=None)
    granularity: str = "layer"
    unit_compute: tuple[tuple[float, ...] | None, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "costs", Costs.coerce(self.costs))
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(
            self,
            "layer_copy",
            tuple(
                tuple(float(x) for x in c) if isinstance(c, (list, tuple)) else float(c)
                for c in self.layer_copy
            ),
        )
        n = len(self.layers)
        if n == 0:
            raise ValueError("OffloadInputs.layers is empty; give the layer count of every stage")
        for s, count in enumerate(self.layers):
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise ValueError(f"OffloadInputs.layers[{s}] must be an int >= 0, got {count!r}")
        if len(self.layer_copy) != n:
            raise ValueError(f"OffloadInputs.layer_copy has {len(self.layer_copy)} entries for {n} stages")
        for s, c in enumerate(self.layer_copy):
            parts = c if isinstance(c, tuple) else (c,)
            if any(not x >= 0 or math.isinf(x) for x in parts):
                raise ValueError(
                    f"OffloadInputs.layer_copy entries must be finite and >= 0: {self.layer_copy}"
                )
            if isinstance(c, tuple) and len(c) != self.layers[s]:
                raise ValueError(
                    f"OffloadInputs.layer_copy[{s}] has {len(c)} entries for {self.layers[s]} layers"
                )
        if self.granularity not in ("layer", "sublayer"):
            raise ValueError(
                f"OffloadInputs.granularity must be 'layer' or 'sublayer', got {self.granularity!r}"
            )
        if self.unit_compute is not None:
            shares = tuple(None if c is None else tuple(float(x) for x in c) for c in self.unit_compute)
            object.__setattr__(self, "unit_compute", shares)
            if len(shares) != n:
                raise ValueError(f"OffloadInputs.unit_compute has {len(shares)} entries for {n} stages")
            for s, c in enumerate(shares):
                if c is not None and (len(c) != self.layers[s] or abs(sum(c) - 1.0) > 1e-6):
                    raise ValueError(
                        f"OffloadInputs.unit_compute[{s}] must hold {self.layers[s]} shares summing to 1, "
                        f"got {c}"
                    )
        if self.costs.stages is not None and len(self.costs.stages) != n:
            raise ValueError(f"OffloadInputs.costs has {len(self.costs.stages)} stage entries for {n} stages")
        if self.stage_bytes is not None:
            stage_bytes = tuple(b if isinstance(b, StageBytes) else StageBytes(**b) for b in self.stage_bytes)
            if len(stage_bytes) != n:
                raise ValueError(f"OffloadInputs.stage_bytes has {len(stage_bytes)} entries for {n} stages")
            object.__setattr__(self, "stage_bytes", stage_bytes)

    @property
    def num_stages(self) -> int:
        return len(self.layers)

    def plan_kwargs(self) -> dict[str, Any]:
        """`plan_offload`'s ``layers``, ``layer_copy``, ``unit_compute`` (where given) and ``peaks`` (only
        with ``stage_bytes``)."""
        kwargs: dict[str, Any] = {"layers": list(self.layers), "layer_copy": list(self.layer_copy)}
        if self.unit_compute is not None:
            kwargs["unit_compute"] = list(self.unit_compute)
        if self.stage_bytes is not None:
            kwargs["peaks"] = self.peaks
        return kwargs

    def peaks(self, sim: Any, layered: Mapping[tuple[int, int], Any]) -> dict[int, float]:
        """Per rank, the peak of device-resident activation bytes of ``sim`` (`activation_peaks`)."""
        if self.stage_bytes is None:
            raise ValueError("OffloadInputs.peaks needs stage_bytes")
        return dict(zip(sorted(sim.timeline), activation_peaks(sim, self.stage_bytes, layered), strict=True))

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe; `from_dict` inverts it."""
        costs: dict[str, Any] = {k: getattr(self.costs, k) for k in ("F", "I", "W", "comm", "transfer")}
        if self.costs.stages is not None:
            costs["stages"] = [list(s) for s in self.costs.stages]
        if self.costs.queue is not None:
            queue = self.costs.queue
            costs["queue"] = list(queue) if isinstance(queue, tuple) else queue
        return {
            "costs": costs,
            "layers": list(self.layers),
            "layer_copy": [list(c) if isinstance(c, tuple) else c for c in self.layer_copy],
            "stage_bytes": None
            if self.stage_bytes is None
            else [
                {"saved": b.saved, "resident": b.resident, "layer": b.layer}
                | ({} if b.per_layer is None else {"per_layer": list(b.per_layer)})
                | ({} if b.queued is None else {"queued": b.queued})
                | ({"held_after_input": b.held_after_input} if b.held_after_input else {})
                for b in self.stage_bytes
            ],
            "granularity": self.granularity,
            "unit_compute": None
            if self.unit_compute is None
            else [None if c is None else list(c) for c in self.unit_compute],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> OffloadInputs:
        unknown = set(data) - {"costs", "layers", "layer_copy", "stage_bytes", "granularity", "unit_compute"}
        if unknown:
            raise ValueError(f"unknown OffloadInputs keys {sorted(unknown)}")
        return cls(
            costs=Costs.coerce(data["costs"]),
            layers=tuple(data["layers"]),
            layer_copy=tuple(data["layer_copy"]),
            stage_bytes=None if data.get("stage_bytes") is None else tuple(data["stage_bytes"]),
            granularity=data.get("granularity", "layer"),
            unit_compute=None if data.get("unit_compute") is None else tuple(data["unit_compute"]),
        )


def activation_peaks(
    sim: Any, stage_bytes: Sequence[StageBytes], layered: Mapping[tuple[int, int], Any] | None = None
) -> list[int]:
    """Per rank (sorted), the peak of the device-resident activation bytes over ``sim``'s timeline.

    A chunk holds its stage's ``total`` from the start of its F; ``resident`` leaves when its I (or B) ends,
    ``saved`` when its W (or B) ends; ``held_after_input`` (a ``+once`` recompute plan) is held from the start
    of its I to the end of its W. Under deferred W (``queued`` set) ``saved`` leaves with ``resident`` when I
    ends and ``queued`` is held from there to the end of W instead (the runtime releases such a chunk when its
    I ends), and the plan's copies of the chunk between I and W move the queue: off the device from the end
    of the OFFLOAD after I to the start of the RELOAD before W. An offloaded whole chunk's ``saved`` is
    off the device from the end of its OFFLOAD to the start of its RELOAD; a chunk in ``layered`` (budget
    offload) moves per layer instead: each moved layer's bytes (`StageBytes.moved_bytes`) from the end of its
    own copy out to the start of its own copy back (``sim.layer_transfers``).
    """
    peaks = []
    for rank in sorted(sim.timeline):
        level = peak = 0
        for _, delta in _events(sim, stage_bytes, layered or {}, rank):
            level += delta
            peak = max(peak, level)
        peaks.append(peak)
    return peaks


def activation_level(
    sim: Any,
    stage_bytes: Sequence[StageBytes],
    rank: int,
    time_s: float,
    layered: Mapping[tuple[int, int], Any] | None = None,
) -> tuple[int, int]:
    """``rank``'s device-resident activation bytes at ``time_s`` (every change up to and at that time
    counted, as `activation_peaks` counts them), and what it would hold then without any copy: their
    difference is what offload has off the device at that moment (`pp_offload.plan.link_bound` compares
    it with what any placement could have off)."""
    held = without = 0
    for t, delta, copy in _events(sim, stage_bytes, layered or {}, rank, tagged=True):
        if t > time_s:
            break
        held += delta
        without += 0 if copy else delta
    return held, without


def _events(
    sim: Any,
    stage_bytes: Sequence[StageBytes],
    layered: Mapping[tuple[int, int], Any],
    rank: int,
    *,
    tagged: bool = False,
) -> list[tuple]:
    """``rank``'s memory changes (time, bytes), sorted, frees first at equal times; ``tagged``: a third
    entry saying whether the change is a copy's (OFFLOAD/RELOAD) rather than a pass's."""
    events: list[tuple[float, int, bool]] = []
    # deferred W: a chunk's saved tensors are gone once its I ends, so a copy after it moves nothing
    input_end = {
        (stage, mb): finish
        for (stage, kind, mb), _, finish in sim.timeline[rank]
        if kind == I and stage_bytes[stage].queued is not None
    }
    for (stage, kind, _), start, finish in sim.timeline[rank]:
        b = stage_bytes[stage]
        if kind == F:
            events.append((start, b.total, False))
        elif kind == I and b.queued is not None:  # deferred W: I frees the graph, the queue waits for W
            events.append((finish, -b.total, False))
            events.append((finish, b.queued, False))
        elif kind == I:
            events.append((finish, -b.resident, False))
            if b.held_after_input:
                events.append((start, b.held_after_input, False))
        elif kind == W and b.queued is not None:
            events.append((finish, -b.queued, False))
        elif kind == W:
            events.append((finish, -b.saved - b.held_after_input, False))
        elif kind == B:
            events.append((finish, -b.total, False))
    for action, index, start, finish in getattr(sim, "layer_transfers", {}).get(rank, []):
        if start >= input_end.get((int(action.stage_index), int(action.microbatch_index)), math.inf):
            continue
        nbytes = stage_bytes[int(action.stage_index)].moved_bytes(index)
        events.append((finish, -nbytes, True) if _kind(action) == OFFLOAD else (start, nbytes, True))
    for action, start, finish in sim.transfers.get(rank, []):
        key = (int(action.stage_index), int(action.microbatch_index))
        kind = _kind(action)
        if start >= input_end.get(key, math.inf):  # deferred W: the pair between I and W moves the queue
            queued = stage_bytes[int(action.stage_index)].queued or 0
            events.append((finish, -queued, True) if kind == OFFLOAD else (start, queued, True))
            continue
        if key in layered:
            continue  # counted per layer above
        saved = stage_bytes[int(action.stage_index)].saved
        if kind == OFFLOAD:
            events.append((finish, -saved, True))
        elif kind == RELOAD:
            events.append((start, saved, True))
    events.sort(key=lambda e: (e[0], e[1]))
    return events if tagged else [(t, d) for t, d, _ in events]


def _kind(action: Any) -> str:
    return str(getattr(action.computation_type, "value", action.computation_type))
