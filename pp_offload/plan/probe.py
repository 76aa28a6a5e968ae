"""Measure one pipeline's real per-stage costs by running it: the input of `pp_offload.plan.auto.choose`.

Why measure instead of estimate: the planner's costs come from FLOP and byte formulas and a machine preset;
a probe step on the real model, data and hardware gives the numbers that decide which schedule is fastest
under a memory limit (pass times per stage, the bytes autograd saves, how long a chunk's copy to host
really takes) at the price of one or two steps.

The probe runs a safe schedule (`PROBE_SCHEDULE`: V-Min, the lowest activation memory of the V family, any
``m >= 1``) with `PROBE_OFFLOAD` (``"full"``), so the activation store captures every chunk (its captured
bytes are the offloadable saved activations) and the OFFLOAD/RELOAD actions time real copies.
`pp_offload.runtime.timing.ActionTimer` records every executed action; the medians per stage and kind
become a `Measurement`, identical on every rank of the pipeline.

How torch 2.13 runs the first stage under split backward: stage 0 *skips* its I action (it has no input
gradient to send) and runs its whole backward at W. The probe therefore sees ~0 for stage 0's I and I + W
for its W; the total is kept and split in the I:W proportion measured on the other stages (``first_stage``
says so), which is what the simulator needs (`pp_offload.sim.as_executed_by_torch` turns stage 0's I/W
back into one B of I + W).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from pp_offload.plan.recompute_calibration import RecomputeCalibration

__all__ = [
    "PROBE_OFFLOAD",
    "PROBE_SCHEDULE",
    "Measurement",
    "StageMeasurement",
    "measure_step",
    "predicted_measurement",
    "unit_shares_for",
]

PROBE_SCHEDULE = "ScheduleVMin"
"""Safe: the lowest activation memory of the V family, for any number of microbatches >= 1."""
PROBE_OFFLOAD = "full"
"""So the store captures (and times the copies of) every chunk it offloads."""

_MiB = float(1 << 20)
_P2P_ROUNDS = 20


@dataclass(frozen=True)
class StageMeasurement:
    """One stage's measured costs. Times in seconds per microbatch (medians), bytes per microbatch.

    offload / reload: one chunk's copy to host / back (seconds); ``copies_estimated`` when the stage had
    no chunk offloaded in the probe and the copy time was derived from its bytes at the bandwidth measured
    on the other stages' copies.
    """

    F: float
    I: float
    W: float
    saved_bytes: int
    offload: float = 0.0
    reload: float = 0.0
    copies_estimated: bool = False
    layers: int = 0
    """Decoder layers of the stage (what budget offload moves one by one); 0 when unknown."""
    layer_bytes: tuple[int, ...] = ()
    """Per decoder layer, first first, the bytes budget offload moves when it moves the whole layer (what
    the runtime's capture of that layer records); empty when unknown (a measurement made before units
    were measured)."""
    units: tuple[tuple[int, ...], ...] = ()
    """Per decoder layer, the bytes of each of its sub-layer offload units (``budget:sublayer``): two, the
    attention half and the rest, for a layer the runtime splits (`pp_offload.runtime.offload.stage_units`),
    one for a layer it does not; empty when unknown."""
    recompute_shared: float = 0.0
    """Seconds included in both I and W that one full backward B runs once (a recomputation added by
    `pp_offload.plan.auto.RecomputeOption.apply`; 0 in a probe's own measurement)."""
    held_after_input: int = 0
    """Bytes a ``+once`` recompute plan holds on the device from the start of I to the end of W (set by
    `pp_offload.plan.auto.RecomputeOption.apply`; a probe measures without recompute)."""
    queued_bytes: int | None = None
    """Bytes one microbatch's deferred-W queue holds from its I to its W (`pp_offload.runtime.deferred_w`,
    measured by the stage's ``dw_builder``; the same under any recompute plan); None: not measured, or
    the stage keeps torch's retained-graph split (its saved bytes then live until W)."""

    def __post_init__(self) -> None:
        if isinstance(self.layers, bool) or not isinstance(self.layers, int) or self.layers < 0:
            raise ValueError(f"StageMeasurement.layers must be an int >= 0, got {self.layers!r}")
        layer_bytes = tuple(self.layer_bytes)
        units = tuple(tuple(u) for u in self.units)
        object.__setattr__(self, "layer_bytes", layer_bytes)
        object.__setattr__(self, "units", units)
        for name, count in (("layer_bytes", len(layer_bytes)), ("units", len(units))):
            if count not in (0, self.layers):
                raise ValueError(
                    f"StageMeasurement.{name} needs one entry per layer ({self.layers}) or none, got {count}"
                )
        flat = [*layer_bytes, *(b for u in units for b in u)]
        if any(isinstance(b, bool) or not isinstance(b, int) or b < 0 for b in flat):
            raise ValueError(f"StageMeasurement layer and unit bytes must be ints >= 0, got {flat!r}")
        if any(len(u) not in (1, 2) for u in units):
            raise ValueError(f"StageMeasurement.units: one or two units per layer, got {units!r}")
        for name in ("F", "I", "W", "offload", "reload", "recompute_shared"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"StageMeasurement.{name} must be a number >= 0 (seconds), got {value!r}")
        if (
            isinstance(self.saved_bytes, bool)
            or not isinstance(self.saved_bytes, int)
            or self.saved_bytes < 0
        ):
            raise ValueError(f"StageMeasurement.saved_bytes must be an int >= 0, got {self.saved_bytes!r}")
        queued = self.queued_bytes
        if queued is not None and (isinstance(queued, bool) or not isinstance(queued, int) or queued < 0):
            raise ValueError(f"StageMeasurement.queued_bytes must be an int >= 0 or None, got {queued!r}")


@dataclass(frozen=True)
class Measurement:
    """Measured costs of one pipeline of ``num_ranks`` ranks and ``2 * num_ranks`` stages (stage ``s`` is
    the same layers whatever the placement, so V and loop schedules read the same numbers).

    comm: one stage output's point-to-point transfer between two ranks (seconds).
    copies_overlap: True where device<->host copies run beside compute (CUDA copy streams); False where
        they are synchronous on the compute thread (CPU), so their time adds to the step.
    first_stage: how stage 0's I and W were obtained (see the module docstring).
    """

    num_ranks: int
    stages: tuple[StageMeasurement, ...]
    comm: float = 0.0
    copies_overlap: bool = True
    num_microbatches: int | None = None
    steps: int = 0
    schedule: str = PROBE_SCHEDULE
    offload: str = PROBE_OFFLOAD
    device: str = "unknown"
    first_stage: str = "measured"
    notes: tuple[str, ...] = field(default_factory=tuple)
    unit_shares: tuple[float, float] | None = None
    """A split layer's attention half's and rest's shares of its passes (what each sub-layer unit's
    compute hides of its copy): the planner's FLOP shares for the model's config
    (`pp_offload.plan.costs.layer_unit_shares`, via `unit_shares_for`), not timed (see `measure_step`);
    None: unknown, and ``schedule: auto`` then offers no sub-layer candidates."""
    recompute_costs: RecomputeCalibration | None = None
    """What recompute costs per decoder layer on the probe's device, measured on one of the probed
    model's layers (`measure_step`'s ``recompute_modes``, `pp_offload.plan.recompute_calibration`);
    `pp_offload.plan.auto.RecomputeOption.apply` charges it instead of the traffic model's shares. None:
    not measured."""
    deferred_w: bool = True
    """Whether the probe's stages deferred their weight gradients to W (`pp_offload.runtime.deferred_w`,
    the default) or kept torch's retained-graph split (the recipe's ``pipeline.deferred_w: false``): how
    `pp_offload.plan.auto.RecomputeOption.apply` charges recomputation (in I only, or in I and W) and how
    the judged orders run stage 0's backward (`pp_offload.plan.evaluate.Setup.deferred_w`)."""

    @property
    def units_known(self) -> str | None:
        """None when sub-layer offload can be judged on this measurement, else why not."""
        if not any(st.units for st in self.stages):
            return "the measurement has no sub-layer unit bytes (a probe made before they were measured?)"
        if any(st.layers and not st.units for st in self.stages):
            return "sub-layer unit bytes measured on some stages only"
        if self.unit_shares is None:
            return "the measurement has no unit compute shares (measure_step's unit_shares)"
        return None

    def __post_init__(self) -> None:
        if isinstance(self.num_ranks, bool) or not isinstance(self.num_ranks, int) or self.num_ranks < 2:
            raise ValueError(f"Measurement.num_ranks must be an int >= 2, got {self.num_ranks!r}")
        stages = tuple(self.stages)
        object.__setattr__(self, "stages", stages)
        if len(stages) != 2 * self.num_ranks:
            raise ValueError(
                f"Measurement needs one StageMeasurement per stage: 2 * num_ranks = {2 * self.num_ranks}, "
                f"got {len(stages)}"
            )
        if not all(isinstance(s, StageMeasurement) for s in stages):
            raise TypeError("Measurement.stages must hold StageMeasurement objects")
        if not self.comm >= 0:
            raise ValueError(f"Measurement.comm must be >= 0 seconds, got {self.comm!r}")
        object.__setattr__(self, "notes", tuple(self.notes))
        if self.unit_shares is not None:
            shares = tuple(float(x) for x in self.unit_shares)
            if len(shares) != 2 or min(shares) < 0 or abs(sum(shares) - 1.0) > 1e-6:
                raise ValueError(f"Measurement.unit_shares must be two shares summing to 1, got {shares!r}")
            object.__setattr__(self, "unit_shares", shares)
        if self.recompute_costs is not None and not isinstance(self.recompute_costs, RecomputeCalibration):
            object.__setattr__(self, "recompute_costs", RecomputeCalibration.from_dict(self.recompute_costs))

    @classmethod
    def uniform(
        cls,
        num_ranks: int,
        *,
        F: float,
        I: float,
        W: float,
        saved_bytes: int,
        offload: float = 0.0,
        reload: float | None = None,
        comm: float = 0.0,
        copies_overlap: bool = True,
        layers: int = 0,
    ) -> Measurement:
        """Every stage with the same costs (seconds), bytes and layers: hand-made inputs for `choose`."""
        stage = StageMeasurement(
            F=F,
            I=I,
            W=W,
            saved_bytes=saved_bytes,
            offload=offload,
            reload=offload if reload is None else reload,
            layers=layers,
        )
        return cls(
            num_ranks,
            (stage,) * (2 * num_ranks),
            comm=comm,
            copies_overlap=copies_overlap,
            device="hand-made",
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form; `from_dict` inverts it exactly."""
        out = asdict(self)
        out["stages"] = [asdict(s) for s in self.stages]
        out["notes"] = list(self.notes)
        if self.recompute_costs is not None:
            out["recompute_costs"] = self.recompute_costs.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Measurement:
        data = dict(data)
        data["stages"] = tuple(StageMeasurement(**s) for s in data["stages"])
        data["notes"] = tuple(data.get("notes", ()))
        if data.get("unit_shares") is not None:
            data["unit_shares"] = tuple(data["unit_shares"])
        return cls(**data)

    def table(self) -> str:
        """Per stage: its rank (V placement), F/I/W and copy times in ms, saved MiB per microbatch."""
        d = self.num_ranks
        head = (
            f"probe: {self.schedule} offload={self.offload}, {d} ranks, m={self.num_microbatches}, "
            f"{self.steps} step(s) on {self.device}; comm {self.comm * 1e3:.3f} ms; copies "
            f"{'overlap compute' if self.copies_overlap else 'synchronous (add to compute)'}; "
            f"stage 0 I/W {self.first_stage}"
            + ("" if self.deferred_w else "; torch's retained-graph split (no deferred W)")
        )
        lines = [
            head,
            f"{'stage':>5} {'rank':>4} {'F ms':>9} {'I ms':>9} {'W ms':>9} {'saved MiB':>10} "
            f"{'offload ms':>10} {'reload ms':>10}",
        ]
        for s, st in enumerate(self.stages):
            rank = s if s < d else 2 * d - 1 - s
            mark = "*" if st.copies_estimated else ""
            lines.append(
                f"{s:>5} {rank:>4} {st.F * 1e3:>9.3f} {st.I * 1e3:>9.3f} {st.W * 1e3:>9.3f} "
                f"{st.saved_bytes / _MiB:>10.3f} {st.offload * 1e3:>10.3f} {st.reload * 1e3:>9.3f}{mark:1}"
            )
        if any(st.copies_estimated for st in self.stages):
            lines.append("* copy time estimated from the stage's bytes at the measured bandwidth")
        split = [(s, st.units[0]) for s, st in enumerate(self.stages) if st.units and len(st.units[0]) == 2]
        if split and self.unit_shares is not None:
            s, (attention, rest) = split[0]
            lines.append(
                f"sub-layer units (stage {s}, first layer): attention half {attention / _MiB:.3f} MiB, rest "
                f"{rest / _MiB:.3f} MiB; compute shares {self.unit_shares[0]:.2f} / {self.unit_shares[1]:.2f}"
            )
        elif self.units_known is not None:
            lines.append(f"sub-layer units unknown: {self.units_known}")
        if self.recompute_costs is not None:
            lines.append(self.recompute_costs.summary())
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)


def measure_step(
    schedule: Any,
    step: Callable[[], Any],
    *,
    steps: int = 1,
    group: Any = None,
    sync_cuda: bool | None = None,
    comm: float | None = None,
    unit_shares: tuple[float, float] | None = None,
    recompute_modes: Sequence[str] = (),
) -> Measurement:
    """Run ``step`` (one ``schedule.step(...)``) ``steps`` times while timing every action; return the same
    `Measurement` on every rank of ``group`` (this pipeline's process group; None = WORLD).

    ``schedule``: a runtime schedule with two stages per rank built with ``offload=PROBE_OFFLOAD`` (its
    ``schedule.offload.store`` provides the bytes). During the probe every chunk is captured by the store,
    also those the offload plan skips (too short-lived to gain), so every stage's bytes are known; chunks
    the plan offloads time the copies. ``sync_cuda`` (default: on CUDA) synchronizes at action boundaries
    so host times are true durations. ``comm``: one stage output's p2p time in seconds; default measured
    by a ping-pong between the group's ranks 0 and 1. A collective: every rank of ``group`` must call it.

    Offload units: while each chunk is captured whole, the store marks where each decoder layer, and each
    layer's attention submodule, begins and returns (the hooks `pp_offload.runtime.offload.stage_units`
    places for budget offload), and records per layer the bytes a capture of that layer alone, and of
    each of its sub-layer units alone, would move (`ActivationStore.recorded_bytes`): what budget offload
    moves per layer and per unit, by the same rules. ``unit_shares``: a split layer's attention half's and
    rest's shares of its passes, stored in the measurement; the planner's FLOP shares for the model
    (`unit_shares_for`). Why not timed: on CPU (where the recipe rehearses a GPU run) a small layer's time
    split reflects CPU kernels and Python overhead, not the GPU's; on CUDA, timing inside a forward needs a
    synchronize at every unit boundary, which slows the very step being measured.

    Recompute: ``recompute_modes`` (e.g. ``("full", "selective", "mlp")``) are timed after the steps on one
    decoder layer per rank (its first stage's first layer, with the inputs it had in the last probe step:
    `pp_offload.plan.recompute_calibration.calibrate_recompute`, while the other ranks time theirs); the
    per-figure median over the ranks is `Measurement.recompute_costs`, what
    `pp_offload.plan.auto.RecomputeOption.apply` charges. Skipped (with a note) where the layers are
    already checkpointed or cannot take a mode. Costs a few dozen layer passes (well under a second on
    CPU for a small model).
    """
    import torch
    import torch.distributed as dist

    from pp_offload.plan.recompute_calibration import calibrate_recompute, layer_inputs
    from pp_offload.runtime import compat
    from pp_offload.runtime.timing import ActionTimer

    runtime = getattr(schedule, "offload", None)
    if runtime is None or not hasattr(runtime, "store"):
        raise ValueError(
            f"measure_step needs the probe schedule built with offload={PROBE_OFFLOAD!r} (its activation "
            f"store measures the saved bytes), got schedule.offload={runtime!r}; e.g. "
            f"{PROBE_SCHEDULE}(stages, m, ..., offload={PROBE_OFFLOAD!r})"
        )
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    stages = compat.schedule_stages(schedule)
    d, num_stages = stages[0].group_size, stages[0].num_stages
    if num_stages != 2 * d:
        raise ValueError(
            f"measure_step needs two stages per rank (2 * {d} stages), the schedule has {num_stages}"
        )
    store = runtime.store
    if sync_cuda is None:
        sync_cuda = store.device.type == "cuda"
    distributed = dist.is_available() and dist.is_initialized()
    chunks = {
        (int(a.stage_index), int(a.microbatch_index))
        for a in compat.lowered_order(schedule)[stages[0].group_rank]
        if a is not None and str(getattr(a.computation_type, "value", a.computation_type)) == "F"
    }
    m = 1 + max(j for _, j in chunks) if chunks else None
    extra = chunks - runtime.offloaded
    outputs: list[tuple[int, str]] = []
    undo = [_note_outputs(st, outputs) for st in stages]
    units: dict[int, dict[int, tuple[int, tuple[int, ...]]]] = {}
    undo += [_mark_units(st, store, units) for st in stages]
    calibrated = _calibration_layer(stages) if recompute_modes else None
    held: dict[str, Any] = {}
    if calibrated is not None:
        held, release = layer_inputs(calibrated)
        undo.append(release)
    runtime.offloaded |= extra  # capture every chunk (not offloaded: no OFFLOAD action for these)
    builders = _measure_queues(stages)
    timer = ActionTimer(schedule, sync_cuda=sync_cuda)
    try:
        for _ in range(steps):
            if distributed:
                dist.barrier(group=group)
            store.last_captured.clear()
            step()
    finally:
        timer.detach()
        runtime.offloaded -= extra
        for builder in builders.values():
            builder.measure = False
        for fn in reversed(undo):
            fn()
    recompute: dict[str, Any] | None = None
    recompute_error = None
    if recompute_modes and "args" not in held:
        recompute_error = "no decoder layer ran on this rank"
    elif recompute_modes:
        try:
            recompute = calibrate_recompute(
                calibrated, held["args"], held["kwargs"], modes=recompute_modes, autocast=held["autocast"]
            ).to_dict()
        except ValueError as error:
            recompute_error = str(error)
        held.clear()
    local = {
        "recompute": recompute,
        "recompute_error": recompute_error,
        "events": [(e.action, e.end - e.start) for e in timer.events],
        "bytes": [(int(s), int(j), int(b)) for (s, j), b in store.last_captured.items()],
        "comm": None,
        "layers": {int(st.stage_index): _layer_count(st) for st in stages},
        "units": {s: [found[i] for i in sorted(found)] for s, found in units.items()},
        "queued": {s: int(builder.queued) for s, builder in builders.items()},
    }
    rank = dist.get_rank(group) if distributed else 0
    if comm is None and distributed:
        numel, dtype = outputs[0] if outputs else (1, "float32")
        seconds = _p2p_seconds(numel, getattr(torch, dtype), store.device, group)
        local["comm"] = seconds if rank == 0 else None
    elif comm is not None:
        local["comm"] = float(comm)
    parts = [local]
    if distributed:
        parts = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, local, group=group)
    return _summarize(
        parts,
        num_ranks=d,
        num_microbatches=m,
        steps=steps,
        copies_overlap=store.device.type == "cuda",
        device=str(store.device),
        unit_shares=unit_shares,
    )


def predicted_measurement(
    model: Any,
    *,
    pp: int,
    seq_len: int,
    num_microbatches: int,
    machine: Any = "H100",
    microbatch_size: int = 1,
    units: bool = True,
    layers_per_stage: Sequence[int] | None = None,
    recompute: str = "none",
    deferred_w: bool = True,
) -> Measurement:
    """The `Measurement` a probe would return for ``model`` on ``machine`` as the planner predicts it:
    pass times from FLOPs, saved bytes per stage (V placement, 2 stages per rank), one copy per layer at
    the host link's rate, and (``units``) each layer's and sub-layer unit's bytes with the units' FLOP
    shares. Why: `choose` judged on a GPU-sized model without a GPU (tests, benchmarks, what-ifs, and
    ``--check`` of ``schedule: auto``). ``layers_per_stage``: the split the probe pipeline is built with
    (default: the planner's balanced one), so the figures the pick carries match the stages that run it;
    ``recompute``: the plan the probe runs with (``train.activation_checkpointing`` when it is set);
    ``deferred_w``: the split its stages run (``pipeline.deferred_w``)."""
    from pp_offload.plan.handoff import planner_setup

    setup = planner_setup(
        model,
        schedule="ScheduleVHalf",
        pp=pp,
        seq_len=seq_len,
        microbatch_size=microbatch_size,
        num_microbatches=num_microbatches,
        machine=machine,
        layers_per_stage=layers_per_stage,
        recompute=recompute,
        deferred_w=deferred_w,
    )
    stages = tuple(
        StageMeasurement(
            F=st.times.F,
            I=st.times.I,
            W=st.times.W,
            saved_bytes=int(st.activation.saved),
            queued_bytes=st.activation.queued,
            offload=setup.layer_copy * st.layers,
            reload=setup.layer_copy * st.layers,
            layers=st.layers,
            layer_bytes=tuple(setup.layers_bytes[s]) if units else (),
            units=tuple(setup.units_bytes[s]) if units else (),
        )
        for s, st in enumerate(setup.stages)
    )
    shares = unit_shares_for(model, seq_len=seq_len) if units else None
    name = machine if isinstance(machine, str) else getattr(machine, "name", "machine")
    return Measurement(pp, stages, device=f"planner: {name}", unit_shares=shares, deferred_w=deferred_w)


def unit_shares_for(model: Any, *, seq_len: int) -> tuple[float, float] | None:
    """``measure_step``'s ``unit_shares`` for ``model`` (anything `pp_offload.plan.model.model_spec`
    reads: an HF config, a spec): the planner's FLOP shares of a layer's attention half and rest
    (`pp_offload.plan.costs.layer_unit_shares`); None when the planner does not model it."""
    from pp_offload.plan.costs import layer_unit_shares
    from pp_offload.plan.model import model_spec

    try:
        return layer_unit_shares(model_spec(model), seq_len=seq_len)
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


def _mark_units(
    stage: Any, store: Any, found: dict[int, dict[int, tuple[int, tuple[int, ...]]]]
) -> Callable[[], None]:
    """Hook the stage's layers (and their attention submodules) as budget offload's sub-layer units
    (`stage_units`) to note, per layer, (its bytes as one unit, its units' bytes) from the running chunk
    capture's marks; the first chunk's figures are kept (every microbatch saves the same). Returns the
    undo."""
    from pp_offload.runtime.offload import hook_unit_boundaries, stage_units

    try:
        layers = stage_units(stage, "sublayer")
    except ValueError:
        return lambda: None
    index = int(stage.stage_index)
    marks: dict[int, list[int]] = {}

    def mark(layer: int, where: str) -> None:
        key = store.capturing()
        if key is None or key[0] != index or layer in found.get(index, {}):
            return
        if where == "start":
            marks[layer] = [store.recorded(key)]
            return
        if layer not in marks:
            return
        marks[layer].append(store.recorded(key))
        if where == "end":
            points = marks.pop(layer)
            whole = store.recorded_bytes(key, points[0], points[-1])
            parts = tuple(store.recorded_bytes(key, a, b) for a, b in zip(points, points[1:], strict=False))
            found.setdefault(index, {})[layer] = (whole, parts)

    handles = hook_unit_boundaries(
        layers,
        start=lambda layer, unit: mark(layer, "start"),
        split=lambda layer, unit: mark(layer, "split"),
        end=lambda layer, unit: mark(layer, "end"),
    )

    def undo() -> None:
        for handle in handles:
            handle.remove()

    return undo


def _calibration_layer(stages: Sequence[Any]) -> Any:
    """The decoder layer this rank times recompute on: its first stage's (in stage order) first layer;
    None when its stages hold none."""
    from pp_offload.runtime.offload import stage_layers

    for stage in sorted(stages, key=lambda st: int(st.stage_index)):
        try:
            layers = stage_layers(stage)
        except ValueError:
            continue
        if layers:
            return layers[0]
    return None


def _measure_queues(stages: Sequence[Any]) -> dict[int, Any]:
    """Turn on the queue measurement of every stage that defers its weight gradients
    (`pp_offload.runtime.deferred_w`); stage index -> its ``dw_builder``."""
    from pp_offload.runtime.deferred_w import all_deferring

    builders = {}
    for stage in stages:
        if all_deferring([stage]):
            builder = stage.dw_builder
            builder.measure, builder.queued = True, 0
            builders[int(stage.stage_index)] = builder
    return builders


def _layer_count(stage: Any) -> int:
    """The stage's decoder layers as budget offload finds them; 0 when it finds none."""
    from pp_offload.runtime.offload import stage_layers

    try:
        return len(stage_layers(stage))
    except ValueError:
        return 0


def _note_outputs(stage: Any, outputs: list[tuple[int, str]]) -> Callable[[], None]:
    """Wrap the stage's ``forward_one_chunk`` to note its output's size (for the p2p ping-pong)."""
    import torch

    original = vars(stage).get("forward_one_chunk")
    method = stage.forward_one_chunk

    def noted(*args: Any, **kwargs: Any) -> Any:
        out = method(*args, **kwargs)
        if not outputs:
            first = next((t for t in _tensors(out) if isinstance(t, torch.Tensor)), None)
            if first is not None:
                outputs.append((first.numel(), str(first.dtype).removeprefix("torch.")))
        return out

    stage.forward_one_chunk = noted

    def undo() -> None:
        if original is None:
            vars(stage).pop("forward_one_chunk", None)
        else:
            stage.forward_one_chunk = original

    return undo


def _tensors(obj: Any) -> Iterable[Any]:
    if isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)
    else:
        yield obj


def _p2p_seconds(numel: int, dtype: Any, device: Any, group: Any) -> float:
    """Median one-way time of a ``numel`` tensor between the group's ranks 0 and 1 (round trip / 2);
    other ranks return at once. Blocking send/recv, like the pipeline's transfers seen by the receiver."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank(group)
    if rank > 1:
        return 0.0
    peer = 1 - rank
    peer_global = dist.get_global_rank(group, peer) if group is not None else peer
    buf = torch.zeros(max(1, numel), dtype=dtype, device=device)
    trips = []
    for _ in range(_P2P_ROUNDS):
        start = time.perf_counter()
        if rank == 0:
            dist.send(buf, peer_global, group=group)
            dist.recv(buf, peer_global, group=group)
        else:
            dist.recv(buf, peer_global, group=group)
            dist.send(buf, peer_global, group=group)
        trips.append(time.perf_counter() - start)
    return statistics.median(trips) / 2.0


def _summarize(
    parts: list[dict[str, Any]],
    *,
    num_ranks: int,
    num_microbatches: int | None,
    steps: int,
    copies_overlap: bool,
    device: str,
    unit_shares: tuple[float, float] | None = None,
) -> Measurement:
    """Every rank's raw events and bytes -> per-stage medians (deterministic: same input on every rank)."""
    from pp_offload.runtime.timing import parse_action

    n = 2 * num_ranks
    samples: dict[tuple[int, str], list[float]] = {}
    for part in parts:
        for action, seconds in part["events"]:
            parsed = parse_action(action)
            if parsed is not None and parsed[0] < n:
                samples.setdefault((parsed[0], parsed[1]), []).append(seconds)
    saved = [0] * n
    for part in parts:
        for s, _, b in part["bytes"]:
            if s < n:
                saved[s] = max(saved[s], b)
    comm = next((p["comm"] for p in parts if p["comm"] is not None), 0.0)
    layers = [0] * n
    for part in parts:
        for s, count in part.get("layers", {}).items():
            if int(s) < n:
                layers[int(s)] = int(count)
    queued: list[int | None] = [None] * n
    for part in parts:
        for s, b in part.get("queued", {}).items():
            if int(s) < n:
                queued[int(s)] = max(queued[int(s)] or 0, int(b))
    per_layer: list[list[Any]] = [[] for _ in range(n)]
    for part in parts:
        for s, found in part.get("units", {}).items():
            if int(s) < n and len(found) == layers[int(s)]:
                per_layer[int(s)] = found

    def med(s: int, kind: str) -> float | None:
        values = samples.get((s, kind))
        return statistics.median(values) if values else None

    missing = [s for s in range(n) if med(s, "F") is None]
    if missing:
        raise ValueError(f"the probe step ran no forward of stage(s) {missing}; was step() a schedule.step?")
    fiw: list[list[float]] = []
    whole = set()  # stages that ran full backwards (B) only: split by the measured ratio below
    for s in range(n):
        i, w, b = med(s, "I"), med(s, "W"), med(s, "B")
        if i is None and w is None:
            i, w = 0.0, b or 0.0
            whole.add(s)
        fiw.append([med(s, "F"), i or 0.0, w or 0.0])
    ratios = [fiw[s][1] / (fiw[s][1] + fiw[s][2]) for s in range(1, n) if s not in whole and fiw[s][1] > 0]
    ratio = statistics.median(ratios) if ratios else 0.5
    for s in whole - {0}:
        total = fiw[s][2]
        fiw[s][1], fiw[s][2] = total * ratio, total * (1.0 - ratio)
    first_stage = "measured"
    if fiw[0][1] < 0.05 * fiw[0][2] or med(0, "I") is None:
        # torch skipped stage 0's I and ran its whole backward at W: split the total like the other stages
        total = fiw[0][1] + fiw[0][2]
        fiw[0][1], fiw[0][2] = total * ratio, total * (1.0 - ratio)
        first_stage = f"split from its whole backward at W in the other stages' I:W ({ratio:.2f} I)"
    copied = [
        (saved[s], t) for s in range(n) for kind in ("OFFLOAD", "RELOAD") for t in samples.get((s, kind), [])
    ]
    rates = [b / t for b, t in copied if b > 0 and t > 0]
    rate = statistics.median(rates) if rates else None
    stages = []
    for s in range(n):
        off, rel = med(s, "OFFLOAD"), med(s, "RELOAD")
        estimated = off is None or rel is None
        if estimated:
            guess = saved[s] / rate if rate else 0.0
            off = guess if off is None else off
            rel = guess if rel is None else rel
        f, i, w = fiw[s]
        stages.append(
            StageMeasurement(
                F=f,
                I=i,
                W=w,
                saved_bytes=saved[s],
                queued_bytes=queued[s],
                offload=off,
                reload=rel,
                copies_estimated=estimated,
                layers=layers[s],
                layer_bytes=tuple(int(whole) for whole, _ in per_layer[s]),
                units=tuple(tuple(int(b) for b in parts) for _, parts in per_layer[s]),
            )
        )
    notes = []
    if rate is None:
        notes.append("no chunk was offloaded in the probe: copy times unknown (0)")
    errors = sorted({p["recompute_error"] for p in parts if p.get("recompute_error")})
    notes += [f"recompute costs not measured: {e}" for e in errors]
    calibrations = [RecomputeCalibration.from_dict(p["recompute"]) for p in parts if p.get("recompute")]
    return Measurement(
        num_ranks=num_ranks,
        stages=tuple(stages),
        comm=float(comm),
        copies_overlap=copies_overlap,
        num_microbatches=num_microbatches,
        steps=steps,
        device=device,
        first_stage=first_stage,
        notes=tuple(notes),
        unit_shares=unit_shares,
        recompute_costs=RecomputeCalibration.combine(calibrations) if not errors else None,
        deferred_w=any(q is not None for q in queued),  # only deferring stages measure a queue
    )
