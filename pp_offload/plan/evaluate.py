"""One schedule under one offload policy, for one model and machine: predicted step time and the memory of
every rank.

The steps, for each schedule:

1. stages: the layers are split over the schedule's stages (`pp_offload.plan.split.balanced_split`), and
   each stage gets its pass times, its activation bytes per microbatch, and its parameters;
2. costs: the order generators take one set of per-chunk costs (every rank holds 2 chunk units of each
   microbatch, whatever its stages), so the scalar F, I and W are the busiest rank's time per microbatch
   (per kind) over 2: the busiest rank sets the pace of the steady phase. The simulator times each pass
   with its own stage's costs (``Costs.stages``: each stage's times over its chunk units,
   `stage_pass_costs`), so fill, drain and an imbalanced first or last stage are not averaged away.
   ``comm`` is one hidden-state transfer, ``transfer`` the copy of the largest stage's saved activations
   (per chunk unit);
3. orders: the compute order is built with the scalar costs (`pp_offload.plan.orders`), as the schedule
   classes build it at run time, and rewritten as torch executes it (stage 0's backward runs whole at W:
   `pp_offload.sim.as_executed_by_torch`); offload actions are placed by
   `pp_offload.order.offload.plan_offload` with the per-stage costs (``enable_offload`` places the same
   when the schedule's ``costs`` carry these ``stages``), and `pp_offload.sim.simulate`
   replays the result with those same costs, so a budget's slowdown limit holds for the predicted step;
4. memory: the simulator's timeline is replayed once more with each stage's real bytes: a chunk's saved
   tensors from the start of its F to the end of its I (B), its output and the loss's tensors until its input-
   gradient pass ends, then its deferred-W queue (`pp_offload.plan.memory.queued_bytes`) until its W ends
   (under torch's retained-graph split, ``deferred_w=False``: the saved tensors until W), offloaded tensors
   off the device from the end of their OFFLOAD to the start of their RELOAD (budget offload: each moved
   layer's bytes from the end of its own copy out to the start of its own copy back,
   `pp_offload.sim.LayeredChunk`; one layer's copy takes its bytes over the host bandwidth). The peak of that
   curve is the rank's activation memory (the chunk-unit peak of the same replay is the simulator's own);
5. step time at the ``m`` asked for (`simulation_sizes`): the orders are built for ``m`` microbatches
   whenever that fits the time budget (`EXACT_BUDGET_S` per order, priced per compute action by
   `SECONDS_PER_ACTION`, measured); the step time, bubble and peaks are then those of the exact replay.
   Above it (very large ``m`` x pp), orders are built at three sizes a whole number of the schedules'
   steady-phase periods apart (`steady_period`: torch's interleaved schedules run rounds of pp
   microbatches, the others repeat per microbatch or per pair), each congruent to ``m`` modulo that
   period, and the step time is extrapolated from the last size with the slope of the last interval only
   where the steady phase is shown to be reached (`combine`): equal slopes over the two intervals, no
   lower than the busiest rank's compute over an interval (a lower slope means a warm-up bubble is still
   being filled), equal peaks at the last two sizes, and an extrapolated step no shorter than the busiest
   rank's compute at ``m`` (the compute lower bound; compute per microbatch is the same at every size, so
   the busy time scales exactly). Where a check fails, `predict` builds the order for ``m`` itself. The
   bubble is then never negative: `combine` raises AssertionError, rather than clamp, if it ever were.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any

from pp_offload.order.actions import Costs, F
from pp_offload.order.offload_inputs import OffloadInputs, StageBytes
from pp_offload.order.offload_inputs import activation_peaks as byte_peaks
from pp_offload.plan.costs import (
    PassTimes,
    layer_unit_shares,
    p2p_seconds,
    split_extras,
    stage_times,
    transfer_seconds,
)
from pp_offload.plan.machines import Machine
from pp_offload.plan.memory import (
    ChunkActivation,
    Precision,
    StateBytes,
    chunk_activation,
    layer_activation_bytes,
    layers_unit_bytes,
    recv_buffer_bytes,
    stage_params,
    state_bytes,
    transient_bytes,
)
from pp_offload.plan.model import ModelSpec
from pp_offload.plan.orders import OURS, Layout, build_order, canonical_schedule, layout, microbatch_problem
from pp_offload.plan.split import balanced_split
from pp_offload.recompute_plan import parse_recompute

__all__ = [
    "NotSteadyError",
    "PolicyResult",
    "Setup",
    "StageProfile",
    "evaluate_orders",
    "offload_plan",
    "predict",
    "setup_schedule",
    "simulation_sizes",
]

EXACT_BUDGET_S = 10.0
"""Seconds the orders of one schedule may take to build before the planner extrapolates instead
(`simulation_sizes`)."""
SECONDS_PER_ACTION = {"adaptive": 3.2e-3, "ours": 8e-4, "torch": 1e-4}
"""Measured cost of building one order, per compute action (``6 m pp``: F, I and W of two chunks per rank
and microbatch), on one core of the 2-core CI machine shared with other jobs, the order search's disk
cache off (`bench/bench_plan_exact.py`, docs/planner.md): V-Adaptive's search (3.1 ms per action at pp 8,
m 128), V-Min, V-Half and V-ZB (the ``full`` search at pp <= 8: V-Min 3.2 s at pp 8, m 64, 0.5-1 ms per
action), torch's orders built by its classes with mock stages (50-100 us per action at pp 8, m 128); each
rounded up. A replay costs about 5 us per action and is not the limit. So with the 10 s budget the orders
of all m microbatches are built up to ``6 m pp`` = 3,125 actions for V-Adaptive (pp 8: m <= 65), 12,500 for
our other schedules (pp 8: m <= 260; pp 16: m <= 130) and 100,000 for torch's (pp 16: m <= 1041)."""
_STEADY_RTOL = 1e-9


@dataclass(frozen=True)
class StageProfile:
    layers: int
    first: bool
    last: bool
    activation: ChunkActivation
    times: PassTimes
    params: int


@dataclass
class Setup:
    """Everything about one schedule that does not depend on the order."""

    schedule: str
    layout: Layout
    layers: list[int]
    stages: list[StageProfile]
    costs: Costs
    state: list[StateBytes]
    recv: list[int]
    transient: list[int]
    reserve: int
    memory_cap: float | None = None  # adaptive: chunk units per rank
    memory_limit: float | None = None  # adaptive: fraction of 1F1B's peak
    problem: str | None = None
    recompute: str = "none"  # activation checkpointing of the decoder layers (pp_offload.plan.memory)
    layer_bytes: int = (
        0  # one decoder layer's saved bytes per microbatch (what budget offload moves per layer)
    )
    layer_copy: float = 0.0  # seconds to copy one layer's saved bytes one way
    layers_bytes: list[list[int]] = field(default_factory=list)
    """Per stage, each decoder layer's saved bytes per microbatch, first layer first
    (`pp_offload.plan.memory.layers_activation_bytes`): what a moved layer carries."""
    units_bytes: list[list[tuple[int, ...]]] = field(default_factory=list)
    """Per stage and layer, the bytes of each of the layer's sub-layer offload units
    (`pp_offload.plan.memory.layers_unit_bytes`): what ``granularity="sublayer"`` moves per unit."""
    unit_shares: tuple[float, float] = (0.5, 0.5)
    """A split layer's attention and MLP halves' shares of its passes (`pp_offload.plan.costs`)."""
    deferred_w: bool = True
    """How split-backward stages split their backward (`pp_offload.runtime.deferred_w`): deferred weight
    gradients, the runtime's default (orders run as written, stage 0's I a real backward), or torch's
    retained-graph split (``False``: `build_orders` rewrites stage 0's I and W as the whole backward torch
    runs at W, `pp_offload.sim.as_executed_by_torch`)."""

    def moved_layer_bytes(self, stage: int, moved: int, granularity: str = "layer") -> int:
        """Bytes the first ``moved`` layers (or sub-layer units) of ``stage`` carry (budget offload moves
        the earliest first)."""
        if granularity == "sublayer":
            return sum([b for unit in self.units_bytes[stage] for b in unit][:moved])
        if not self.layers_bytes:
            return moved * self.stage_layer_bytes(stage)
        return sum(self.layers_bytes[stage][:moved])

    def stage_layer_bytes(self, stage: int) -> int:
        """Bytes one moved layer of ``stage`` carries: ``layer_bytes``, but never more than the stage's
        saved bytes per layer. Why: with full recompute a layer keeps only its input, and the stage's first
        layer's input is its receive buffer, so its layers save less than ``layer_bytes`` on average."""
        st = self.stages[stage]
        if not st.layers:
            return self.layer_bytes
        return min(self.layer_bytes, st.activation.saved // st.layers)

    def _layer_copy(self, stage: int, unit: float) -> float | tuple[float, ...]:
        """One moved layer's copy time on ``stage`` (``unit``: seconds per byte), one per layer where the
        stage's layers save different bytes (a recompute plan on a share of them), so the replay times
        each copy with its own bytes."""
        sizes = self.layers_bytes[stage] if self.layers_bytes else []
        if len(set(sizes)) > 1:
            return tuple(unit * b for b in sizes)
        return unit * self.stage_layer_bytes(stage)

    def offload_inputs(self, granularity: str = "layer") -> OffloadInputs:
        """The figures offload is placed with on this setup (`pp_offload.order.offload_inputs`): the costs
        with each stage's pass times, layers per stage, one layer's copy time per stage (in proportion to
        `stage_layer_bytes`) and each stage's bytes, so the budget lowers the peak that is reported. Hand it
        to ``enable_offload(..., inputs=...)`` and the runtime places what this setup predicts.
        ``granularity="sublayer"``: the same per sub-layer unit (`units_bytes`, `unit_shares`)."""
        unit = self.layer_copy / self.layer_bytes if self.layer_bytes else 0.0
        if granularity == "sublayer":
            return self._unit_inputs(unit)
        n = len(self.stages)
        return OffloadInputs(
            costs=self.queue_costs(),
            layers=tuple(self.layers),
            layer_copy=tuple(self._layer_copy(s, unit) for s in range(n)),
            stage_bytes=tuple(
                StageBytes(
                    saved=int(st.activation.saved),
                    resident=int(st.activation.resident),
                    layer=int(self.stage_layer_bytes(s)),
                    per_layer=tuple(self.layers_bytes[s]) if self.layers_bytes else None,
                    held_after_input=int(st.activation.held_after_input),
                    queued=st.activation.queued,
                )
                for s, st in enumerate(self.stages)
            ),
        )

    def queue_costs(self) -> Costs:
        """``costs`` with each stage's deferred-W queue (`Costs.queue`), so that offload plans time and count
        the copies between I and W as the queue's (unchanged under torch's split). The unit is the largest
        stage's saved bytes: what ``costs.transfer`` copies and what the simulator's chunk units weigh."""
        if all(st.activation.queued is None for st in self.stages):
            return self.costs
        unit = max(1, max(st.activation.saved for st in self.stages))
        return dataclasses.replace(
            self.costs, queue=tuple((st.activation.queued or 0) / unit for st in self.stages)
        )

    def _unit_inputs(self, unit: float) -> OffloadInputs:
        """`offload_inputs` with sub-layer units: per stage the flat list of units, each unit's copy time
        from its own bytes, and each unit's share of the stage's passes (a layer's share split by
        `unit_shares` where it has two units)."""
        if len(self.units_bytes) != len(self.stages):
            raise ValueError(
                "sub-layer offload units need the planner's per-unit bytes of every stage (a setup built "
                "from a model spec, setup_schedule); this setup has none (measured setups count layers "
                "only): use granularity 'layer'"
            )
        counts, copies, shares, stage_bytes = [], [], [], []
        for s, st in enumerate(self.stages):
            flat = [b for layer in self.units_bytes[s] for b in layer]
            layers = len(self.units_bytes[s])
            split = [self.unit_shares if len(u) == 2 else (1.0,) for u in self.units_bytes[s]]
            counts.append(len(flat))
            copies.append(tuple(unit * b for b in flat))
            shares.append(tuple(x / layers for parts in split for x in parts) if flat else None)
            stage_bytes.append(
                StageBytes(
                    saved=int(st.activation.saved),
                    resident=int(st.activation.resident),
                    layer=max(flat, default=0),
                    per_layer=tuple(flat),
                    held_after_input=int(st.activation.held_after_input),
                    queued=st.activation.queued,
                )
            )
        return OffloadInputs(
            costs=self.queue_costs(),
            layers=tuple(counts),
            layer_copy=tuple(copies),
            stage_bytes=tuple(stage_bytes),
            granularity="sublayer",
            unit_compute=tuple(shares),
        )

    def layered_args(self) -> dict[str, Any]:
        """`plan_offload`'s ``layers``/``layer_copy``/``peaks`` for budget offload on this setup's stages
        (`offload_inputs`)."""
        return self.offload_inputs().plan_kwargs()

    def static(self, rank: int) -> int:
        """Bytes of ``rank`` that do not depend on the order: state, receive buffers, transient, reserve."""
        return self.state[rank].total + self.recv[rank] + self.transient[rank] + self.reserve

    def unit_bytes(self, rank: int) -> int:
        """Largest bytes per chunk unit among the rank's stages: a chunk holds its ``total`` until its I
        ends, then its deferred-W queue (larger with recompute) until its W ends."""
        scale = self.layout.chunks_per_stage
        return max(
            math.ceil(max(act.total, act.queued or 0) / scale)
            for act in (self.stages[s].activation for s in self.layout.stages_of(rank))
        )


def setup_schedule(
    schedule: str,
    *,
    spec: ModelSpec,
    machine: Machine,
    precision: Precision,
    seq_len: int,
    microbatch_size: int,
    num_microbatches: int,
    pp: int,
    dp: int,
    dp_shard: bool,
    virtual_stages: int,
    reserve: int,
    recompute: str = "none",
    layers_per_stage: list[int] | None = None,
    deferred_w: bool = True,
) -> Setup:
    """Stages, costs and static memory of ``schedule`` (module doc, 1-2); ``recompute``: activation
    checkpointing of the decoder layers (`pp_offload.plan.memory.RECOMPUTE`), which shrinks what the stages
    save (and what budget offload moves per layer) and lengthens their I and W passes.
    ``layers_per_stage``: the split a pipeline was built with, instead of the planner's balanced one.
    ``deferred_w``: split-backward stages queue their weight gradients' inputs from I to W (the runtime's
    default, `pp_offload.plan.memory.queued_bytes`) and recompute in I only; ``False`` models torch's
    retained-graph split (saved tensors until W, a recomputation in I and another in W, stage 0's backward
    whole at W): the recipe's ``pipeline.deferred_w``, ``pp-offload plan --split``."""
    lay = layout(schedule, pp, virtual_stages=virtual_stages)
    n = lay.num_stages
    if layers_per_stage is None:
        first_extra, last_extra = split_extras(spec, seq_len=seq_len)
        layers = balanced_split(spec.num_layers, n, first_extra=first_extra, last_extra=last_extra)
    else:
        layers = [int(c) for c in layers_per_stage]
        if len(layers) != n or sum(layers) != spec.num_layers or min(layers) < 0:
            raise ValueError(
                f"layers_per_stage {layers} must have {n} entries >= 0 summing to the model's "
                f"{spec.num_layers} layers"
            )
    stages = []
    for s, count in enumerate(layers):
        first, last = s == 0, s == n - 1
        kw: dict[str, Any] = {
            "microbatch_size": microbatch_size,
            "seq_len": seq_len,
            "recompute": recompute,
            "deferred_w": deferred_w,
        }
        activation = chunk_activation(spec, precision, layers=count, first=first, last=last, **kw)
        stages.append(
            StageProfile(
                layers=count,
                first=first,
                last=last,
                activation=activation,
                times=stage_times(spec, machine, precision, layers=count, first=first, last=last, **kw),
                params=stage_params(spec, layers=count, first=first, last=last),
            )
        )
    scale = lay.chunks_per_stage
    host = max(st.activation.saved for st in stages)
    per_chunk = chunk_pass_times([st.times for st in stages], lay)
    costs = Costs(
        F=per_chunk.F,
        I=per_chunk.I,
        W=per_chunk.W,
        comm=p2p_seconds(spec, machine, precision, microbatch_size=microbatch_size, seq_len=seq_len),
        transfer=transfer_seconds(host, machine) / scale,
        stages=stage_pass_costs([st.times for st in stages], lay, floor=1e-9),
    )
    state, recv, transient = [], [], []
    for rank in range(pp):
        held = [stages[s] for s in lay.stages_of(rank)]
        state.append(
            state_bytes(
                spec, precision, [(st.layers, st.first, st.last) for st in held], dp=dp, dp_shard=dp_shard
            )
        )
        recv.append(
            sum(
                recv_buffer_bytes(
                    spec,
                    precision,
                    first=st.first,
                    last=st.last,
                    microbatch_size=microbatch_size,
                    seq_len=seq_len,
                    num_microbatches=num_microbatches,
                )
                for st in held
            )
        )
        transient.append(
            max(
                transient_bytes(
                    spec,
                    precision,
                    layers=st.layers,
                    last=st.last,
                    microbatch_size=microbatch_size,
                    seq_len=seq_len,
                )
                for st in held
            )
        )
    # one recomputed layer's bytes (a plan on a share of the layers recomputes the earliest, which budget
    # offload moves first): the size of a moved layer's copy
    plan = parse_recompute(recompute)
    per_layer = layer_activation_bytes(
        spec, precision, microbatch_size=microbatch_size, seq_len=seq_len, recompute=plan.mode
    )
    # per stage, each layer's units (attention half, rest) and their sum, each layer's bytes
    kw = {"microbatch_size": microbatch_size, "seq_len": seq_len, "recompute": recompute}
    units_bytes = [
        layers_unit_bytes(spec, precision, layers=count, first=s == 0, **kw) for s, count in enumerate(layers)
    ]
    layers_bytes = [[sum(units) for units in stage] for stage in units_bytes]
    problem = microbatch_problem(schedule, pp, num_microbatches, virtual_stages=virtual_stages)
    empty = [s for s in range(1, n - 1) if layers[s] == 0]
    if problem is None and empty:
        problem = (
            f"{spec.num_layers} layers cannot fill {n} stages ({lay.placement} placement on {pp} ranks): "
            f"stage {empty[0]} would hold no layer"
        )
    return Setup(
        schedule,
        lay,
        layers,
        stages,
        costs,
        state,
        recv,
        transient,
        reserve,
        problem=problem,
        recompute=recompute,
        layer_bytes=per_layer,
        layer_copy=transfer_seconds(per_layer, machine),
        layers_bytes=layers_bytes,
        units_bytes=units_bytes,
        unit_shares=layer_unit_shares(spec, seq_len=seq_len),
        deferred_w=deferred_w,
    )


def chunk_pass_times(times: list[PassTimes], lay: Layout) -> PassTimes:
    """The simulator's per-chunk F, I and W (module doc, 2): per kind, the busiest rank's time per
    microbatch (``times[s]``: stage ``s``'s passes) over the 2 chunk units every rank holds."""

    def per_chunk(kind: str) -> float:
        return max(sum(getattr(times[s], kind) for s in lay.stages_of(r)) for r in range(lay.num_ranks)) / 2.0

    return PassTimes(F=per_chunk("F"), I=per_chunk("I"), W=per_chunk("W"))


def stage_pass_costs(
    times: list[PassTimes], lay: Layout, *, floor: float
) -> tuple[tuple[float, float, float], ...]:
    """``Costs.stages``: per stage, its F, I and W per microbatch over its chunk units (the simulator
    multiplies every pass by ``lay.chunks_per_stage``, so this gives each pass its stage's own time), each
    at least ``floor`` (``Costs`` needs > 0; torch's stage 0 measures ~0 at I and its whole backward at W,
    which `pp_offload.sim.as_executed_by_torch` replays as one B = I + W of that stage)."""
    scale = lay.chunks_per_stage
    out = []
    for t in times:
        f, i, w = (max(getattr(t, k) / scale, floor) for k in ("F", "I", "W"))
        shared = min(t.shared / scale, 0.999 * min(i, w))  # a B recomputes once (PassTimes.shared)
        out.append((f, i, w, shared) if shared > 0 else (f, i, w))
    return tuple(out)


def scalar_costs(costs: Costs) -> Costs:
    """``costs`` without ``stages``: what orders and offload plans are built with (module doc, 3)."""
    return costs if costs.stages is None else dataclasses.replace(costs, stages=None)


def choose_adaptive_limit(setup: Setup, *, limit_bytes: int, num_microbatches: int) -> None:
    """The adaptive schedule's cap: the most chunk units every rank can hold within ``limit_bytes`` next to
    its static memory, between the V floor (2 units) and 1F1B's peak (``2 * min(d, m)``)."""
    d = setup.layout.num_ranks
    reference = 2 * min(d, num_microbatches)
    room = min((limit_bytes - setup.static(r)) // max(1, setup.unit_bytes(r)) for r in range(d))
    cap = int(min(reference, max(2, room)))
    setup.memory_cap = float(cap)
    setup.memory_limit = cap / reference


def steady_period(num_ranks: int) -> int:
    """Microbatches per steady-phase period of every schedule of the catalog: pp (torch's interleaved
    schedules run rounds of pp microbatches; the V orders, 1F1B, ZBV and DualPipeV repeat every microbatch
    or pair of microbatches), doubled for an odd pp so that pairs divide it too."""
    return num_ranks if num_ranks % 2 == 0 else 2 * num_ranks


def exact_limit(num_ranks: int, schedule: str | None = None) -> int:
    """The most microbatches whose order fits `EXACT_BUDGET_S` (`SECONDS_PER_ACTION`); ``schedule`` None:
    the most expensive kind."""
    if schedule is None or canonical_schedule(schedule) == "ScheduleVAdaptive":
        kind = "adaptive"
    else:
        kind = "ours" if is_ours(canonical_schedule(schedule)) else "torch"
    return max(1, int(EXACT_BUDGET_S / SECONDS_PER_ACTION[kind] + 1e-6) // (6 * num_ranks))


def simulation_sizes(num_ranks: int, num_microbatches: int, schedule: str | None = None) -> list[int]:
    """The microbatch counts whose orders are built (module doc, 5): ``[m]`` when its order fits the time
    budget (`exact_limit`); else three sizes a whole `steady_period` apart, each congruent to ``m`` modulo
    it, together within the budget where they can be, and the smallest at least 2 pp (every schedule of the
    catalog is past its warm-up at 4 pp: measured at pp 4-16, torch's Interleaved1F1B reaches its steady
    slope at 4 pp, DualPipeV and V-Half at 3 pp). ``[m]`` too where three such sizes would cost as much as
    ``m`` itself, and for torch's interleaved schedules when ``m`` is not a multiple of pp: their rounds then
    hold more than pp microbatches, a structure the smaller sizes lack."""
    d, m = num_ranks, num_microbatches
    limit = exact_limit(d, schedule)
    if m <= limit:
        return [m]
    if schedule is not None and layout(schedule, d).placement == "loop" and m % d:
        return [m]
    period = steady_period(d)
    last = (limit + 3 * period) // 3  # three sizes last - 2 period .. last within the budget
    last -= (last - m) % period  # congruent to m
    low = 2 * d + 2 * period
    if last < low:
        last = low + (m - low) % period
    sizes = [last - 2 * period, last - period, last]
    return [m] if sum(sizes) >= m else sizes


@dataclass
class PolicyResult:
    """One (order size, offload policy): simulated numbers, memory per rank."""

    size: int
    makespan: float
    busy: float  # busiest rank's compute time
    peak_units: list[float]
    activation: list[int]  # peak activation bytes per rank
    reload_wait: float
    offloaded: int  # chunks offloaded (budget: chunks with at least one layer moved)
    chunks: int  # chunks in the order
    offloaded_per_rank: list[int] = field(default_factory=list)
    moved_layers_per_rank: list[int] = field(default_factory=list)  # budget: layer copies out per rank
    moved_bytes_per_rank: list[int] = field(default_factory=list)  # budget: bytes those copies carry
    moved_bytes: int = 0  # bytes copied out (and back) over the step
    saved_bytes: int = 0  # bytes all chunks of the step save
    pulled_w: int = 0  # close_w: W passes the offload-aware order moved right after their I
    plan: Any = field(default=None, repr=False, compare=False)
    """The offload plan replayed (`pp_offload.order.offload.OffloadPlan`: its sim and layered chunks), None
    without offload: what moved when, for a caller that asks where a peak's bytes were."""


@dataclass
class OrderSet:
    """Orders of one schedule at the simulated sizes, and what building them cost. ``search`` and
    ``virtual_stages`` are what they were built with, so `predict` can build the exact order later."""

    sizes: list[int]
    orders: dict[int, Any] = field(default_factory=dict)
    build_seconds: float = 0.0
    error: str | None = None
    search: str = "auto"
    virtual_stages: int = 2
    exact: OrderSet | None = field(default=None, repr=False)
    """The order for the step's own microbatch count, built when an extrapolation failed its check."""

    def exact_for(self, setup: Setup, num_microbatches: int) -> OrderSet:
        """The order at ``num_microbatches`` itself (built once, kept in ``exact``)."""
        if self.sizes == [num_microbatches]:
            return self
        if self.exact is None:
            self.exact = build_orders(
                setup, [num_microbatches], search=self.search, virtual_stages=self.virtual_stages
            )
            self.build_seconds += self.exact.build_seconds
        return self.exact


def build_orders(setup: Setup, sizes: list[int], *, search: str, virtual_stages: int) -> OrderSet:
    from pp_offload.sim import as_executed_by_torch

    out = OrderSet(sizes, search=search, virtual_stages=virtual_stages)
    start = time.perf_counter()
    try:
        for size in sizes:
            order = build_order(
                setup.schedule,
                setup.layout.num_ranks,
                size,
                scalar_costs(setup.costs),
                search=search,
                memory_cap=setup.memory_cap,
                virtual_stages=virtual_stages,
            )
            # as the runtime executes it: under deferred W (`pp_offload.runtime.deferred_w`) stage 0's I is a
            # real backward and the order runs as written; torch's split runs stage 0's backward whole at W
            out.orders[size] = order if setup.deferred_w else as_executed_by_torch(order)
    except Exception as e:  # a schedule that cannot be built here is reported, not fatal
        out.error = f"{type(e).__name__}: {e}"
    out.build_seconds = time.perf_counter() - start
    return out


def evaluate_orders(
    setup: Setup, orders: OrderSet, policy: Any, *, synchronous_copies: bool = False
) -> list[PolicyResult]:
    """Replay every size's order under ``policy`` (anything `resolve_offload` accepts).

    ``synchronous_copies``: copies run on the compute thread and end where their action stands (CPU
    stores), not on copy lanes: memory is replayed with instant copies (an OFFLOAD frees its chunk right
    after the preceding pass), while the offload plan still uses ``setup.costs.transfer``; the copies' time
    is then the caller's to add.
    """
    from pp_offload.order.offload import resolve_offload
    from pp_offload.sim import simulate

    resolved = resolve_offload(policy)
    results = []
    for size in orders.sizes:
        order = orders.orders[size]
        layered: dict = {}
        pulled = 0
        if resolved.enabled:
            planned = offload_plan(setup, order, resolved)
            layered = planned.layered
            sim = planned.sim
            per_rank = [len(planned.offloaded.get(r, ())) for r in sorted(sim.timeline)]
            pulled = sum(len(keys) for keys in planned.pulled.values())
        else:
            sim = simulate(order, setup.costs)
            per_rank = [0] * len(sim.timeline)
        memory_sim = sim
        if synchronous_copies and resolved.enabled:
            instant = dataclasses.replace(setup.costs, transfer=0.0)
            memory_sim = planned.replay(instant, layer_copy=0.0)
        offloaded = sum(per_rank)
        chunks = sum(1 for tl in sim.timeline.values() for (_, kind, _), _, _ in tl if kind == F)
        saved = sum(
            setup.stages[stage].activation.saved
            for tl in sim.timeline.values()
            for (stage, kind, _), _, _ in tl
            if kind == F
        )
        if layered:
            moved = sum(
                setup.moved_layer_bytes(key[0], c.moved, resolved.granularity) for key, c in layered.items()
            )
        elif resolved.enabled:
            moved = sum(
                setup.stages[s].activation.saved for r in planned.offloaded for s, _ in planned.offloaded[r]
            )
        else:
            moved = 0
        results.append(
            PolicyResult(
                size=size,
                makespan=sim.makespan,
                busy=max(sim.busy.values()),
                peak_units=[sim.peak_memory[r] for r in sorted(sim.peak_memory)],
                activation=activation_peaks(
                    memory_sim, setup, layered=layered, granularity=resolved.granularity
                ),
                reload_wait=sim.total_reload_wait,
                offloaded=offloaded,
                chunks=chunks,
                offloaded_per_rank=per_rank,
                moved_layers_per_rank=[
                    sum(layered[k].moved for k in planned.offloaded.get(r, ()) if k in layered)
                    for r in sorted(sim.timeline)
                ]
                if layered
                else [],
                moved_bytes_per_rank=[
                    sum(
                        setup.moved_layer_bytes(k[0], layered[k].moved, resolved.granularity)
                        for k in planned.offloaded.get(r, ())
                        if k in layered
                    )
                    for r in sorted(sim.timeline)
                ]
                if layered
                else [],
                moved_bytes=moved,
                saved_bytes=saved,
                pulled_w=pulled,
                plan=planned if resolved.enabled else None,
            )
        )
    return results


def offload_plan(setup: Setup, order: Any, policy: Any) -> Any:
    """The offload plan of ``order`` (as torch executes it: `build_orders`) under ``policy`` on ``setup``,
    as the planner predicts it and as ``enable_offload(..., inputs=setup.offload_inputs())`` places it.

    Placed with the per-stage costs it is timed with: a budget's slowdown limit then holds for the step it
    predicts (placed with scalar costs and timed per stage, it overshot its 3%)."""
    from pp_offload.order.offload import plan_offload, resolve_offload

    inputs = setup.offload_inputs(resolve_offload(policy).granularity)
    return plan_offload(order, inputs.costs, policy, **inputs.plan_kwargs())


def activation_peaks(sim: Any, setup: Setup, *, layered: Any = None, granularity: str = "layer") -> list[int]:
    """Per rank, the peak of the activation bytes over the simulated timeline (see the module doc, 4).
    ``layered``: the plan's layer-by-layer chunks (each moved layer, or sub-layer unit, carries its own
    bytes, `Setup.layers_bytes` / `Setup.units_bytes`)."""
    stage_bytes = setup.offload_inputs(granularity).stage_bytes
    assert stage_bytes is not None  # a setup always knows its stages' bytes  # noqa: S101
    return byte_peaks(sim, stage_bytes, layered)


class NotSteadyError(ValueError):
    """The sizes simulated do not show the steady phase (`combine`): predict from the exact order."""


def combine(results: list[PolicyResult], num_microbatches: int) -> dict[str, Any]:
    """Step time, bubble and peaks at ``num_microbatches`` from one exact size, or extrapolated from three
    sizes a whole period apart (module doc, 5). Raises `NotSteadyError` when the three do not show the
    steady phase: unequal slopes over the two intervals, a peak still growing, or a step shorter than the
    busiest rank's compute at ``num_microbatches`` (`predict` then replays the exact order)."""
    last = results[-1]
    if len(results) == 1:
        if last.size != num_microbatches:
            raise ValueError(f"one result at {last.size} microbatches cannot predict {num_microbatches}")
        makespan, busy = last.makespan, last.busy
    else:
        makespan, busy = _extrapolate(results, num_microbatches)
    bubble = 1.0 - busy / makespan if makespan > 0 else 0.0
    if bubble < -_STEADY_RTOL:
        raise AssertionError(
            f"negative bubble {bubble:.3g}: makespan {makespan!r} below the busiest rank's compute {busy!r} "
            f"at {num_microbatches} microbatches (sizes {[r.size for r in results]})"
        )
    peak_units = [max(r.peak_units[k] for r in results) for k in range(len(last.peak_units))]
    activation = [max(r.activation[k] for r in results) for k in range(len(last.activation))]
    return {
        "makespan": makespan,
        "bubble": max(bubble, 0.0),  # only float noise below 0 reaches here
        "peak_units": peak_units,
        "activation": activation,
        "reload_wait": last.reload_wait,
        "offloaded_share": last.offloaded / last.chunks if last.chunks else 0.0,
        "moved_share": last.moved_bytes / last.saved_bytes if last.saved_bytes else 0.0,
        "pulled_w": last.pulled_w,
        "extrapolated": len(results) > 1,
    }


def _extrapolate(results: list[PolicyResult], m: int) -> tuple[float, float]:
    """(makespan, busiest rank's compute) at ``m`` from the last size and the slope of the last interval,
    after the steady-phase checks (`combine`)."""
    if len(results) != 3:
        raise ValueError(f"extrapolation needs three sizes, got {[r.size for r in results]}")
    a, b, c = results
    if b.size - a.size != c.size - b.size or c.size >= m:
        raise ValueError(f"sizes {[r.size for r in results]} are not evenly spaced below {m}")
    step = c.size - b.size
    first, second = b.makespan - a.makespan, c.makespan - b.makespan
    if abs(second - first) > _STEADY_RTOL * c.makespan:
        raise NotSteadyError(f"slopes differ over {a.size}-{b.size}-{c.size}: {first!r} vs {second!r}")
    if second < (c.busy - b.busy) * (1.0 - _STEADY_RTOL):
        # the busiest rank still idles less with every microbatch: its warm-up bubble is being filled, which
        # cannot go on (measured: torch's Interleaved1F1B at pp 4 has equal slopes over 8-12-16 microbatches
        # that are 1.3% below its steady slope)
        raise NotSteadyError(
            f"slope {second!r} over {b.size}-{c.size} below the busiest rank's compute per interval "
            f"{c.busy - b.busy!r}"
        )
    if b.peak_units != c.peak_units or b.activation != c.activation:
        raise NotSteadyError(f"peaks still change between {b.size} and {c.size} microbatches")
    makespan = c.makespan + (m - c.size) / step * second
    busy = c.busy * m / c.size  # every microbatch costs each rank the same compute
    if makespan < busy * (1.0 - _STEADY_RTOL):
        raise NotSteadyError(f"extrapolated step {makespan!r} below the compute lower bound {busy!r}")
    return makespan, busy


def predict(
    setup: Setup, orders: OrderSet, policy: Any, num_microbatches: int, *, synchronous_copies: bool = False
) -> tuple[dict[str, Any], list[PolicyResult]]:
    """`combine` of `evaluate_orders` at ``num_microbatches``, from the exact order when the simulated
    sizes do not show the steady phase; returns the summary and the results it came from."""
    results = evaluate_orders(setup, orders, policy, synchronous_copies=synchronous_copies)
    try:
        return combine(results, num_microbatches), results
    except NotSteadyError:
        exact = orders.exact_for(setup, num_microbatches)
        if exact.error is not None:
            raise RuntimeError(exact.error) from None
        results = evaluate_orders(setup, exact, policy, synchronous_copies=synchronous_copies)
        return combine(results, num_microbatches), results


def is_ours(schedule: str) -> bool:
    return schedule in OURS
