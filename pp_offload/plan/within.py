"""The lowest activation peak within a step-time allowance: which recompute plan, with how much offload.

    from pp_offload.plan.within import lowest_peak_within
    found = lowest_peak_within("llama-3-70b", schedule="ScheduleInterleaved1F1B", slowdown=0.10, pp=16,
                               seq_len=8192, microbatch_size=1, num_microbatches=32, machine="H100")
    found.best.recompute, found.best.offload, found.best.peak, found.best.step_s

Why a search and not a list: the planner (`pp_offload.plan.plan`) answers "the fastest that fits a memory
limit"; a user who can afford X% more step time asks the dual, "the least memory within X%". The answer
depends on the depth: a stage's layer count sets which shares of its layers a recompute plan can take
(`pp_offload.recompute_plan`: with 10 layers per stage, shares in steps of 0.1; with 2 or 3, in steps of
a half or a third), so a share that fits at pp 4 may cost too much at pp 16. Each plan family
(``"selective:S,mlp"``: S searched) is therefore evaluated at every share its stages can express, the
lowest-peak plan of each family that fits alone is kept, and that plan is tried again with budget offload
within what it leaves of the allowance (``budget:auto`` at the remaining room), once per offload unit of
``granularities``: whole decoder layers, and sub-layer units (`pp_offload.order.offload.OffloadPolicy`
``granularity="sublayer"``: a layer's attention half leaves first, its copy starting before the MLP runs,
which takes bytes off the device earlier within a chunk's forward; neither unit wins everywhere, so both
are replayed). Plans alone are cheap to replay (no offload: milliseconds); budget offload at pp 16 is not
(seconds to tens of seconds per plan), hence one offload trial per family and unit.

Why a plan's offload trial may be skipped: `pp_offload.plan.link_bound` bounds what any offload placement
can take off the device at each moment of the plan's order over the host link; where even that cannot
bring the plan below the best peak found so far, its trial would be a wasted replay. The bound holds for
both units: it lets every saved byte leave from its chunk's forward start and come back as late as its
backward's end, which is at least as loose as any layer or sub-layer placement, so one bound prunes the
plan's trials at every unit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pp_offload.order.actions import F
from pp_offload.order.offload_inputs import activation_level
from pp_offload.plan.evaluate import Setup, build_orders, predict, simulation_sizes
from pp_offload.plan.handoff import planner_setup
from pp_offload.plan.link_bound import LinkBound, LinkGap, link_bound, reach_at
from pp_offload.plan.machines import resolve_machine
from pp_offload.recompute_plan import parse_recompute
from pp_offload.sim import simulate

__all__ = [
    "DEFAULT_FAMILIES",
    "GRANULARITIES",
    "WithinResult",
    "WithinRow",
    "lowest_peak_within",
    "plan_shares",
]

DEFAULT_FAMILIES = ("none", "mlp", "selective:S", "selective:S,mlp", "full:S,selective", "full:S")
"""Plan families searched by default: ``S`` stands for every share of a stage's layers the split can
express (`plan_shares`); the others are single plans."""

GRANULARITIES = ("layer", "sublayer")
"""Offload units each plan's budget trial is replayed with by default
(`pp_offload.order.offload.OffloadPolicy.granularity`)."""


@dataclass(frozen=True)
class WithinRow:
    """One recompute plan under one offload policy (``"none"``, or budget offload within ``room`` of the
    plain step's allowance). Bytes per rank, seconds."""

    recompute: str
    offload: str
    step_s: float
    activation: tuple[int, ...]
    moved_share: float
    rank_saved: int
    """Bytes the busiest rank's chunks save over the step (after recompute): what offload could move."""
    room: float = 0.0
    """The slowdown budget offload was given (relative to this plan's own step without offload)."""
    granularity: str = "layer"
    """Budget offload's unit: ``"layer"`` (whole decoder layers) or ``"sublayer"`` (attention half, then
    the rest); ``"layer"`` on rows without offload."""

    @property
    def units(self) -> str:
        """The offload unit as a row shows it: ``"-"`` without offload, else ``granularity``."""
        return "-" if self.offload == "none" else self.granularity

    @property
    def peak(self) -> int:
        return max(self.activation)


@dataclass
class WithinResult:
    """Every row tried, the allowance, and the plain step (no recompute, no offload) it is measured from."""

    slowdown: float
    base: WithinRow
    rows: list[WithinRow] = field(default_factory=list)
    setups: dict[str, Setup] = field(default_factory=dict, repr=False)
    """recompute plan -> its planner setup (for `pp_offload.plan.link_bound`)."""
    orders: dict[str, Any] = field(default_factory=dict, repr=False)
    """recompute plan -> its orders (`pp_offload.plan.evaluate.OrderSet`)."""
    pruned: dict[str, float] = field(default_factory=dict)
    """recompute plan -> need/can of the link bound that ruled out its offload trial (``prune``)."""
    plans: dict[tuple[str, str], Any] = field(default_factory=dict, repr=False)
    """(recompute plan, offload label) -> the offload trial's plan at the last simulated size
    (`pp_offload.order.offload.OffloadPlan`), for `gap`."""

    @property
    def limit_s(self) -> float:
        return self.base.step_s * (1.0 + self.slowdown)

    def fits(self, row: WithinRow) -> bool:
        return row.step_s <= self.limit_s * (1.0 + 1e-9)

    @property
    def best(self) -> WithinRow:
        """The lowest peak within the allowance (ties: the faster, then whole-layer units: a sub-layer
        trial that places the same bytes at the same time differs from the layer trial in rounding only)."""
        return min(
            (r for r in self.rows if self.fits(r)),
            key=lambda r: (r.peak, round(r.step_s, 9), r.granularity != "layer"),
        )

    def bound(self, alone: WithinRow, *, target: float, bandwidth: float) -> LinkBound:
        """`pp_offload.plan.link_bound.link_bound` of plan ``alone``'s order (no offload) for a per-rank
        peak of ``target`` bytes over a link of ``bandwidth`` bytes/s each way, with the plan's room left
        to the allowance as slack: whether any offload placement can bring that plan to ``target``."""
        setup, orders = self.setups[alone.recompute], self.orders[alone.recompute]
        sim = simulate(orders.orders[orders.sizes[-1]], setup.costs)
        stage_bytes = setup.offload_inputs().stage_bytes
        slack = max(0.0, self.limit_s - alone.step_s)
        return link_bound(sim, stage_bytes, target=target, bandwidth=bandwidth, slack=slack)

    def gap(self, row: WithinRow, *, target: float, bandwidth: float) -> LinkGap:
        """Where offload trial ``row`` falls short of a per-rank peak of ``target`` bytes, at the tightest
        moment of the bound (`bound` of its plan alone): the bytes needed off the device there, what the
        trial's placement has off at that same forward pass (its replay runs later on the clock), and what
        any placement could have off in the plain timing and with the plan's room (`LinkGap`)."""
        alone = self.alone(row.recompute)
        found = self.bound(alone, target=target, bandwidth=bandwidth)
        if found.need <= 0:
            raise ValueError(f"{row.recompute} alone already stays within {target} bytes: no gap to split")
        setup, orders = self.setups[row.recompute], self.orders[row.recompute]
        plain = simulate(orders.orders[orders.sizes[-1]], setup.costs)
        _, can_plain = reach_at(
            plain,
            setup.offload_inputs().stage_bytes,
            rank=found.rank,
            time_s=found.time_s,
            bandwidth=bandwidth,
        )
        plan = self.plans[(row.recompute, row.offload)]
        start = next(
            t
            for (stage, kind, mb), t, _ in plan.sim.timeline[found.rank]
            if kind == F and (stage, mb) == found.chunk
        )
        stage_bytes = setup.offload_inputs(row.granularity).stage_bytes
        held, without = activation_level(plan.sim, stage_bytes, found.rank, start, plan.layered)
        passes = plain.timeline[found.rank]
        at = next(
            i for i, ((st, kind, mb), _, _) in enumerate(passes) if kind == F and (st, mb) == found.chunk
        )
        idle = passes[at + 1][1] - passes[at][2] if at + 1 < len(passes) else 0.0
        return LinkGap(found.rank, found.chunk, found.need, without - held, can_plain, found.can, idle)

    def table(self, schedule: str = "") -> str:
        """The plain row, the best, and every offload trial (GiB, s), with the pruned trials' bounds."""
        gib = float(1 << 30)

        def line(tag: str, r: WithinRow) -> str:
            slower = r.step_s / self.base.step_s - 1.0
            return (
                f"{tag:<6}{r.recompute:<26}{r.offload:<31}{r.units:<10}{r.peak / gib:>9.1f}{r.step_s:>9.3f}"
                f"{slower:>+9.1%}"
            )

        head = f"{'':<6}{'recompute':<26}{'offload':<31}{'units':<10}{'act GiB':>9}{'step s':>9}{'slower':>9}"
        lines = [f"{schedule} lowest activation peak within +{self.slowdown:.0%}".strip(), head]
        lines.append(line("plain", self.base))
        lines += [line("trial", r) for r in self.rows if r.offload != "none"]
        lines.append(line("best", self.best))
        lines += [
            f"      {k} + budget offload: not run, link bound {v:.2f} > 1" for k, v in self.pruned.items()
        ]
        return "\n".join(lines)

    def alone(self, recompute: str) -> WithinRow:
        """The plan's row without offload."""
        return next(r for r in self.rows if r.recompute == recompute and r.offload == "none")


def plan_shares(family: str, layers: Sequence[int]) -> list[str]:
    """The plan strings of ``family`` that differ on stages of ``layers`` decoder layers: ``"mode:S"`` or
    ``"mode:S,rest"`` at every share ``k/n`` (n a stage's layer count) below 1, then the mode on every
    layer; a family without ``S`` is itself; ``+once`` after a family (``"selective:S+once"``) goes on
    every plan of it. Duplicates (the same layer counts on every stage) dropped."""
    if ":S" not in family:
        return [parse_recompute(family).label]
    base, plus, modifier = family.partition("+")
    once = f"+{modifier}" if plus else ""
    mode, _, rest = base.partition(":S")
    counts = sorted({n for n in layers if n > 0})
    shares = sorted({k / n for n in counts for k in range(1, n)})
    seen: dict[tuple, str] = {}
    for share in [*shares, 1.0]:
        # rounded down: a share printed above k/n would take one more layer of an n-layer stage
        plan = parse_recompute(f"{mode}:{math.floor(share * 1e6) / 1e6:g}{rest if share < 1 else ''}{once}")
        seen.setdefault(tuple(tuple(plan.modes(n)) for n in counts), plan.label)
    return list(seen.values())


def lowest_peak_within(
    model: Any,
    *,
    schedule: str,
    slowdown: float,
    families: Sequence[str] = DEFAULT_FAMILIES,
    offload: bool = True,
    granularities: Sequence[str] = GRANULARITIES,
    prune: bool = True,
    progress: Callable[[str], None] | None = None,
    **setting: Any,
) -> WithinResult:
    """Search the recompute plans of ``families`` alone and with budget offload (module doc) for the lowest
    per-rank activation peak whose predicted step stays within ``slowdown`` (0.10: 10%) of ``schedule``
    without recompute or offload. ``setting``: `pp_offload.plan.handoff.planner_setup`'s arguments (pp,
    seq_len, microbatch_size, num_microbatches, machine, ...). ``offload=False``: plans alone only.
    ``granularities``: the offload units each plan's trial is replayed with (`GRANULARITIES`: whole layers
    and sub-layer units; ``("layer",)`` halves the trials; a plan that checkpoints every layer as a whole
    has no sub-layer split, so its sub-layer trial is skipped). ``prune``: skip the offload trials of a
    plan that the host link's bound (`link_bound`, with the plan's room as slack) shows cannot get below
    the best peak found so far (``WithinResult.pruned``), at every unit (the bound holds for both); plans
    are tried lowest peak first, so the costly trials of the plans that keep the most bytes are the ones
    skipped."""
    if not 0 <= slowdown < math.inf:
        raise ValueError(f"slowdown must be a finite number >= 0 (0.10 = 10%), got {slowdown!r}")
    unknown = [g for g in granularities if g not in GRANULARITIES]
    if unknown or (offload and not granularities):
        raise ValueError(
            f"granularities must be a non-empty subset of {GRANULARITIES}, got {granularities!r}"
        )
    cache: dict[str, dict] = {}
    base = _row(cache, model, schedule, "none", None, setting)
    result = WithinResult(slowdown, base, [base], cache["setups"], cache["orders"])
    result.plans = cache.setdefault("plans", {})
    layers = result.setups["none"].layers
    kept: list[WithinRow] = []
    for family in families:
        fitting = []
        for label in plan_shares(family, layers):
            if label not in result.setups:
                result.rows.append(_row(cache, model, schedule, label, None, setting))
            row = result.alone(label)
            if result.fits(row):
                fitting.append(row)
        if fitting:
            kept.append(min(fitting, key=lambda r: (r.peak, r.step_s)))
    if offload:
        bandwidth = resolve_machine(setting.get("machine", "H100")).host_bandwidth
        for alone in sorted(_undominated(kept), key=lambda r: (r.peak, r.step_s)):
            label = alone.recompute
            room = result.limit_s / alone.step_s - 1.0
            if room <= 1e-9:
                continue
            if prune:
                bound = result.bound(alone, target=result.best.peak, bandwidth=bandwidth)
                if bound.ratio > 1.0:  # no placement gets it below the best so far
                    result.pruned[label] = bound.ratio
                    continue
            for granularity in _units_of(result.setups[label], granularities):
                result.rows.append(_row(cache, model, schedule, label, room, setting, granularity))
                if progress:
                    progress(f"{schedule} {label} + budget offload ({granularity} units) within {room:.1%}")
    return result


def _units_of(setup: Setup, granularities: Sequence[str]) -> list[str]:
    """The offload units worth a trial for a plan: a plan whose every layer is checkpointed as a whole
    (``selective``, ``full``) has one sub-layer unit per layer (`pp_offload.plan.memory.layer_unit_bytes`),
    so its sub-layer trial would replay the layer trial's placement; then only the first of
    ``granularities`` is tried."""
    wanted = list(dict.fromkeys(granularities))
    whole = all(len(unit) == 1 for stage in setup.units_bytes for unit in stage)
    return wanted[:1] if whole and setup.units_bytes else wanted


def _undominated(rows: list[WithinRow]) -> list[WithinRow]:
    """The plans worth an offload trial: no other plan alone is at most as slow with at most the same
    peak (it would leave offload more room and less to move), and one of each identical pair."""
    out: list[WithinRow] = []
    for row in rows:
        if any(o.peak <= row.peak and o.step_s <= row.step_s for o in out):
            continue
        out = [o for o in out if not (row.peak <= o.peak and row.step_s <= o.step_s)] + [row]
    return out


def _row(
    cache: dict,
    model: Any,
    schedule: str,
    recompute: str,
    room: float | None,
    setting: dict,
    granularity: str = "layer",
) -> WithinRow:
    """One plan's row (offload: budget within ``room`` in units of ``granularity``; None: no offload),
    setups and orders cached."""
    setups, orders = cache.setdefault("setups", {}), cache.setdefault("orders", {})
    if recompute not in setups:
        setup = planner_setup(model, schedule=schedule, recompute=recompute, **setting)
        m = setting["num_microbatches"]
        built = build_orders(
            setup, simulation_sizes(setup.layout.num_ranks, m, schedule), search="auto", virtual_stages=2
        )
        if built.error:
            raise RuntimeError(f"{schedule} with recompute {recompute}: {built.error}")
        setups[recompute], orders[recompute] = setup, built
    setup, built = setups[recompute], orders[recompute]
    m = setting["num_microbatches"]
    policy = "none" if room is None else {"mode": "budget", "max_slowdown": room, "granularity": granularity}
    summary, results = predict(setup, built, policy, m)
    rank_saved = max(
        m * sum(setup.stages[s].activation.saved for s in setup.layout.stages_of(r))
        for r in range(setup.layout.num_ranks)
    )
    row = WithinRow(
        recompute=recompute,
        offload="none" if room is None else f"budget:auto:{room:.4f}" + _SUFFIX[granularity],
        step_s=summary["makespan"],
        activation=tuple(int(a) for a in summary["activation"]),
        moved_share=summary["moved_share"],
        rank_saved=rank_saved,
        room=0.0 if room is None else room,
        granularity=granularity,
    )
    if results[-1].plan is not None:
        cache.setdefault("plans", {})[(recompute, row.offload)] = results[-1].plan
    return row


_SUFFIX = {"layer": "", "sublayer": ":sublayer"}
"""The `pp_offload.order.offload.resolve_offload` spelling of each unit after ``budget:auto:X``."""
