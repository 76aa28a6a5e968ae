"""How `pp_offload.plan.auto.choose` judges one schedule x offload policy on a measurement: a planner
`Setup` from the measured numbers, its orders replayed under the policy, the predicted step time and
per-rank activation peak against the budget (`AutoCandidate`).

Why a module of its own: judging reuses the planner's machinery (`pp_offload.plan.evaluate`) on measured
costs; it is the part of ``schedule: auto`` that simulates, apart from the checks of its inputs and the
decision (`pp_offload.plan.auto`) and from the ranking that explains it (`pp_offload.plan.auto_ranking`).
"""

from __future__ import annotations

from dataclasses import dataclass
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
from pp_offload.plan.memory import ChunkActivation, StateBytes
from pp_offload.plan.orders import layout, microbatch_problem, resolve_search
from pp_offload.plan.probe import Measurement

_MS = 1e3
_MiB = float(1 << 20)


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


def _reference_bytes(measurement: Measurement, m: int) -> list[int]:
    """Per rank, 1F1B's activation peak in bytes: ``min(d, m)`` microbatches of the rank's two V stages."""
    d = measurement.num_ranks
    st = measurement.stages
    return [min(d, m) * (st[r].saved_bytes + st[2 * d - 1 - r].saved_bytes) for r in range(d)]


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
        deferred_w=measurement.deferred_w,
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
