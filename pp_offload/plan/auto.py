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

This module checks the inputs and makes the decision; the recompute options are in
`pp_offload.plan.recompute_options`, the judging of one candidate in `pp_offload.plan.auto_judge`, the
ranking and its reasons in `pp_offload.plan.auto_ranking`.
"""

from __future__ import annotations

import math
import numbers
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from pp_offload.plan.auto_judge import _MS, AutoCandidate, _adaptive, _judge, _MiB, _reference_bytes, _setup
from pp_offload.plan.auto_ranking import _nothing_fits, _rank, _reason
from pp_offload.plan.evaluate import build_orders, simulation_sizes
from pp_offload.plan.handoff import policy_inputs
from pp_offload.plan.orders import canonical_schedule, layout, resolve_search
from pp_offload.plan.probe import (
    PROBE_OFFLOAD,
    PROBE_SCHEDULE,
    Measurement,
    StageMeasurement,
    measure_step,
    unit_shares_for,
)
from pp_offload.plan.recompute_options import DEFAULT_RECOMPUTE, RecomputeOption, recompute_options

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


class AutoError(ValueError):
    """No candidate fits the memory budget; the message says by how much the closest misses and what
    budget would admit the lowest-memory one."""


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
