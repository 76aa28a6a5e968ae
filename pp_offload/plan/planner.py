"""Pick a pipeline schedule, an activation-offload policy and an activation-recompute mode for a model, a
batch shape and a machine.

Every schedule (ours and torch's) is evaluated with every offload policy and every recompute plan
(``none``, ``selective``, ``full``: `pp_offload.plan.memory.RECOMPUTE`, or a mode on the first share of each
stage's layers, ``selective:0.75``: `pp_offload.recompute_plan`; `DEFAULT_RECOMPUTE`) through the simulator
(`pp_offload.plan.evaluate`); candidates are ranked fits-first, then by predicted step time (equal times:
less offload first, less recompute, then lower peak memory). Offload and recompute never shorten an order,
so the offload policies of a schedule that fits without offload, and the recompute modes of a schedule
that fits without either, are only replayed on request (``evaluate_dominated``). The
recommendation is the first candidate that fits, with the reason; when none fits, `PlanError` says by how
much the closest one misses and which single change would fit (more pipeline stages, a smaller
microbatch, sharded optimizer state, full offload, a larger GPU), each sized by the same model.

Memory per rank = parameters + gradients + optimizer state of the rank's stages (`pp_offload.plan.memory`)
+ torch's per-microbatch receive buffers + the simulated activation peak (offload included) + a transient
allowance (one layer's backward, the logits' gradients on the head's rank) + ``reserve_gib`` (CUDA
context, NCCL, allocator fragmentation). Step time = the simulated pipeline makespan + the data-parallel
gradient all-reduce (ring, not overlapped with the pipeline's cool-down) when ``dp > 1``.

Cost of planning: order construction and offload replays (see `pp_offload.plan.orders`). Measured on 2
busy CPU cores, the paper's 38.5B setting (pp=32, m=128): 8 s when the fast schedules fit without offload
(offload is then not replayed: it can never win), ~70 s at 40 GiB, where offload is replayed for most
schedules; pp=4-8 with small m: a few seconds. Orders are built for all m microbatches within a time
budget per schedule and extrapolated, checked, past it (`pp_offload.plan.evaluate.simulation_sizes`). A
progress bar over the candidates shows where it is, on a terminal.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from pp_offload.plan.auto import DEFAULT_RECOMPUTE as AUTO_RECOMPUTE
from pp_offload.plan.evaluate import (
    Setup,
    build_orders,
    choose_adaptive_limit,
    predict,
    setup_schedule,
    simulation_sizes,
)
from pp_offload.plan.machines import MACHINES, Machine, resolve_machine
from pp_offload.plan.memory import RECOMPUTE, activation_is_modelled, check_recompute, precision
from pp_offload.plan.model import ModelSpec, model_spec
from pp_offload.plan.orders import SCHEDULES, canonical_schedule, resolve_search
from pp_offload.recompute_plan import parse_recompute

__all__ = ["DEFAULT_OFFLOAD", "Candidate", "PlanError", "PlanResult", "plan"]

GIB = 1 << 30
DEFAULT_OFFLOAD = (
    "none",
    "selective:0.25",
    "selective:0.5",
    "full",
    "budget",
    "budget:auto:0.1",
    "budget:close-w",
    "budget:sublayer",
)
DEFAULT_RECOMPUTE = ("none", *AUTO_RECOMPUTE)
"""Recompute plans tried by default (`pp_offload.recompute_plan`): none, then exactly the plans
``schedule: auto`` weighs (`pp_offload.plan.auto.DEFAULT_RECOMPUTE`; no ``+once`` plans: deferred W prices
them as the plain ones), so the
planner and the recipe's auto choose among the same candidates."""
SINGLE_STAGE = ("Schedule1F1B", "ScheduleGPipe")
"""torch's single-stage schedules: they run on torch's older executor, which cannot take OFFLOAD/RELOAD."""
_TIE = 1e-6


class PlanError(ValueError):
    """No candidate fits (``.result`` holds the ranked candidates), or the inputs are impossible."""

    def __init__(self, message: str, result: PlanResult | None = None) -> None:
        super().__init__(message)
        self.result = result


@dataclass
class Candidate:
    """One schedule with one offload policy and one recompute mode: predicted step time and memory of every
    rank. ``recompute`` is what the recipe applies as ``train.activation_checkpointing`` (``"none"``: off).

    Times in seconds, memory in bytes; ``peak_units`` are the simulator's chunk units (one V stage of one
    microbatch; 1F1B peaks at ``2 * min(pp, m)``).
    """

    schedule: str
    offload: str
    memory_limit: float | None = None
    step_time: float | None = None
    pipeline_time: float | None = None
    dp_sync_time: float = 0.0
    bubble: float | None = None
    peak_units: list[float] = field(default_factory=list)
    activation: list[int] = field(default_factory=list)
    memory: list[int] = field(default_factory=list)
    breakdown: list[dict[str, int]] = field(default_factory=list)
    fits: bool = False
    over_bytes: int = 0
    offloaded_share: float = 0.0
    moved_share: float = 0.0
    reload_wait: float = 0.0
    extrapolated: bool = False
    error: str | None = None
    skipped: str | None = None
    useless: str | None = None
    """Why this offload candidate is never recommended: it moves nothing, or it costs step time without
    lowering the activation peak below the same schedule without offload (and without recompute)."""
    recompute: str = "none"
    pulled_w: int = 0
    """``budget:close-w``: W passes its offload-aware order moved right after their I (0: the order as given,
    the same plan as ``budget``)."""

    @property
    def evaluated(self) -> bool:
        return self.error is None and self.skipped is None

    @property
    def name(self) -> str:
        if self.schedule == "ScheduleVAdaptive" and self.memory_limit is not None:
            return f"ScheduleVAdaptive({self.memory_limit:.2f})"
        return self.schedule

    @property
    def label(self) -> str:
        text = f"{self.name} + {self.offload} offload" if self.offload != "none" else self.name
        return text + (f" + {self.recompute} recompute" if self.recompute != "none" else "")

    @property
    def peak_bytes(self) -> int:
        return max(self.memory) if self.memory else 0

    @property
    def peak_rank(self) -> int:
        return self.memory.index(self.peak_bytes) if self.memory else -1

    @property
    def activation_peak(self) -> int:
        return max(self.activation) if self.activation else 0

    @property
    def peak_unit(self) -> float:
        return max(self.peak_units) if self.peak_units else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(name=self.name, label=self.label, peak_bytes=self.peak_bytes, peak_rank=self.peak_rank)
        return out


@dataclass
class PlanResult:
    """Ranked candidates, the recommendation and why; ``table()`` prints them, ``plot(path)`` draws them."""

    candidates: list[Candidate]
    recommended: Candidate | None
    reason: str
    settings: dict[str, Any]
    model: ModelSpec
    machine: Machine
    schedules: dict[str, dict[str, Any]]
    assumptions: list[str]

    @property
    def memory_limit_bytes(self) -> int:
        return int(self.settings["gpu_memory_gib"] * GIB)

    @property
    def recompute(self) -> str | None:
        """The recommended candidate's recompute mode (what the recipe's ``train.activation_checkpointing``
        must apply for the prediction to hold); None when nothing is recommended."""
        return self.recommended.recompute if self.recommended is not None else None

    def candidate(self, schedule: str, offload: str = "none", recompute: str = "none") -> Candidate:
        """The candidate of ``schedule`` (any spelling `canonical_schedule` accepts) with ``offload`` and
        ``recompute``."""
        name = canonical_schedule(schedule)
        for c in self.candidates:
            if c.schedule == name and c.offload == offload and c.recompute == recompute:
                return c
        raise KeyError(f"no candidate {name} with offload {offload!r} and recompute {recompute!r}")

    def table(self) -> str:
        from pp_offload.plan.report import format_table

        return format_table(self)

    def plot(self, path: Any) -> Any:
        from pp_offload.plan.report import plot_plan

        return plot_plan(self, path)

    def to_dict(self) -> dict[str, Any]:
        return {
            "settings": self.settings,
            "model": asdict(self.model),
            "machine": asdict(self.machine),
            "recommended": self.recommended.label if self.recommended else None,
            "recompute": self.recompute,
            "reason": self.reason,
            "candidates": [c.to_dict() for c in self.candidates],
            "schedules": self.schedules,
            "assumptions": self.assumptions,
        }


def plan(
    model: Any,
    *,
    seq_len: int,
    microbatch_size: int,
    num_microbatches: int,
    pp: int,
    dp: int = 1,
    gpu_memory_gib: float | None = None,
    machine: str | Machine = "H100",
    dtype: str = "bf16",
    schedules: Iterable[str] | None = None,
    offload: Iterable[Any] | None = None,
    dp_shard: bool = False,
    flops: float | None = None,
    host_bandwidth: float | None = None,
    mfu: float | None = None,
    virtual_stages: int = 2,
    search: str = "auto",
    reserve_gib: float = 2.0,
    progress: bool = False,
    jobs: int | None = None,
    evaluate_dominated: bool = False,
    suggest: bool = True,
    lora_rank: int = 0,
    recompute: Iterable[str] | str | None = None,
) -> PlanResult:
    """Evaluate every schedule with every offload policy and recommend one (see the module doc).

    model: a transformers ``PretrainedConfig``, a dict, a local path (model directory or config .json) or a
        hub id (``AutoConfig.from_pretrained``). Llama-family and GPT-2 layouts (`pp_offload.plan.model`).
    seq_len, microbatch_size, num_microbatches: tokens per sample, samples per microbatch, microbatches
        per step (per pipeline).
    pp, dp: pipeline ranks; data-parallel replicas (only memory sharding and the gradient sync depend on it).
    gpu_memory_gib: usable device memory (default: the machine's).
    machine: ``"A100"``, ``"H100"``, ``"H200"`` or a `pp_offload.plan.Machine`; ``flops`` (peak FLOP/s),
        ``host_bandwidth`` (bytes/s per direction), ``mfu`` override its fields.
    dtype: ``"bf16"``, ``"fp16"`` or ``"fp32"`` (parameters and activations; AdamW state in fp32).
    schedules: names (default: all of ours and torch's: `pp_offload.plan.orders.SCHEDULES`).
    offload: policies (default ``none``, ``selective:0.25``, ``selective:0.5``, ``full``, ``budget`` (as many
        layers per chunk as hide within 3% step time), ``budget:auto:0.1`` (within 10%), ``budget:close-w``
        (budget, also on offload-aware orders with W moved next to I: `pp_offload.order.zb_offload`),
        ``budget:sublayer`` (budget by half layers: `pp_offload.order.offload.OffloadPolicy.granularity`)).
        Offload candidates that move nothing, or cost time without lowering the activation peak, are marked
        (``Candidate.useless``) and never recommended; torch's single-stage schedules get no offload rows.
    dp_shard: optimizer state and master weights sharded over ``dp`` (ZeRO-1/2, FSDP2 under PP).
    virtual_stages: stages per rank of torch's interleaved (loop) schedules.
    search: ``"full"``, ``"fast"`` or ``"auto"`` (`pp_offload.plan.orders`).
    reserve_gib: memory set aside per GPU for the CUDA context, NCCL and fragmentation.
    progress: show a progress bar on stderr when it is a terminal (never in a redirected log).
    jobs: worker processes (default: one per CPU, at most one per schedule; 1 runs everything in this
        process). suggest: when nothing fits, size alternatives.
    evaluate_dominated: also replay the offload policies of schedules that fit without offload (they cannot
        be recommended: offload never shortens an order, and ties go to no offload), to see what offload
        would save; by default they are listed as skipped, which saves most of the planning time.
    recompute: activation recompute plans to try (default `DEFAULT_RECOMPUTE`: ``none`` and the plans
        ``schedule: auto`` weighs, ``mlp``, ``selective:0.5``, ``selective:0.75``, ``selective:0.5,mlp``,
        ``selective:0.75,mlp``, ``selective``, ``full``; a mode with a
        share recomputes the first share of each stage's layers, a second mode after a comma the others;
        `pp_offload.plan.memory` and `pp_offload.plan.costs` model their bytes and time).
        Recompute candidates of a schedule that fits without offload and recompute are skipped unless
        ``evaluate_dominated``; a recompute candidate that costs time without lowering the activation peak
        below the plain schedule is marked useless. ``PlanResult.recompute`` is the recommended mode.
    lora_rank: plan LoRA fine-tuning with adapters of this rank on every layer projection (0: all weights
        trained): gradients and optimizer state of the adapters only, and W of the adapters only, which
        leaves zero-bubble schedules little to fill their bubbles with (`pp_offload.plan.costs`).

    Raises `PlanError` when nothing fits (``err.result`` holds the ranked candidates) or when no schedule
    can be built for these inputs; ``ValueError``/``TypeError`` for malformed arguments.
    """
    for name, value, low in (
        ("seq_len", seq_len, 1),
        ("microbatch_size", microbatch_size, 1),
        ("num_microbatches", num_microbatches, 1),
        ("pp", pp, 2),
        ("dp", dp, 1),
        ("virtual_stages", virtual_stages, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r}")
        if value < low:
            hint = " (pipeline parallelism needs at least 2 ranks)" if name == "pp" else ""
            raise ValueError(f"{name} must be >= {low}, got {value}{hint}")
    if isinstance(reserve_gib, bool) or not isinstance(reserve_gib, (int, float)) or not reserve_gib >= 0:
        raise ValueError(f"reserve_gib must be a number >= 0, got {reserve_gib!r}")
    spec = model_spec(model)
    if lora_rank:
        spec = replace(spec, lora_rank=lora_rank)
    mach = resolve_machine(
        machine, flops=flops, host_bandwidth=host_bandwidth, mfu=mfu, memory_gib=gpu_memory_gib
    )
    prec = precision(dtype)
    names = _schedule_names(schedules)
    policies = _policies(offload)
    modes = _recompute_modes(recompute)
    mode = resolve_search(search, pp)
    limit_bytes = int(mach.memory_gib * GIB)
    reserve = int(reserve_gib * GIB)
    settings = {
        "model": spec.describe(),
        "seq_len": seq_len,
        "microbatch_size": microbatch_size,
        "num_microbatches": num_microbatches,
        "pp": pp,
        "dp": dp,
        "dp_shard": dp_shard,
        "lora_rank": spec.lora_rank,
        "dtype": prec.name,
        "machine": mach.name,
        "gpu_memory_gib": mach.memory_gib,
        "reserve_gib": reserve_gib,
        "virtual_stages": virtual_stages,
        "search": mode,
        "simulated_microbatches": simulation_sizes(pp, num_microbatches),
        "schedules": names,
        "offload": [label for label, _ in policies],
        "recompute": modes,
    }
    common = {
        "spec": spec,
        "machine": mach,
        "precision": prec,
        "seq_len": seq_len,
        "microbatch_size": microbatch_size,
        "num_microbatches": num_microbatches,
        "pp": pp,
        "dp": dp,
        "dp_shard": dp_shard,
        "virtual_stages": virtual_stages,
        "reserve": reserve,
    }
    if jobs is not None and (isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1):
        raise ValueError(f"jobs must be an int >= 1 or None, got {jobs!r}")
    candidates, details = _evaluate_all(
        names, policies, common, limit_bytes, mode, progress, jobs, evaluate_dominated, modes
    )
    for c in candidates:
        if c.evaluated:
            c.dp_sync_time = _dp_sync_seconds(c, dp, mach)
            c.step_time = c.pipeline_time + c.dp_sync_time
    ranked = _rank(candidates, names, [label for label, _ in policies], modes)
    result = PlanResult(
        candidates=ranked,
        recommended=None,
        reason="",
        settings=settings,
        model=spec,
        machine=mach,
        schedules=details,
        assumptions=_assumptions(spec, prec.name, mode, dp, dp_shard),
    )
    _mark_useless(ranked)
    fitting = [c for c in ranked if c.evaluated and c.fits and c.useless is None]
    if fitting:
        result.recommended = fitting[0]
        aliases = {n: d["same_orders_as"] for n, d in details.items() if d.get("same_orders_as")}
        result.reason = _reason(fitting[0], ranked, mach.memory_gib, aliases)
        return result
    built = [c for c in ranked if c.evaluated]
    if not built:
        reasons = "; ".join(sorted({f"{c.schedule}: {c.error}" for c in ranked}))
        raise PlanError(f"no schedule could be built for these inputs: {reasons}", result)
    closest = min(built, key=lambda c: c.peak_bytes)
    message = _nothing_fits(closest, mach.memory_gib)
    if suggest:
        ideas = _suggestions(
            model=spec,
            machine=mach,
            dtype=prec.name,
            seq_len=seq_len,
            microbatch_size=microbatch_size,
            num_microbatches=num_microbatches,
            pp=pp,
            dp=dp,
            dp_shard=dp_shard,
            reserve_gib=reserve_gib,
            virtual_stages=virtual_stages,
            policies=[label for label, _ in policies],
            closest=closest,
        )
        message += " What would fit: " + "; ".join(ideas) + "." if ideas else " No single change tried fits."
    result.reason = message
    raise PlanError(message, result)


def _mark_useless(candidates: list[Candidate]) -> None:
    """Flag offload and recompute candidates that are a plainer candidate at a cost (`Candidate.useless`):
    an offload that moves nothing, or one slower than the same schedule and recompute without offload
    for no lower activation peak; a recompute slower than the schedule without recompute or offload for
    no lower activation peak."""
    plain = {(c.name, c.recompute): c for c in candidates if c.offload == "none" and c.evaluated}
    for c in candidates:
        if not c.evaluated or (c.offload == "none" and c.recompute == "none"):
            continue
        if c.offload != "none" and c.offloaded_share == 0:
            c.useless = "moves nothing: no chunk's forward-to-backward window hides a copy out and back"
            continue
        if c.offload.endswith(":close-w") and c.pulled_w == 0:
            c.useless = "moves no W next to its I: the plan of the order as given (as without close-w)"
            continue
        for base, what in (
            (plain.get((c.name, c.recompute)) if c.offload != "none" else None, "without offload"),
            (plain.get((c.name, "none")) if c.recompute != "none" else None, "without recompute"),
        ):
            if base is None or base is c or base.step_time is None or c.step_time is None:
                continue
            slower = c.step_time > base.step_time * (1 + _TIE)
            if slower and c.activation_peak >= base.activation_peak:
                c.useless = (
                    f"{100 * (c.step_time / base.step_time - 1):+.1f}% step time for no lower activation "
                    f"peak ({c.activation_peak / GIB:.1f} GiB, as {what})"
                )
                break


def _schedule_names(schedules: Iterable[str] | None) -> list[str]:
    if schedules is None:
        return list(SCHEDULES)
    if isinstance(schedules, str):
        schedules = [schedules]
    names: list[str] = []
    for s in schedules:
        name = canonical_schedule(s)
        if name not in names:
            names.append(name)
    if not names:
        raise ValueError("schedules must name at least one schedule")
    return names


def _recompute_modes(recompute: Iterable[str] | str | None) -> list[str]:
    """The recompute plans to try, from none (every recompute candidate's reference) to the most recompute:
    by mode, then by share of the layers."""
    if recompute is None:
        recompute = DEFAULT_RECOMPUTE
    if isinstance(recompute, str):
        recompute = [recompute]
    modes = [check_recompute(str(r).strip().lower()) for r in recompute]
    if not modes:
        raise ValueError("recompute must list at least one mode ('none', 'selective', 'full')")

    def amount(label: str) -> tuple[int, float, int, bool]:
        plan = parse_recompute(label)
        return RECOMPUTE.index(plan.mode), plan.share, RECOMPUTE.index(plan.rest), plan.once

    return sorted(set(modes), key=amount)


def _policies(offload: Iterable[Any] | None) -> list[tuple[str, Any]]:
    from pp_offload.order.offload import OffloadPolicy, resolve_offload

    if offload is None:
        offload = DEFAULT_OFFLOAD
    elif isinstance(offload, (str, float)):
        offload = [offload]
    out: list[tuple[str, Any]] = []
    for value in offload:
        policy = resolve_offload(value)
        if policy.mode == "auto":
            raise ValueError(
                "offload='auto' depends on the transfer/compute ratio the planner already models; list "
                "explicit policies ('none', 'selective:0.5', 'full', ...) and let the planner compare them"
            )
        if not policy.enabled:
            label = "none"
        elif policy.mode == "full":
            label = "full"
        elif policy.mode == "budget":
            if policy.fraction is not None:
                label = f"budget:{policy.fraction:g}"
            elif policy.max_slowdown == OffloadPolicy().max_slowdown:
                label = "budget"
            else:
                label = f"budget:auto:{policy.max_slowdown:g}"
            if policy.close_w:
                label += ":close-w"
            if policy.granularity == "sublayer":
                label += ":sublayer"
        elif policy.count is not None:
            label = f"selective:{policy.count} chunks"
        else:
            label = f"selective:{policy.fraction:g}"
        if label not in [lab for lab, _ in out]:
            out.append((label, policy))
    if not out:
        raise ValueError("offload must list at least one policy (e.g. 'none')")
    return out


def _evaluate_all(names, policies, common, limit_bytes, mode, progress, jobs, evaluate_dominated, modes):
    """Candidates of every schedule (in ``names`` order) and recompute mode, and per-schedule details;
    schedules run in ``jobs`` worker processes (orders and offload plans are pure-Python work).

    Recompute modes other than ``"none"`` run after it: a schedule that fits with neither offload nor
    recompute gets its recompute candidates listed as skipped (never faster) unless ``evaluate_dominated``.
    """
    from tqdm import tqdm

    bar = tqdm(
        total=len(names) * len(policies) * len(modes),
        desc="plan",
        unit="candidate",
        disable=None if progress else True,  # None: tqdm draws only when stderr is a terminal
        file=sys.stderr,
        leave=False,
    )
    candidates: list[Candidate] = []
    details: dict[str, dict[str, Any]] = {}
    fits_plain: set[str] = set()
    try:
        for recompute in modes:
            skip = set() if (recompute == "none" or evaluate_dominated) else fits_plain
            found, info = _evaluate_mode(
                names,
                policies,
                {**common, "recompute": recompute},
                limit_bytes,
                mode,
                jobs,
                evaluate_dominated,
                skip,
                bar,
            )
            candidates += found
            for name, entry in info.items():
                details.setdefault(name, entry)
                if recompute != "none":
                    details[name].setdefault("recompute", {})[recompute] = {
                        k: entry[k] for k in ("chunk_costs_s", "stage_activation_bytes", "stage_times_s")
                    }
            if recompute == "none":
                fits_plain = {c.schedule for c in found if c.offload == "none" and c.evaluated and c.fits}
    finally:
        bar.close()
    return candidates, details


def _evaluate_mode(names, policies, common, limit_bytes, mode, jobs, evaluate_dominated, skip, bar):
    """`_evaluate_all` for one recompute mode (``common["recompute"]``); schedules in ``skip`` are listed
    as skipped (they fit without offload or recompute)."""
    recompute = common["recompute"]
    setups = {name: setup_schedule(name, **common) for name in names}
    if "ScheduleVAdaptive" in setups:
        choose_adaptive_limit(
            setups["ScheduleVAdaptive"], limit_bytes=limit_bytes, num_microbatches=common["num_microbatches"]
        )
    # V schedules with equal caps get the same orders: the adaptive schedule at V-Half's cap is V-Half
    alias: dict[str, str] = {}
    keys = {name: _order_key(setups[name], common) for name in names}
    if keys.get("ScheduleVAdaptive") is not None:
        for other in ("ScheduleVMin", "ScheduleVHalf", "ScheduleVZB"):
            if keys.get(other) == keys["ScheduleVAdaptive"]:
                alias["ScheduleVAdaptive"] = other
                break
    results: dict[str, tuple[list[Candidate], dict[str, Any]]] = {}
    for name in names:
        if name in skip and name not in alias:
            results[name] = (
                [
                    Candidate(
                        name,
                        label,
                        memory_limit=setups[name].memory_limit,
                        recompute=recompute,
                        skipped="fits without offload or recompute, which are never faster",
                    )
                    for label, _ in policies
                ],
                _details(
                    setups[name], None, simulation_sizes(common["pp"], common["num_microbatches"], name)
                ),
            )
            bar.update(len(policies))
    tasks = [n for n in names if n not in alias and n not in results]
    tasks.sort(key=lambda n: (not n.startswith("ScheduleV"), names.index(n)))  # slowest first
    args = (
        policies,
        common["num_microbatches"],
        limit_bytes,
        mode,
        common["virtual_stages"],
        evaluate_dominated,
    )
    workers = min(jobs or os.cpu_count() or 1, len(tasks))
    if workers <= 1:
        for name in tasks:
            bar.set_postfix_str(name)
            results[name] = _evaluate_schedule(setups[name], *args)
            bar.update(len(policies) * (1 + sum(1 for a in alias.values() if a == name)))
    else:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            futures = {pool.submit(_evaluate_schedule, setups[n], *args): n for n in tasks}
            for future in as_completed(futures):
                name = futures[future]
                results[name] = future.result()
                bar.set_postfix_str(name)
                bar.update(len(policies) * (1 + sum(1 for a in alias.values() if a == name)))
    candidates: list[Candidate] = []
    details: dict[str, dict[str, Any]] = {}
    for name in names:
        if name in alias:
            source, info = results[alias[name]]
            setup = setups[name]
            for c in source:
                copy = replace(c, schedule=name, memory_limit=setup.memory_limit)
                copy.peak_units, copy.activation = list(c.peak_units), list(c.activation)
                copy.memory, copy.breakdown = list(c.memory), [dict(b) for b in c.breakdown]
                candidates.append(copy)
            details[name] = {
                **_details(setup, None, info["simulated_microbatches"]),
                "same_orders_as": alias[name],
            }
        else:
            found, info = results[name]
            candidates += found
            details[name] = info
    return candidates, details


def _evaluate_schedule(
    setup: Setup,
    policies,
    num_microbatches: int,
    limit_bytes: int,
    mode: str,
    virtual_stages: int,
    evaluate_dominated: bool,
) -> tuple[list[Candidate], dict[str, Any]]:
    """One schedule: build its orders once, replay them under every offload policy (after the first that
    fits without offload, only with ``evaluate_dominated``: offload never makes an order faster)."""
    sizes = simulation_sizes(setup.layout.num_ranks, num_microbatches, setup.schedule)
    orders = None
    if setup.problem is None:
        orders = build_orders(setup, sizes, search=mode, virtual_stages=virtual_stages)
    error = setup.problem or (orders.error if orders else None)
    out = []
    fits_plain = False
    for label, policy in sorted(policies, key=lambda p: p[0] != "none"):
        cand = Candidate(setup.schedule, label, memory_limit=setup.memory_limit, recompute=setup.recompute)
        if error is not None:
            cand.error = error
        elif label != "none" and setup.schedule in SINGLE_STAGE:
            cand.skipped = "single-stage torch schedule: its executor cannot run OFFLOAD/RELOAD actions"
        elif fits_plain and not evaluate_dominated:
            cand.skipped = "fits without offload, which is never slower"
        else:
            try:
                summary, _ = predict(setup, orders, policy, num_microbatches)
                _fill(cand, setup, summary, limit_bytes)
            except Exception as e:  # one failing replay must not sink the plan
                cand.error = f"{type(e).__name__}: {e}"
            fits_plain = fits_plain or (label == "none" and cand.error is None and cand.fits)
        out.append(cand)
    return out, _details(setup, orders, sizes)


def _order_key(setup: Setup, common: dict[str, Any]) -> tuple | None:
    """Orders of V schedules depend only on (cap, sizes, costs): V-Adaptive at V-Half's cap is V-Half."""
    from pp_offload.order import vshape

    if not setup.schedule.startswith("ScheduleV") or setup.problem is not None:
        return None
    d = setup.layout.num_ranks
    caps = {"ScheduleVMin": vshape.v_min_cap(d), "ScheduleVHalf": vshape.v_half_cap(d), "ScheduleVZB": 2 * d}
    cap = caps.get(setup.schedule, setup.memory_cap)
    sizes = simulation_sizes(d, common["num_microbatches"], setup.schedule)
    return (float(cap), setup.costs, tuple(sizes), setup.recompute)


def _fill(cand: Candidate, setup: Setup, summary: dict[str, Any], limit_bytes: int) -> None:
    cand.pipeline_time = summary["makespan"]
    cand.bubble = summary["bubble"]
    cand.peak_units = summary["peak_units"]
    cand.activation = summary["activation"]
    cand.reload_wait = summary["reload_wait"]
    cand.offloaded_share = summary["offloaded_share"]
    cand.moved_share = summary["moved_share"]
    cand.pulled_w = summary["pulled_w"]
    cand.extrapolated = summary["extrapolated"]
    for rank, act in enumerate(cand.activation):
        state = setup.state[rank]
        parts = {
            "params": state.params,
            "grads": state.grads,
            "optimizer": state.optimizer,
            "recv_buffers": setup.recv[rank],
            "activations": act,
            "transient": setup.transient[rank],
            "reserve": setup.reserve,
        }
        cand.breakdown.append(parts)
        cand.memory.append(sum(parts.values()))
    cand.over_bytes = max(0, cand.peak_bytes - limit_bytes)
    cand.fits = cand.over_bytes == 0


def _details(setup: Setup, orders, sizes: list[int]) -> dict[str, Any]:
    return {
        "num_stages": setup.layout.num_stages,
        "placement": setup.layout.placement,
        "layers_per_stage": setup.layers,
        "chunk_costs_s": {k: getattr(setup.costs, k) for k in ("F", "I", "W", "comm", "transfer")},
        "stage_activation_bytes": [asdict(st.activation) for st in setup.stages],
        "stage_times_s": [asdict(st.times) for st in setup.stages],
        "memory_cap_units": setup.memory_cap,
        "memory_limit": setup.memory_limit,
        "simulated_microbatches": sizes + ([orders.exact.sizes[0]] if orders and orders.exact else []),
        "order_seconds": orders.build_seconds if orders else 0.0,
        "problem": setup.problem or (orders.error if orders else None),
    }


def _dp_sync_seconds(c: Candidate, dp: int, machine: Machine) -> float:
    """Ring all-reduce of the largest rank's gradients over ``dp`` replicas, after the pipeline."""
    if dp <= 1 or not c.breakdown:
        return 0.0
    grads = max(parts["grads"] for parts in c.breakdown)
    return 2.0 * (dp - 1) / dp * grads / machine.p2p_bandwidth


def _rank(
    candidates: list[Candidate],
    names: Sequence[str],
    policies: Sequence[str],
    modes: Sequence[str] = RECOMPUTE,
) -> list[Candidate]:
    def key(c: Candidate):
        extra = modes.index(c.recompute)
        if not c.evaluated:
            failed = 2 if c.error else 1.5
            return (failed, 0.0, 0, extra, 0, names.index(c.schedule), policies.index(c.offload))
        # equal step times (within 1e-6) tie: no offload first, no recompute, then lower memory, then the
        # listed order
        step = round(math.log(c.step_time), 6) if c.step_time and c.step_time > 0 else 0.0
        return (
            0 if c.fits else 1,
            step,
            policies.index(c.offload),
            extra,
            c.peak_bytes,
            names.index(c.schedule),
        )

    return sorted(candidates, key=key)


def _seconds(t: float) -> str:
    return f"{t:.3g} s" if t >= 1 else f"{1e3 * t:.3g} ms"


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.1f} GiB"


def _reason(best: Candidate, ranked: list[Candidate], memory_gib: float, aliases: dict[str, str]) -> str:
    text = (
        f"fastest that fits in {memory_gib:g} GiB: {best.label}, {_seconds(best.step_time)} per step, "
        f"device peak {_gib(best.peak_bytes)} (rank {best.peak_rank})"
    )
    faster = [c for c in ranked if c.evaluated and not c.fits and c.step_time < best.step_time * (1 - _TIE)]
    if faster:
        seen, shown = set(), []
        for c in faster:
            if c.name in seen:
                continue
            seen.add(c.name)
            shown.append(f"{c.label} does not fit by {_gib(c.over_bytes)}")
            if len(shown) == 2:
                break
        text += "; faster but too large: " + ", ".join(shown)

    def alias(c: Candidate) -> bool:  # the same orders under another name (V-Adaptive at a fixed cap)
        return aliases.get(c.schedule) == best.schedule or aliases.get(best.schedule) == c.schedule

    same = [
        c
        for c in ranked
        if c is not best
        and c.evaluated
        and c.fits
        and c.useless is None
        and not alias(c)
        and abs(c.step_time / best.step_time - 1) <= _TIE
    ]
    if same:
        text += f"; ties on time with {same[0].label} ({_gib(same[0].peak_bytes)})"
    return text


def _nothing_fits(closest: Candidate, memory_gib: float) -> str:
    parts = closest.breakdown[closest.peak_rank]
    state = parts["params"] + parts["grads"] + parts["optimizer"]
    return (
        f"nothing fits in {memory_gib:g} GiB per GPU: the smallest peak, {closest.label}, needs "
        f"{_gib(closest.peak_bytes)} on rank {closest.peak_rank}, {_gib(closest.over_bytes)} too much "
        f"(parameters + gradients + optimizer {_gib(state)}, activations {_gib(parts['activations'])}, "
        f"receive buffers {_gib(parts['recv_buffers'])}, transient + reserve "
        f"{_gib(parts['transient'] + parts['reserve'])})."
    )


def _suggestions(
    *,
    model,
    machine,
    dtype,
    seq_len,
    microbatch_size,
    num_microbatches,
    pp,
    dp,
    dp_shard,
    reserve_gib,
    virtual_stages,
    policies,
    closest,
) -> list[str]:
    """Single changes that would fit, each sized by a memory-only plan of the low-memory schedules."""
    base = {
        "seq_len": seq_len,
        "microbatch_size": microbatch_size,
        "num_microbatches": num_microbatches,
        "pp": pp,
        "dp": dp,
        "dp_shard": dp_shard,
    }
    variants: list[tuple[str, dict[str, Any]]] = []
    if "full" not in policies:
        variants.append(("full activation offload", {}))
    if microbatch_size > 1:
        half = microbatch_size // 2
        variants.append(
            (
                f"microbatch size {half} with {num_microbatches * 2} microbatches",
                {"microbatch_size": half, "num_microbatches": num_microbatches * 2},
            )
        )
    for factor in (2, 4):
        if 2 * pp * factor <= model.num_layers + 2:
            variants.append((f"pp={pp * factor}", {"pp": pp * factor}))
            break
    if dp > 1 and not dp_shard:
        variants.append((f"optimizer state sharded over dp={dp} (dp_shard)", {"dp_shard": True}))
    ideas = []
    for label, change in variants:
        settings = {**base, **change}
        try:
            trial = plan(
                model,
                **settings,
                machine=machine,
                dtype=dtype,
                schedules=("ScheduleVMin", "ScheduleVHalf"),
                offload=("none", "full"),
                virtual_stages=virtual_stages,
                search="memory",
                reserve_gib=reserve_gib,
                suggest=False,
                jobs=1,
            )
        except PlanError:
            continue
        fit = min((c for c in trial.candidates if c.fits), key=lambda c: c.peak_bytes)
        ideas.append(f"{label} ({fit.label}: {_gib(fit.peak_bytes)})")
    need = closest.peak_bytes / GIB
    gpu = f"a GPU with at least {need:.1f} GiB"
    larger = [m for m in MACHINES.values() if m.memory_gib >= need and m.memory_gib > machine.memory_gib]
    if larger:
        gpu += f" (e.g. {larger[0].name}, {larger[0].memory_gib:g} GiB)"
    ideas.append(gpu)
    return ideas


def _assumptions(spec: ModelSpec, dtype: str, mode: str, dp: int, dp_shard: bool) -> list[str]:
    notes = [
        "sdpa/flash attention without padding mask (no seq^2 tensor saved); model in "
        f"{dtype}{' with fp32 master weights' if dtype != 'fp32' else ''}; AdamW with fp32 moments",
        "pass times from matmul FLOPs / (peak x MFU); simulator costs per chunk from the busiest rank",
        "torch keeps a receive buffer per microbatch for each stage's input and output gradient; "
        "step(..., return_outputs=False) assumed (else the last stage keeps every microbatch's logits)",
        "loss computed after the last stage's forward (its fp32 log-probabilities are not offloaded)",
        f"our V orders built with search={mode!r}; step times from the orders of all m microbatches, "
        "or, past the planner's time budget, extrapolated from three sizes a whole steady-phase period "
        "apart after checking the phase is reached (pp_offload.plan.evaluate.simulation_sizes)",
    ]
    if dp > 1:
        notes.append(
            f"dp={dp}: gradient all-reduce after the pipeline, not overlapped"
            + ("; optimizer state sharded over dp" if dp_shard else "")
        )
    if not activation_is_modelled(spec.hidden_act):
        notes.append(f"activation {spec.hidden_act!r} assumed to save only its input")
    if spec.resid_dropout > 0 or spec.embd_dropout > 0:
        notes.append("dropout masks counted as 1 byte per element")
    return notes
