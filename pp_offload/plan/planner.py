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
microbatch, sharded optimizer state, full offload, torch's retained-graph split, a larger GPU), each sized
by the same model.

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

This module checks the inputs and puts the answer together; the records are in `pp_offload.plan.result`,
the evaluation of every candidate in `pp_offload.plan.sweep`, the ranking and its reasons in
`pp_offload.plan.ranking`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from pp_offload.plan.auto import DEFAULT_RECOMPUTE as AUTO_RECOMPUTE
from pp_offload.plan.evaluate import simulation_sizes
from pp_offload.plan.machines import MACHINES, Machine, resolve_machine
from pp_offload.plan.memory import RECOMPUTE, check_recompute, precision
from pp_offload.plan.model import model_spec
from pp_offload.plan.orders import SCHEDULES, canonical_schedule, resolve_search
from pp_offload.plan.ranking import (
    _assumptions,
    _dp_sync_seconds,
    _gib,
    _mark_useless,
    _nothing_fits,
    _rank,
    _reason,
)
from pp_offload.plan.result import GIB, Candidate, PlanError, PlanResult
from pp_offload.plan.sweep import _evaluate_all
from pp_offload.recompute_plan import parse_recompute

__all__ = ["DEFAULT_OFFLOAD", "Candidate", "PlanError", "PlanResult", "plan"]

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
    deferred_w: bool = True,
    compare_split: bool = True,
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
    deferred_w: how split-backward schedules split their backward (the recipe's ``pipeline.deferred_w``,
        ``pp-offload plan --split``): deferred weight gradients (default: the queue held from I to W,
        recompute in I only) or torch's retained-graph split (``False``: saved tensors held until W, a
        recomputation in I and another in W). Schedules without split backward are the same either way.
    compare_split: when the pick recomputes on a split-backward schedule, also evaluate it (that one
        schedule, offload policy and recompute plan) under the other split: ``PlanResult.other_split``.
        Why only then: without recompute deferred W holds less from I to W than torch's split and runs no
        slower, so there is nothing to weigh; with recompute torch's split may give the lower peak.
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
    if not isinstance(deferred_w, bool):
        raise TypeError(f"deferred_w must be True (deferred W) or False (torch's split), got {deferred_w!r}")
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
        "deferred_w": deferred_w,
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
        "deferred_w": deferred_w,
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
        if compare_split:
            result.other_split = _under_other_split(
                fitting[0],
                model=spec,
                machine=mach,
                dtype=prec.name,
                deferred_w=not deferred_w,
                **{k: common[k] for k in _SAME_SETTING},
                search=search,
                reserve_gib=reserve_gib,
            )
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
            deferred_w=deferred_w,
        )
        message += " What would fit: " + "; ".join(ideas) + "." if ideas else " No single change tried fits."
    result.reason = message
    raise PlanError(message, result)


_SAME_SETTING = ("seq_len", "microbatch_size", "num_microbatches", "pp", "dp", "dp_shard", "virtual_stages")


def _under_other_split(pick: Candidate, **setting: Any) -> Candidate | None:
    """``pick`` planned under the other backward split (``setting["deferred_w"]``), or None where there is
    nothing to weigh: a pick without recompute, or a schedule without split backward. One schedule, one
    offload policy and one recompute plan are evaluated, a small share of a whole plan's time."""
    from pp_offload.runtime.catalog import schedule_info

    if pick.recompute == "none" or not schedule_info(pick.schedule).split_backward:
        return None
    try:
        trial = plan(
            setting.pop("model"),
            schedules=(pick.schedule,),
            offload=(pick.offload,),
            recompute=(pick.recompute,),
            suggest=False,
            compare_split=False,
            jobs=1,
            **setting,
        )
    except PlanError as error:  # it does not fit under the other split: still its figures
        trial = error.result
    except ValueError:  # a policy label that does not read back as a policy ("selective:3 chunks")
        return None
    if trial is None:
        return None
    found = [c for c in trial.candidates if c.evaluated]
    return found[0] if found else None


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
    deferred_w=True,
) -> list[str]:
    """Single changes that would fit, each sized by a memory-only plan of the low-memory schedules."""
    base = {
        "seq_len": seq_len,
        "microbatch_size": microbatch_size,
        "num_microbatches": num_microbatches,
        "pp": pp,
        "dp": dp,
        "dp_shard": dp_shard,
        "deferred_w": deferred_w,
    }
    variants: list[tuple[str, dict[str, Any]]] = []
    if deferred_w:  # with recompute, torch's split holds the saved tensors from I to W, not the queue
        variants.append(
            (
                "torch's retained-graph split, i.e. --split torch or pipeline.deferred_w: false",
                {"deferred_w": False},
            )
        )
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
                compare_split=False,
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
