"""Every check of the pipeline section that needs no process group: schedule name, batch split, layers vs
stages, options that go together.

Why: run on every rank (and in the launcher) before joining the group, so a bad config stops all ranks
alike, at once, instead of leaving some waiting in a collective for a rank that already died.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pp_offload.recipe.config import ConfigError, RecipeConfig
from pp_offload.recipe.topology import Topology
from pp_offload.runtime.catalog import ScheduleInfo, schedule_info

__all__ = ["preflight"]

_OURS_ONLY = ("costs", "memory_limit")


def preflight(config: RecipeConfig, topo: Topology, num_layers: int | None) -> ScheduleInfo:
    """Every check that needs no process group: schedule name, batch split, layers vs stages, options.

    Run on every rank before joining the group, so a bad config stops all ranks alike, at once.
    """
    spec = config.pipeline
    auto = str(spec.schedule).lower() == "auto"
    if auto:
        _check_auto(spec)
        probe = dataclasses.replace(spec, schedule="ScheduleVMin", offload="full")
        config = dataclasses.replace(config, pipeline=probe)
        spec = config.pipeline
    try:
        info = schedule_info(spec.schedule)
    except ValueError as error:
        raise ConfigError(f"pipeline.schedule: {error}") from error
    try:
        per_rank = info.stages_per_rank(spec.stages_per_rank)
    except ValueError as error:
        raise ConfigError(f"pipeline.stages_per_rank: {error}") from error
    num_stages = topo.pp * per_rank
    if spec.microbatches < 1:
        raise ConfigError(f"pipeline.microbatches must be >= 1, got {spec.microbatches}")
    local_batch = config.train.global_batch_size // topo.dp
    if config.train.global_batch_size % topo.dp or local_batch % spec.microbatches:
        raise ConfigError(
            f"train.global_batch_size={config.train.global_batch_size} must split into pipeline.dp="
            f"{topo.dp} replicas x pipeline.microbatches={spec.microbatches} microbatches; pick a batch "
            f"size that is a multiple of {topo.dp * spec.microbatches}"
        )
    if info.module != "pp_offload.runtime.schedules":
        given = [key for key in _OURS_ONLY if getattr(spec, key) is not None]
        if given:
            raise ConfigError(f"pipeline.{given[0]} applies to pp_offload's schedules only, not {info.name}")
    if spec.activation_budget_gib is not None and not auto:
        raise ConfigError(
            "pipeline.activation_budget_gib goes with pipeline.schedule=auto (which picks a schedule within "
            f"it); with a named schedule ({info.name}) use ScheduleVAdaptive's memory_limit or offload"
        )
    if (spec.memory_limit is not None) != (info.name == "ScheduleVAdaptive") and not auto:
        raise ConfigError(
            "pipeline.memory_limit (a fraction of 1F1B's activation memory, e.g. 0.5) goes with "
            f"pipeline.schedule=ScheduleVAdaptive and only with it (schedule: {info.name}, "
            f"memory_limit: {spec.memory_limit})"
        )
    if num_layers is not None and num_layers < num_stages:
        raise ConfigError(
            f"the model has {num_layers} layers, fewer than the {num_stages} pipeline stages "
            f"({topo.pp} ranks x {per_rank} stages per rank for {info.name}): "
            + _fewer_stages_fix(info, num_layers, topo.world)
        )
    if spec.layers_per_stage is not None and len(spec.layers_per_stage) != num_stages:
        raise ConfigError(
            f"pipeline.layers_per_stage has {len(spec.layers_per_stage)} entries but there are {num_stages} "
            "stages"
        )
    if spec.offload not in (None, "none") and not info.multi_stage:
        raise ConfigError(
            f"pipeline.offload needs a multi-stage schedule; {info.name} is single-stage: use e.g. "
            "ScheduleVHalf or ScheduleInterleaved1F1B"
        )
    _check_compile(config, info, auto=auto)
    return info


def _check_compile(config: RecipeConfig, info: ScheduleInfo, *, auto: bool = False) -> None:
    """``train.compile``'s value, the recompute plans it cannot compile (`pp_offload.runtime.compile`), and
    torch's retained-graph split (``pipeline.deferred_w: false``) on a split-backward schedule, which runs a
    compiled layer's backward in both I and W (wrong gradients; the runtime would refuse it too, in
    `pp_offload.runtime.deferred_w.refuse_compiled_split`, but only after every rank loaded its weights)."""
    from pp_offload.parallel import checkpointing_mode
    from pp_offload.runtime.compile import CompileOptions, check_recompute_compiles

    try:
        options = CompileOptions.coerce(config.train.compile)
        if options is not None:
            check_recompute_compiles(checkpointing_mode(config.train.activation_checkpointing))
    except ValueError as error:
        raise ConfigError(str(error)) from error
    if options is not None and not config.pipeline.deferred_w and info.split_backward:
        which = f"schedule: auto (its probe runs {info.name})" if auto else info.name
        raise ConfigError(
            f"train.compile with pipeline.deferred_w=false on {which}: torch's retained-graph split runs a "
            "compiled layer's backward twice (in I and in W: wrong gradients); set pipeline.deferred_w=true "
            "(the default), turn train.compile off, or use a schedule without split backward "
            "(ScheduleInterleaved1F1B)"
        )


def _fewer_stages_fix(info: ScheduleInfo, num_layers: int, world: int) -> str:
    """What to change when the model has fewer layers than stages, for this schedule's placement; with
    ``world`` processes, the ``--dp`` that keeps them all busy with fewer pipeline ranks."""
    if info.placement == "loop":
        return "set fewer pipeline.stages_per_rank, use fewer pipeline ranks, or a model with more layers"
    v = info.placement == "v"
    ranks = num_layers // 2 if v else num_layers
    if ranks < 1:
        return "use a single-stage schedule (Schedule1F1B), or a model with more layers"
    why = " (a V schedule holds 2 stages per rank)" if v else " (one stage each)"
    fix = f"use at most {ranks} pipeline rank{'s' if ranks > 1 else ''}{why}"
    pp = max(d for d in range(1, min(ranks, world) + 1) if world % d == 0)
    if world > 1:
        dp = world // pp
        ranks_word = f"{pp} pipeline rank{'s' if pp > 1 else ''}"
        replicas = f"{dp} data-parallel replicas"
        fix += f": with {world} processes, --dp {dp} (pipeline.dp={dp}: {ranks_word} x {replicas})"
    return f"{fix}; or a model with more layers"


def _check_auto(spec: Any) -> None:
    """``schedule: auto`` chooses schedule, offload and costs itself; it takes only the memory limits and,
    as ``offload``, a list of the offload policies it may choose from."""
    given = [k for k in ("costs", "layers_per_stage", "stages_per_rank") if getattr(spec, k) is not None]
    if spec.offload not in (None, "none") and not isinstance(spec.offload, list):
        given.insert(0, "offload")
    if given:
        raise ConfigError(
            f"pipeline.{given[0]} cannot be set with pipeline.schedule=auto (auto chooses the schedule, the "
            "offload policy and the costs from a probe step); remove it, or name a schedule instead of auto"
            + (" (a list of offload policies auto may choose from is fine)" if given[0] == "offload" else "")
        )
    if isinstance(spec.offload, list):
        from pp_offload.plan.auto import offload_candidates

        try:
            offload_candidates(spec.offload)
        except ValueError as error:
            raise ConfigError(f"pipeline.offload (auto's candidates): {error}") from error
    limit = spec.memory_limit
    if limit is not None and not (isinstance(limit, (int, float)) and 0 < limit <= 1):
        raise ConfigError(
            f"pipeline.memory_limit={limit!r}: a fraction of 1F1B's activation memory in (0, 1], e.g. 0.5"
        )
    budget = spec.activation_budget_gib
    if budget is not None and not (isinstance(budget, (int, float)) and budget > 0):
        raise ConfigError(f"pipeline.activation_budget_gib={budget!r} must be a number of GiB > 0")
    steps = spec.auto_probe_steps
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"pipeline.auto_probe_steps={steps!r} must be an int >= 1")
