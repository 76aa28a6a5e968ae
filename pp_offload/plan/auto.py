"""``schedule: auto``: pick the pipeline schedule and offload policy from a probe step's measured costs.

    from pp_offload.plan.auto import PROBE_OFFLOAD, PROBE_SCHEDULE, choose, measure_step
    probe = ScheduleVMin(stages, m, loss_fn=loss_fn, offload=PROBE_OFFLOAD)     # PROBE_SCHEDULE
    measured = measure_step(probe, lambda: probe.step(...), group=pp_group)   # same on every rank
    decision = choose(measured, num_microbatches=m, memory_limit=0.5)        # pure, deterministic
    schedule = <decision.schedule>(stages, m, costs=decision.costs, offload=decision.offload, ...)

Why a probe and not the planner's formulas: the decision is only as good as its costs, and one step on the
real model and hardware measures them (pass times per stage, the bytes autograd saves, the copy time of a
chunk to host) better than any preset. `choose` is then pure Python on the `Measurement`, so every rank
reaches the same decision (and the recipe can still broadcast rank 0's `AutoDecision.to_dict`).

How each candidate (schedule x offload policy) is judged, with the planner's machinery
(`pp_offload.plan.evaluate`): every candidate holds 2 stages per rank, so stage ``s`` has the same layers
under V and loop placement and its measured costs apply as they are. Orders and offload plans are built
with scalar per-chunk F/I/W, the busiest rank's measured time per microbatch per kind over 2 (per
placement), as the schedule classes build them from `costs_for`; ``comm`` is the measured p2p time,
``transfer`` the slowest stage's measured copy time. The simulator then times every pass with its own
stage's measured F/I/W (``Costs.stages``), so an imbalanced first or last stage (embedding, LM head and
loss) lengthens the prediction as it lengthens the step. Orders are rewritten as torch executes them
(stage 0's backward whole at W, timed as stage 0's measured I + W); offload plans come from
`pp_offload.order.offload.plan_offload`; the step time is the simulated makespan and the memory the peak of
each rank's device-resident saved bytes in a replay with each stage's measured bytes. Where copies are
synchronous (CPU), the busiest rank's copy time is added to the step time: the simulator's copy lanes would
hide it. ``ScheduleVAdaptive`` is judged at the largest memory cap (chunk units) that fits, per policy.

Activation recompute (``recompute=``, `RecomputeOption`, e.g. from `recompute_options`): the probe runs
without recompute, so each option rescales the measurement as the planner's formulas predict (the share of
a layer's saved bytes that stays, and the recompute time of a backward pass as a share of the layer's
measured forward), and every schedule x offload policy is judged again on it. A recompute candidate wins
only where it is faster among those that fit (recompute never shortens a step): where nothing fits
without it, or where it lets a faster schedule fit. The pick's mode is `AutoDecision.recompute`, what the
recipe's ``train.activation_checkpointing`` must apply.

Budget offload moves a stage's layers one by one, or with ``budget:sublayer`` each layer's attention half
and rest as two units: the setup carries the bytes the probe measured per layer and per unit (what the
runtime's captures of each move, `StageMeasurement.layer_bytes` / ``units``) and the units' compute shares
(`Measurement.unit_shares`), so the offload plan judged is the one the runtime places from
`AutoDecision.offload_inputs`. A measurement without units (an older probe's JSON) is judged as before,
per layer from the stage's bytes, and ``budget:sublayer`` is left out (`AutoDecision.notes` says why).

Memory budget per rank: ``memory_limit`` x 1F1B's peak (``2 * min(d, m)`` chunk units, i.e.
``min(d, m)`` microbatches of the rank's two V stages' measured bytes), and/or ``activation_budget_bytes``.
The fastest candidate that fits wins; candidates within 1 % of it are ties, broken by no offload, then less
memory, then pp_offload's own schedules.
"""

from __future__ import annotations

import math
import numbers
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from pp_offload.order.actions import Costs
from pp_offload.plan.costs import PassTimes
from pp_offload.plan.evaluate import (
    Setup,
    StageProfile,
    build_orders,
    chunk_pass_times,
    predict,
    simulation_sizes,
    stage_pass_costs,
)
from pp_offload.plan.handoff import policy_inputs
from pp_offload.plan.memory import ChunkActivation, StateBytes
from pp_offload.plan.orders import OURS, canonical_schedule, layout, microbatch_problem, resolve_search
from pp_offload.plan.probe import (
    PROBE_OFFLOAD,
    PROBE_SCHEDULE,
    Measurement,
    StageMeasurement,
    measure_step,
    unit_shares_for,
)
from pp_offload.recompute_plan import RecomputePlan, parse_recompute, recomputations

__all__ = [
    "DEFAULT_OFFLOAD",
    "DEFAULT_RECOMPUTE",
    "DEFAULT_SCHEDULES",
    "PROBE_OFFLOAD",
    "PROBE_SCHEDULE",
    "AutoCandidate",
    "RecomputeOption",
    "AutoDecision",
    "AutoError",
    "Measurement",
    "StageMeasurement",
    "choose",
    "costs_for",
    "measure_step",
    "offload_candidates",
    "recompute_options",
    "unit_shares_for",
]

DEFAULT_SCHEDULES = (
    "ScheduleVMin",
    "ScheduleVHalf",
    "ScheduleVZB",
    "ScheduleVAdaptive",
    "ScheduleInterleaved1F1B",
    "ScheduleZBVZeroBubble",
    "ScheduleInterleavedZeroBubble",
)
_WHOLE_CHUNKS = ("none", "selective:0.25", "selective:0.5", "full")
DEFAULT_OFFLOAD = (*_WHOLE_CHUNKS, "budget", "budget:sublayer", "budget:close-w")
"""Offload policies `choose` judges by default. ``budget:sublayer`` (budget offload by half layers) is
judged where the measurement knows each layer's sub-layer units (`Measurement.units_known`); elsewhere
its rows say why it was not judged."""
DEFAULT_RECOMPUTE = (
    "mlp",
    "selective:0.5",
    "selective:0.75",
    "selective:0.5,mlp",
    "selective:0.75,mlp",
    "selective",
    "full",
)
"""Recompute plans `recompute_options` offers by default (`pp_offload.recompute_plan`), from little
recompute to the most: MLP-only; selective on half or three quarters of each stage's layers, alone or
with the MLP-only recompute on the others (the MLP group frees 54% of selective's bytes for 25% of its
time, `pp_offload.plan.recompute_groups`, so the other layers give up much of their bytes for little);
every layer selective; full. No ``+once`` plans: under deferred weight gradients (the default of every
split-backward schedule, `pp_offload.runtime.deferred_w`) every plan recomputes once per microbatch, so a
``+once`` plan prices as the plan without it and would only double the candidates. Why the two-mode
plans: they fill the gaps between the one-mode steps,
e.g. Llama-3-8B, seq 4096, pp 4, m 8 on the H100 at half of 1F1B's memory: ``selective:0.75,mlp`` fits
where ``selective:0.75`` does not, 1.6% faster than ``selective`` (tests/test_auto.py)."""
_TIE = 0.01
_MS = 1e3
_MiB = float(1 << 20)


class AutoError(ValueError):
    """No candidate fits the memory budget; the message says by how much the closest misses and what
    budget would admit the lowest-memory one."""


@dataclass(frozen=True)
class AutoCandidate:
    """One schedule x offload policy as `choose` judged it (times in seconds, bytes per rank)."""

    schedule: str
    offload: str
    memory_limit: float | None
    predicted_step_s: float | None
    peak_bytes: list[int]
    fits: bool
    bubble: float | None = None
    offloaded_share: float = 0.0
    problem: str | None = None
    recompute: str = "none"

    @property
    def max_peak(self) -> int:
        return max(self.peak_bytes) if self.peak_bytes else 0


@dataclass
class AutoDecision:
    """What `choose` picked and why. ``costs`` (ms) go to the schedule's ``costs=`` so its order is built for
    the measured costs, and ``offload_inputs`` to ``enable_offload(..., inputs=...)`` (or our schedules'
    ``offload_inputs=``) so its offload plan is the one predicted. ``peak_bytes`` is the
    predicted device-resident saved-activation peak of each pipeline rank; ``budget_bytes`` each rank's
    budget (None: no memory constraint). ``candidates`` are ranked: the pick first, then the others that
    fit by step time, then those that do not fit."""

    schedule: str
    offload: str
    memory_limit: float | None
    costs: dict[str, float]
    predicted_step_s: float
    peak_bytes: list[int]
    reason: str
    candidates: list[AutoCandidate] = field(default_factory=list)
    budget_bytes: list[int] | None = None
    recompute: str = "none"
    """Activation recompute of the decoder layers the prediction assumes (``"none"``, ``"selective"``,
    ``"full"``): what the recipe's ``train.activation_checkpointing`` must apply."""
    stage_costs: list[list[float]] | None = None
    """Per stage, its F, I, W per chunk (ms), and where I and W both recompute the time a full backward runs
    once (``Costs.stages``): what ``choose`` placed offload with. The
    order is built from ``costs`` alone."""
    offload_inputs: dict[str, Any] | None = None
    """When the pick offloads: everything ``choose`` placed its offload with
    (`pp_offload.order.offload_inputs.OffloadInputs.to_dict`: costs with ``stage_costs``, measured layers,
    per-layer copy times and bytes per stage). ``enable_offload(..., inputs=...)`` (the recipe passes them)
    then places exactly the predicted plan; without them it plans from the scalar costs."""
    notes: list[str] = field(default_factory=list)
    """Candidates asked for but not judged, and why (``budget:sublayer`` on a measurement without
    sub-layer units)."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe (the recipe broadcasts it from rank 0); `from_dict` inverts it."""
        out = asdict(self)
        out["candidates"] = [asdict(c) for c in self.candidates]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AutoDecision:
        data = dict(data)
        data["candidates"] = [AutoCandidate(**c) for c in data.get("candidates", ())]
        return cls(**data)

    def table(self, limit: int | None = None) -> str:
        """The ranked candidates: predicted step time, peak per rank (max), whether it fits; the first
        ``limit`` rows only, when given (the rest are counted)."""
        budget = (
            "none" if self.budget_bytes is None else f"{max(self.budget_bytes) / _MiB:.3f} MiB (max rank)"
        )
        lines = [
            f"auto: {self.schedule} offload={self.offload}"
            + (f" memory_limit={self.memory_limit:.3f}" if self.memory_limit is not None else "")
            + (f" recompute={self.recompute}" if self.recompute != "none" else ""),
            *_wrapped(f"reason: {self.reason}"),
            f"activation budget per rank: {budget}",
            *(line for n in self.notes for line in _wrapped(f"note: {n}")),
            f"{'#':>3} {'schedule':26} {'offload':15} {'recompute':9} {'step ms':>9} {'bubble':>7} "
            f"{'act peak MiB':>12} fits",
        ]
        shown = self.candidates if limit is None else self.candidates[: max(int(limit), 1)]
        for k, c in enumerate(shown, 1):
            name = c.schedule + (f"({c.memory_limit:.2f})" if c.memory_limit is not None else "")
            step = f"{c.predicted_step_s * _MS:9.2f}" if c.predicted_step_s is not None else f"{'-':>9}"
            bubble = f"{c.bubble:7.1%}" if c.bubble is not None else f"{'-':>7}"
            peak = f"{c.max_peak / _MiB:12.3f}" if c.peak_bytes else f"{'-':>12}"
            fits = "yes" if c.fits else ("no: " + c.problem if c.problem else "no")
            lines.append(f"{k:>3} {name:26} {c.offload:15} {c.recompute:9} {step} {bubble} {peak} {fits}")
        if len(shown) < len(self.candidates):
            lines.append(f"    ... {len(self.candidates) - len(shown)} more candidates")
        return "\n".join(lines)


def _wrapped(text: str) -> list[str]:
    """A line of prose as lines of at most 100 characters (the tables' rows are as wide as they are)."""
    return textwrap.wrap(text, width=100, subsequent_indent="  ", break_on_hyphens=False) or [""]


def choose(
    measurement: Measurement,
    *,
    num_microbatches: int,
    memory_limit: float | None = None,
    activation_budget_bytes: int | None = None,
    schedules: Sequence[str] | None = None,
    offload: Sequence[str] | None = None,
    recompute: Sequence[RecomputeOption] | None = None,
) -> AutoDecision:
    """The fastest schedule x offload policy whose predicted per-rank activation peak fits (module doc).

    memory_limit: per-rank device-resident activation peak as a fraction of 1F1B's, in (0, 1].
    activation_budget_bytes: per-rank budget of device-resident saved-activation bytes (>= 0). Both may be
        given (both must hold); neither: the fastest candidate.
    schedules / offload: the candidates (default `DEFAULT_SCHEDULES` x `DEFAULT_OFFLOAD`); schedules must
        hold 2 stages per rank, offload entries are strings `resolve_offload` accepts.
    recompute: activation recompute options judged beside the measurement as it is (module doc; e.g.
        `recompute_options`); None or empty: no recompute candidates.
    Raises `AutoError` when nothing fits, ValueError on bad arguments. Deterministic.
    """
    from pp_offload.order.offload import resolve_offload

    if not isinstance(measurement, Measurement):
        raise TypeError(f"choose needs a Measurement (from measure_step), got {type(measurement).__name__}")
    m = _check_count(num_microbatches)
    names = _check_schedules(schedules)
    policies = _check_policies(offload)
    d = measurement.num_ranks
    budget = _budget(measurement, m, memory_limit, activation_budget_bytes)  # from the plain measurement
    measured = {"none": measurement}
    for option in recompute or ():
        if not isinstance(option, RecomputeOption):
            raise TypeError(
                f"recompute entries must be RecomputeOption (see recompute_options), got {option!r}"
            )
        measured[option.label] = option.apply(measurement)
    unknown = measurement.units_known  # sub-layer units: judged only where the probe measured them
    blind = [p for p in policies if unknown is not None and resolve_offload(p).granularity == "sublayer"]
    judged = [p for p in policies if p not in blind]
    if not judged:
        raise ValueError(f"offload {', '.join(blind)} cannot be judged on this measurement: {unknown}")
    notes = [f"not judged: offload {', '.join(blind)} ({unknown})"] if blind else []
    candidates: list[AutoCandidate] = []
    for mode, meas in measured.items():
        for name in names:
            setup = _setup(meas, name, m)
            if setup.problem is not None:
                found = [AutoCandidate(name, p, None, None, [], False, problem=setup.problem) for p in judged]
            elif name == "ScheduleVAdaptive":
                found = _adaptive(setup, meas, m, judged, budget)
            else:
                orders = build_orders(
                    setup, simulation_sizes(d, m, name), search=resolve_search("auto", d), virtual_stages=2
                )
                found = [_judge(setup, orders, meas, m, policy, budget) for policy in judged]
            candidates += [replace(c, recompute=mode) for c in found]
    ranked = _rank(candidates)
    best = ranked[0]
    if not best.fits:
        raise AutoError(_nothing_fits(ranked, measurement, m, budget, memory_limit, activation_budget_bytes))
    picked = _setup(measured[best.recompute], best.schedule, m)
    return AutoDecision(
        schedule=best.schedule,
        offload=best.offload,
        memory_limit=best.memory_limit,
        costs=costs_for(measured[best.recompute], best.schedule, num_microbatches=m),
        stage_costs=[list(x) for x in picked.costs.stages or ()],
        offload_inputs=policy_inputs(picked, best.offload).to_dict()
        if resolve_offload(best.offload).enabled
        else None,
        predicted_step_s=float(best.predicted_step_s),
        peak_bytes=list(best.peak_bytes),
        reason=_reason(ranked, budget),
        candidates=ranked,
        budget_bytes=budget,
        recompute=best.recompute,
        notes=notes,
    )


@dataclass(frozen=True)
class RecomputeOption:
    """What recomputing decoder layers in backward changes in a measured stage.

    mode: ``"mlp"``, ``"selective"`` or ``"full"`` (`pp_offload.plan.memory.RECOMPUTE`).
    share: the share of each stage's layers recomputed, earliest first (`pp_offload.recompute_plan`); 1: all.
    kept_share: share of one layer's saved bytes that stays saved (in (0, 1]).
    forward_share: time one backward pass (I or W) spends recomputing one layer, as a share of the layer's
        forward: 1 for full recompute; for selective, the elementwise ops' HBM traffic over the layer's
        forward time (`recompute_options`). Used only where the measurement carries no measured recompute
        cost for the mode (`Measurement.recompute_costs`, see `apply`).

    rest, rest_kept_share, rest_forward_share: the mode of the other layers of each stage and its two
        shares, for a two-mode plan (``"selective:0.75,mlp"``: selective on the first three quarters, the
        MLP-only recompute on the rest); ``"none"`` (keep everything) by default.
    once: a ``+once`` plan (`pp_offload.runtime.recompute_once`): I recomputes and keeps what it recomputed
        for W, so W recomputes nothing and the freed bytes are back on the device from I to W.

    Why shares of bytes: the kept share scales the probe's own measured bytes per layer, so the same
    option serves any probe. Why the time is measured seconds where the probe measured them, and a share
    only otherwise: a share of "the layer's forward" needs that forward, and the probe's per-layer F (its
    stage's forward over its layers) also holds the stage's mask building, the activation store's capture
    hooks and the action bookkeeping, while the traffic model has no per-op cost at all (selective's
    dispatch mode over every op, the checkpoint hooks in the forward); on the CPU bench the shares priced
    full recompute at +65-74% of the step for +40-46% measured and selective at +5% for +25-40%
    (`pp_offload.plan.recompute_calibration`). The shares stay for `pp-offload plan`, which models an
    H100 run without a probe.
    """

    mode: str
    kept_share: float
    forward_share: float
    share: float = 1.0
    rest: str = "none"
    rest_kept_share: float = 1.0
    rest_forward_share: float = 0.0
    once: bool = False

    def __post_init__(self) -> None:
        if self.mode not in ("mlp", "selective", "full"):
            raise ValueError(f"RecomputeOption.mode must be 'mlp', 'selective' or 'full', got {self.mode!r}")
        RecomputePlan(self.mode, self.share, self.rest, self.once)  # checks the share and the pair of modes
        for name in ("kept_share", "rest_kept_share"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"RecomputeOption.{name} must be in (0, 1], got {getattr(self, name)!r}")
        for name in ("forward_share", "rest_forward_share"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"RecomputeOption.{name} must be >= 0, got {getattr(self, name)!r}")

    @property
    def label(self) -> str:
        """The plan string (``"selective:0.75"``, ``"selective:0.75,mlp"``): what
        ``train.activation_checkpointing`` applies."""
        return RecomputePlan(self.mode, self.share, self.rest, self.once).label

    def apply(self, measurement: Measurement) -> Measurement:
        """``measurement`` as if its decoder layers (the option's share of each stage's, earliest first)
        were recomputed: per stage, those layers' saved bytes
        scaled by ``kept_share`` (each layer's bytes taken as the smallest measured per layer: first and
        last stages carry the embedding, head and loss besides), copy times in proportion, and I and W
        each lengthened by one recompute of the stage's recomputed layers, as many times as the runtime
        recomputes in each (`pp_offload.recompute_plan.recomputations`): stage 0's I and W come from one
        backward in torch (its I is ~0), one recompute added to W; a full backward B recomputes once
        (``recompute_shared``).

        Per recomputed layer of a mode, where ``measurement.recompute_costs`` measured the mode (the
        probe's calibration, `pp_offload.plan.recompute_calibration.ModeCost`): F grows by its measured
        ``forward`` (the checkpointing's own cost in the forward), I and W by their measured ``input`` and
        ``weight`` per recomputation, a full backward by ``backward`` (also stage 0's W, torch's whole
        backward there). Otherwise (a measurement without calibration, e.g. the planner's own): each
        recomputing pass grows by ``forward_share`` x a layer's forward, taken as the smallest measured
        per layer (stage F over its layers), and F is unchanged."""
        with_layers = [st for st in measurement.stages if st.layers > 0]
        if not with_layers:
            raise ValueError(
                "recompute candidates need each stage's decoder layer count (StageMeasurement.layers); "
                "the probe records it from the stage modules"
            )
        per_layer_bytes = min(st.saved_bytes / st.layers for st in with_layers)
        per_layer_forward = min(st.F / st.layers for st in with_layers)
        mine, rest = (
            self._layer_costs(measurement, mode, share, per_layer_forward)
            for mode, share in ((self.mode, self.forward_share), (self.rest, self.rest_forward_share))
        )
        stages = []
        plan = RecomputePlan(self.mode, self.share, self.rest, self.once)
        for index, st in enumerate(measurement.stages):
            count = plan.count(st.layers)
            others = st.layers - count if self.rest != "none" else 0
            freed = count * (1.0 - self.kept_share) + others * (1.0 - self.rest_kept_share)
            saved = max(0, round(st.saved_bytes - per_layer_bytes * freed))
            ratio = saved / st.saved_bytes if st.saved_bytes else 1.0
            added = [count * a + others * b for a, b in zip(mine, rest, strict=True)]  # F, I, W, B
            layer_bytes, units = self._units(st, plan.modes(st.layers), per_layer_bytes)
            first = index == 0
            at_i, at_w, at_b = (recomputations(k, first_stage=first, once=self.once) for k in ("I", "W", "B"))
            # deferred W: I is the microbatch's one backward, so it pays a full backward's recomputation
            at_input, at_weight = added[3] * at_i, added[2] * at_w
            stages.append(
                replace(
                    st,
                    F=st.F + added[0],
                    I=st.I + at_input,
                    W=st.W + at_weight,
                    recompute_shared=st.recompute_shared + max(0.0, at_input + at_weight - added[3] * at_b),
                    saved_bytes=saved,
                    held_after_input=0,  # deferred W: I releases the graph, +once keeps nothing for W
                    offload=st.offload * ratio,
                    reload=st.reload * ratio,
                    layer_bytes=layer_bytes,
                    units=units,
                )
            )
        return replace(measurement, stages=tuple(stages))

    @staticmethod
    def _layer_costs(
        measurement: Measurement, mode: str, forward_share: float, per_layer_forward: float
    ) -> tuple[float, float, float, float]:
        """Seconds one layer in ``mode`` adds to its forward, and to an I, a W and a B pass that recompute
        it once: measured where the probe calibrated the mode, else the share of the layer's forward
        (`apply`)."""
        if mode == "none":
            return 0.0, 0.0, 0.0, 0.0
        calibration = measurement.recompute_costs
        cost = calibration.cost(mode) if calibration is not None else None
        if cost is not None:
            return cost.forward, cost.input, cost.weight, cost.backward
        once = per_layer_forward * forward_share
        return 0.0, once, once, once

    def _units(
        self, st: StageMeasurement, modes: list[str], per_layer_bytes: float
    ) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
        """The stage's measured per-layer and per-unit bytes under the plan's per-layer ``modes``, as the
        runtime then captures them (`pp_offload.plan.memory.layer_unit_bytes` says the same): a layer
        checkpointed whole (full, selective) is one unit of what it keeps; ``mlp`` frees its bytes from
        the second unit (the MLP's); ``none`` keeps both."""
        if not st.units:
            return st.layer_bytes, st.units
        kept = {self.mode: self.kept_share, self.rest: self.rest_kept_share, "none": 1.0}
        layer_bytes, units = [], []
        for whole, parts, mode in zip(st.layer_bytes, st.units, modes, strict=True):
            freed = per_layer_bytes * (1.0 - kept[mode])
            left = max(0, round(whole - freed))
            layer_bytes.append(left)
            if mode in ("full", "selective"):
                units.append((left,))
            elif mode == "mlp":
                units.append((*parts[:-1], max(0, round(parts[-1] - freed))))
            else:
                units.append(parts)
        return tuple(layer_bytes), tuple(units)


def recompute_options(
    model: Any,
    *,
    seq_len: int,
    microbatch_size: int = 1,
    machine: Any = "H100",
    dtype: str = "bf16",
    modes: Sequence[str] = DEFAULT_RECOMPUTE,
) -> list[RecomputeOption]:
    """The planner's recompute model (`pp_offload.plan.memory`, `pp_offload.plan.costs`) as options for
    `choose`: per plan (a mode, a mode on a share of each stage's layers, or that with a second mode on the
    others: `pp_offload.recompute_plan`; default `DEFAULT_RECOMPUTE`),
    the kept share of a recomputed layer's saved bytes and the recompute time per backward pass as a share
    of the layer's forward, for ``model`` (anything `pp_offload.plan.model.model_spec` reads) on
    ``machine`` (a preset name or `pp_offload.plan.Machine`)."""
    from pp_offload.plan.costs import recompute_seconds, stage_times
    from pp_offload.plan.machines import resolve_machine
    from pp_offload.plan.memory import layer_activation_bytes
    from pp_offload.plan.model import model_spec

    spec, mach = model_spec(model), resolve_machine(machine)
    kw = {"microbatch_size": microbatch_size, "seq_len": seq_len}
    plain = layer_activation_bytes(spec, dtype, **kw)
    forward = stage_times(spec, mach, dtype, layers=1, first=False, last=False, **kw).F

    def shares(mode: str) -> tuple[float, float]:
        if mode == "none":
            return 1.0, 0.0
        kept = layer_activation_bytes(spec, dtype, recompute=mode, **kw) / plain
        return kept, recompute_seconds(spec, mach, dtype, recompute=mode, **kw) / forward

    out = []
    for label in modes:
        plan = parse_recompute(label)
        if plan.mode == "none":
            continue
        kept, seconds = shares(plan.mode)
        rest_kept, rest_seconds = shares(plan.rest)
        out.append(
            RecomputeOption(
                plan.mode, kept, seconds, plan.share, plan.rest, rest_kept, rest_seconds, once=plan.once
            )
        )
    return out


def costs_for(measurement: Measurement, schedule: str, *, num_microbatches: int = 1) -> dict[str, float]:
    """The measured costs (ms) ``choose`` builds ``schedule``'s order and offload plan with: what to pass as
    its ``costs=`` when building it by hand, so its order and offload plan match the prediction.

    Scalar keys only: the per-stage times ``choose`` simulates with (``Costs.stages``) serve the prediction,
    not the order, which the schedule classes and ``enable_offload`` build from the scalar F/I/W."""
    costs = _setup(measurement, canonical_schedule(schedule), _check_count(num_microbatches)).costs
    return {k: getattr(costs, k) for k in ("F", "I", "W", "comm", "transfer")}


# --- inputs --------------------------------------------------------------------------------------------


def _check_count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"num_microbatches must be an int >= 1, got {value!r}")
    return int(value)


def _check_schedules(schedules: Sequence[str] | None) -> list[str]:
    if schedules is None:
        return list(DEFAULT_SCHEDULES)
    if isinstance(schedules, str):
        schedules = [schedules]
    names = []
    for s in schedules:
        name = canonical_schedule(s)  # ValueError naming the known ones
        if layout(name, 2).num_stages != 4:
            raise ValueError(
                f"{name} holds one stage per rank, a different layer split than the probe's two stages per "
                "rank; auto chooses among schedules with two stages per rank (V or loop placement)"
            )
        if name not in names:
            names.append(name)
    if not names:
        raise ValueError("schedules is empty; give at least one schedule name, or None for the defaults")
    return names


def offload_candidates(offload: Sequence[str] | None) -> list[str]:
    """The offload policies ``choose`` judges for ``offload`` (None: `DEFAULT_OFFLOAD`), normalized and
    without repeats; ValueError naming a bad one (the recipe checks ``pipeline.offload`` with it)."""
    return _check_policies(offload)


def _check_policies(offload: Sequence[str] | None) -> list[str]:
    from pp_offload.order.offload import resolve_offload

    if offload is None:
        return list(DEFAULT_OFFLOAD)
    if isinstance(offload, str):
        offload = [offload]
    out = []
    for p in offload:
        if p is not None and not isinstance(p, str):
            raise ValueError(f"offload policies are strings like 'none', 'full', 'selective:0.5', got {p!r}")
        policy = resolve_offload(p)  # ValueError on a bad one
        if policy.mode == "auto":
            raise ValueError(
                "offload 'auto' depends on costs the rebuilt schedule derives itself; name a policy"
            )
        text = "none" if not policy.enabled else p.strip().lower()
        if text not in out:
            out.append(text)
    if not out:
        raise ValueError(
            "offload is empty; give at least one policy ('none' included), or None for the defaults"
        )
    return out


def _reference_bytes(measurement: Measurement, m: int) -> list[int]:
    """Per rank, 1F1B's activation peak in bytes: ``min(d, m)`` microbatches of the rank's two V stages."""
    d = measurement.num_ranks
    st = measurement.stages
    return [min(d, m) * (st[r].saved_bytes + st[2 * d - 1 - r].saved_bytes) for r in range(d)]


def _budget(
    measurement: Measurement, m: int, memory_limit: float | None, absolute: int | None
) -> list[int] | None:
    if memory_limit is not None:
        if isinstance(memory_limit, bool) or not isinstance(memory_limit, numbers.Real):
            raise ValueError(f"memory_limit must be a number in (0, 1], got {memory_limit!r}")
        if not 0.0 < float(memory_limit) <= 1.0:
            raise ValueError(
                "memory_limit must be in (0, 1] (fraction of 1F1B's peak activation memory), "
                f"got {memory_limit!r}"
            )
    if absolute is not None:
        if isinstance(absolute, bool) or not isinstance(absolute, numbers.Integral):
            raise ValueError(f"activation_budget_bytes must be an int >= 0, got {absolute!r}")
        if absolute < 0:
            raise ValueError(f"activation_budget_bytes must be >= 0 (bytes per rank), got {absolute}")
    if memory_limit is None and absolute is None:
        return None
    d = measurement.num_ranks
    limits = [math.inf] * d
    if memory_limit is not None:
        limits = [math.floor(float(memory_limit) * ref) for ref in _reference_bytes(measurement, m)]
    if absolute is not None:
        limits = [min(x, int(absolute)) for x in limits]
    return [int(x) for x in limits]


# --- judging candidates --------------------------------------------------------------------------------


def _setup(measurement: Measurement, schedule: str, m: int) -> Setup:
    """A planner `Setup` from measured numbers (ms, bytes); nothing static counted (activations only)."""
    d = measurement.num_ranks
    lay = layout(schedule, d)
    n = lay.num_stages
    stages = [
        StageProfile(
            layers=0,
            first=s == 0,
            last=s == n - 1,
            activation=ChunkActivation(
                saved=st.saved_bytes, held_after_input=int(st.held_after_input), queued=st.queued_bytes
            ),
            times=PassTimes(st.F * _MS, st.I * _MS, st.W * _MS, st.recompute_shared * _MS),
            params=0,
        )
        for s, st in enumerate(measurement.stages)
    ]
    per_chunk = chunk_pass_times([st.times for st in stages], lay)
    floor = 1e-6  # Costs needs F, I, W > 0 (stage 0's I is ~0 when torch ran its backward whole at W)
    costs = Costs(
        F=max(per_chunk.F, floor),
        I=max(per_chunk.I, floor),
        W=max(per_chunk.W, floor),
        comm=measurement.comm * _MS,
        transfer=max(max(st.offload, st.reload) for st in measurement.stages) * _MS / lay.chunks_per_stage,
        stages=stage_pass_costs([st.times for st in stages], lay, floor=floor),
    )
    zero = StateBytes(0, 0, 0)
    # budget offload: per layer, the smallest measured bytes per layer (stages with the embedding or the
    # head carry extras that are not layers) and the slowest measured copy per layer
    with_layers = [st for st in measurement.stages if st.layers > 0]
    layer_bytes = min((st.saved_bytes // st.layers for st in with_layers), default=0)
    layer_copy = max((max(st.offload, st.reload) / st.layers for st in with_layers), default=0.0) * _MS
    # measured per layer and per sub-layer unit (what the runtime's captures move), where the probe did
    units_known = measurement.units_known is None
    return Setup(
        schedule,
        lay,
        [st.layers for st in measurement.stages],
        stages,
        costs,
        [zero] * d,
        [0] * d,
        [0] * d,
        0,
        problem=microbatch_problem(schedule, d, m),
        layer_bytes=layer_bytes,
        layer_copy=layer_copy,
        layers_bytes=[list(st.layer_bytes) for st in measurement.stages] if units_known else [],
        units_bytes=[list(st.units) for st in measurement.stages] if units_known else [],
        unit_shares=measurement.unit_shares if units_known else (0.5, 0.5),
    )


def _judge(
    setup: Setup, orders: Any, measurement: Measurement, m: int, policy: str, budget: list[int] | None
) -> AutoCandidate:
    name, limit = setup.schedule, setup.memory_limit
    if orders.error is not None:
        return AutoCandidate(name, policy, limit, None, [], False, problem=orders.error)
    combined, results = predict(setup, orders, policy, m, synchronous_copies=not measurement.copies_overlap)
    step_ms = combined["makespan"]
    if not measurement.copies_overlap:
        # synchronous copies run on the compute thread: the busiest rank's copies lengthen the step
        last = results[-1]
        if last.moved_layers_per_rank:  # budget: layer (or sub-layer unit) copies, each of its own bytes
            per_byte = setup.layer_copy / setup.layer_bytes if setup.layer_bytes else 0.0
            step_ms += 2.0 * per_byte * max(last.moved_bytes_per_rank) * m / last.size
        else:
            per_rank = max(last.offloaded_per_rank, default=0) * m / last.size
            step_ms += 2.0 * setup.costs.transfer * setup.layout.chunks_per_stage * per_rank
    peaks = [int(p) for p in combined["activation"]]
    fits = budget is None or all(p <= b for p, b in zip(peaks, budget, strict=True))
    return AutoCandidate(
        name,
        policy,
        limit,
        step_ms / _MS,
        peaks,
        fits,
        bubble=combined["bubble"],
        offloaded_share=combined["offloaded_share"],
    )


def _adaptive(
    setup: Setup, measurement: Measurement, m: int, policies: list[str], budget: list[int] | None
) -> list[AutoCandidate]:
    """Per policy, ScheduleVAdaptive at the largest cap (chunk units, 2 .. 1F1B's) that fits the budget;
    at the smallest cap when none does (so the table shows how far it misses)."""
    d = measurement.num_ranks
    reference = 2 * min(d, m)
    found: dict[str, AutoCandidate] = {}
    for cap in range(reference, 1, -1):
        setup.memory_cap, setup.memory_limit = float(cap), cap / reference
        orders = build_orders(
            setup, simulation_sizes(d, m, setup.schedule), search=resolve_search("auto", d), virtual_stages=2
        )
        for policy in policies:
            if policy in found and found[policy].fits:
                continue
            found[policy] = _judge(setup, orders, measurement, m, policy, budget)
        if all(c.fits for c in found.values()):
            break
    return [found[p] for p in policies]


def _rank(candidates: list[AutoCandidate]) -> list[AutoCandidate]:
    """The pick first (fastest that fits; within 1 %: no offload, then less memory, then ours), then the
    other fitting candidates by step time, then the rest (simulated before unbuildable, by step time).

    Why no offload before less memory: the memory is already within the budget, and an offload
    candidate's predicted time carries the copies' uncertainty (bandwidth under load, on CPU the copies'
    serial time), while a 1 % difference is below what a probe step measures reliably."""

    def order(c: AutoCandidate) -> tuple[Any, ...]:
        return (
            c.predicted_step_s,
            c.max_peak,
            c.offload != "none",
            c.recompute != "none",
            c.schedule not in OURS,
            c.schedule,
            c.offload,
        )

    fitting = sorted((c for c in candidates if c.fits), key=order)
    rest = sorted(
        (c for c in candidates if not c.fits),
        key=lambda c: (
            c.predicted_step_s is None,
            c.max_peak,
            c.predicted_step_s or 0.0,
            c.schedule,
            c.offload,
        ),
    )
    if fitting:
        fastest = fitting[0].predicted_step_s
        tied = [c for c in fitting if c.predicted_step_s <= fastest * (1.0 + _TIE)]
        pick = min(
            tied,
            key=lambda c: (
                c.offload != "none",
                c.recompute != "none",
                c.max_peak,
                c.schedule not in OURS,
                c.memory_limit is not None,  # a fixed schedule before the adaptive one at the same cost
                *order(c),
            ),
        )
        fitting.remove(pick)
        fitting.insert(0, pick)
    return fitting + rest


def _label(c: AutoCandidate) -> str:
    limit = f" (memory_limit {c.memory_limit:.2f})" if c.memory_limit is not None else ""
    how = "without offload" if c.offload == "none" else f"with offload {c.offload}"
    again = f" and {c.recompute} recompute" if c.recompute != "none" else ""
    return f"{c.schedule}{limit} {how}{again}"


def _reason(ranked: list[AutoCandidate], budget: list[int] | None) -> str:
    pick = ranked[0]
    fitting = [c for c in ranked if c.fits]
    where = "of all candidates" if budget is None else f"of the {len(fitting)} candidates within the budget"
    text = (
        f"{_label(pick)} is the fastest {where}: predicted {pick.predicted_step_s * _MS:.2f} ms per step, "
        f"activation peak {pick.max_peak / _MiB:.3f} MiB per rank"
    )
    if len(fitting) > 1 and fitting[1].predicted_step_s < pick.predicted_step_s:
        fastest = min(fitting, key=lambda c: c.predicted_step_s)
        text += (
            f" (within 1% of {_label(fastest)} at {fastest.predicted_step_s * _MS:.2f} ms, with no offload, "
            "less memory or our schedule as the tie-break)"
        )
    return text + "."


def _nothing_fits(
    ranked: list[AutoCandidate],
    measurement: Measurement,
    m: int,
    budget: list[int] | None,
    memory_limit: float | None,
    absolute: int | None,
) -> str:
    simulated = [c for c in ranked if c.peak_bytes]
    asked = " and ".join(
        x
        for x in (
            f"memory_limit={memory_limit}" if memory_limit is not None else "",
            f"activation_budget_bytes={absolute}" if absolute is not None else "",
        )
        if x
    )
    if not simulated:
        problems = "; ".join(sorted({c.problem for c in ranked if c.problem}))
        return f"no candidate schedule can run here: {problems}"
    assert budget is not None  # without a budget every simulated candidate fits  # noqa: S101

    def overshoot(c: AutoCandidate) -> float:
        return max(p / b if b > 0 else math.inf for p, b in zip(c.peak_bytes, budget, strict=True))

    closest = min(simulated, key=lambda c: (overshoot(c), c.predicted_step_s))
    rank = max(range(len(budget)), key=lambda r: closest.peak_bytes[r] - budget[r])
    over = closest.peak_bytes[rank] - budget[rank]
    lowest = min(simulated, key=lambda c: (c.max_peak, c.predicted_step_s))
    refs = _reference_bytes(measurement, m)
    needed = max((p / ref for p, ref in zip(lowest.peak_bytes, refs, strict=True) if ref > 0), default=0.0)
    limit_hint = f" or memory_limit >= {math.ceil(needed * 1000) / 1000:.3f}" if 0 < needed <= 1 else ""
    return (
        f"no schedule x offload candidate fits {asked} ({budget[rank] / _MiB:.3f} MiB on rank {rank}): the "
        f"closest, {_label(closest)}, has an activation peak of {closest.peak_bytes[rank] / _MiB:.3f} MiB "
        f"there, {over / _MiB:.3f} MiB ({over / max(budget[rank], 1):.0%}) over. The smallest achievable "
        "activation peak is "
        f"{lowest.max_peak / _MiB:.3f} MiB per rank ({_label(lowest)}): activation_budget_bytes >= "
        f"{lowest.max_peak}{limit_hint} would admit it (or use fewer microbatches in flight / more ranks)."
    )
