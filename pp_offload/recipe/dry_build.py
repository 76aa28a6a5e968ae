"""``--check`` builds what every pipeline rank builds before step 1, in one process and with no process
group: the split on the meta device, the recompute wrappers, the schedule's order lowered by torch, the
offload plan with its figures and its OFFLOAD/RELOAD actions in that order.

Why: the config checks (`pp_offload.recipe.preflight`) read the config; they cannot see a combination that
only fails when the pieces meet (an offload policy whose units the figures do not count, a recompute plan
whose wrappers hide the layers offload hooks, an order torch refuses to lower). Building the pieces with
the same functions the ranks call (`pp_offload.recipe.pipeline.split_for_rank`, `apply_recompute`,
`rank_schedule`) on stand-in stages (torch's ``PipelineStage`` spec, as torch's own schedule visualizer
mocks it) means a config that passes ``--check`` then fails at start-up only for what no single process
can see: data on other ranks, devices, the network, FSDP's sharding (``pipeline.dp > 1`` is built
unsharded here), memory.

``schedule: auto``: the ranks build the probe pipeline, measure a step and build the pipeline they pick.
``--check`` builds the probe, then the pick the planner's model predicts for this model on the machine
preset (`pp_offload.plan.probe.predicted_measurement`, no measurement), and says so: the ranks measure and
may pick another candidate, which they build with the same functions.

Everything on the meta device costs no memory. Every rank makes the same offload plan (it covers all
ranks), so the build makes it once (`_one_plan_for_all_ranks`); for Llama-3-8B at pp 4 the whole build
then takes about 2 s, most of it that plan (`bench/bench_dry_build.py`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch
from torch import nn

from pp_offload.recipe.config import ConfigError, RecipeConfig
from pp_offload.recipe.topology import Topology, device_for, machine_preset

__all__ = ["DryBuild", "RankBuild", "dry_build"]


@dataclass(frozen=True)
class RankBuild:
    """What one pipeline rank builds: its stages, their decoder layers, the layers wrapped for recompute, how
    many actions its lowered order holds (0 for torch's single-stage schedules, which run without one), and
    the offload plan's share of it (chunks moved whole or by layer, and OFFLOAD/RELOAD actions)."""

    rank: int
    stages: tuple[int, ...]
    layers: tuple[int, ...]
    recomputed: int
    actions: int
    offloaded_chunks: int = 0
    copy_actions: int = 0


@dataclass
class DryBuild:
    """The result of `dry_build`: the pipeline every rank builds (``ranks``), under which schedule, offload
    policy and recompute plan, the notes on what it could not build as the ranks will, and its time."""

    schedule: str
    offload: str
    recompute: str
    ranks: list[RankBuild] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> str:
        """One line on what was built (schedule, ranks, split, recompute, offload plan), then the notes."""
        moved = sum(r.offloaded_chunks for r in self.ranks)
        copies = sum(r.copy_actions for r in self.ranks)
        lines = [
            f"built on the meta device in {self.seconds:.1f} s: {self.schedule} on {len(self.ranks)} "
            f"pipeline ranks, layers per stage {_layers(self.ranks)}, recompute {self.recompute}, "
            f"offload {self.offload}"
            + (f" ({moved} chunks planned, {copies} OFFLOAD/RELOAD actions lowered)" if copies else "")
        ]
        return "\n".join(lines + [f"note: {n}" for n in self.notes])


def _layers(ranks: list[RankBuild]) -> list[int]:
    """Decoder layers of every stage, stage 0 first."""
    per_stage = {s: n for r in ranks for s, n in zip(r.stages, r.layers, strict=True)}
    return [per_stage[s] for s in sorted(per_stage)]


def dry_build(config: RecipeConfig, topo: Topology, tokenizer: Any) -> DryBuild:
    """Build every pipeline rank's share of the run (module doc) from ``config`` as ``topo``'s ranks will,
    on the meta device. Raises `ConfigError` (one line) naming the rank and the part that fails, with the
    error the ranks would raise."""
    from pp_offload.parallel import checkpointing_mode
    from pp_offload.recipe.auto import is_auto
    from pp_offload.recipe.model_loading import meta_model

    start = time.perf_counter()
    model = meta_model(config, tokenizer)
    notes: list[str] = []
    inputs = None
    if is_auto(config):
        from pp_offload.recipe.auto import probe_config

        probe = _build_ranks(probe_config(config), model, topo, None, what="schedule: auto's probe pipeline")
        picked, inputs, note = _planner_pick(config, model, topo, _layers(probe))
        notes.append(note)
        if picked is None:
            return DryBuild("auto (probe)", "-", "-", probe, notes, time.perf_counter() - start)
        config = picked
        model = meta_model(picked, tokenizer)  # a fresh one: the probe's wrappers and hooks are on the first
    if topo.dp > 1:
        notes.append(
            f"built unsharded: FSDP over the pipeline.dp={topo.dp} replicas needs their process group"
        )
    ranks = _build_ranks(config, model, topo, inputs, what="the pipeline")
    notes += _split_notes(config)
    return DryBuild(
        schedule=str(config.pipeline.schedule),
        offload=str(config.pipeline.offload or "none"),
        recompute=checkpointing_mode(config.train.activation_checkpointing) or "none",
        ranks=ranks,
        notes=notes,
        seconds=time.perf_counter() - start,
    )


def _split_notes(config: RecipeConfig) -> list[str]:
    """One line on what ``pipeline.deferred_w: false`` does here (nothing by default): torch's split on a
    split-backward schedule, or nothing at all on a schedule without split backward (it runs one backward
    per microbatch either way), so the user does not expect its memory from it."""
    from pp_offload.runtime.catalog import schedule_info

    info = schedule_info(config.pipeline.schedule)
    if config.pipeline.deferred_w:
        return []
    if not info.split_backward:
        return [f"pipeline.deferred_w=false changes nothing on {info.name}: it has no split backward"]
    return [
        f"pipeline.deferred_w=false: {info.name} splits backward with torch's retained graph (saved tensors "
        "held from I to W instead of the weight-gradient queue; a checkpointed layer runs 3 times per "
        "microbatch); the planner's figures (budget offload, schedule: auto) count that split"
    ]


def _build_ranks(
    config: RecipeConfig, model: nn.Module, topo: Topology, inputs: Any, *, what: str
) -> list[RankBuild]:
    """Every pipeline rank's split, recompute wrappers and schedule (with its offload plan)."""
    from pp_offload.runtime.catalog import schedule_info

    info = schedule_info(config.pipeline.schedule)
    device = device_for(config, topo)
    with _one_plan_for_all_ranks():
        return [_build_rank(config, model, topo, inputs, info, device, rank, what) for rank in range(topo.pp)]


def _build_rank(
    config: RecipeConfig,
    model: nn.Module,
    topo: Topology,
    inputs: Any,
    info: Any,
    device: torch.device,
    rank: int,
    what: str,
) -> RankBuild:
    """Pipeline rank ``rank``'s share, built by the functions `build_pipeline` calls; a failure is the
    one-line `ConfigError` naming the rank, the part and the error the rank would raise."""
    from pp_offload.models import TokenCrossEntropy
    from pp_offload.recipe.pipeline import apply_recompute, rank_schedule, split_for_rank
    from pp_offload.runtime import compat

    spec = config.pipeline
    num_stages = topo.pp * info.stages_per_rank(spec.stages_per_rank)
    part = "split"
    try:
        split = split_for_rank(config, model, info, pp=topo.pp, pp_rank=rank)
        part = "recompute wrappers"
        recomputed = apply_recompute(config, split)
        part = "schedule and offload plan"
        stages = [_stand_in(split.stages[s], s, num_stages, rank, topo.pp) for s in split.stage_indices]
        schedule = rank_schedule(
            config,
            model,
            info,
            split,
            stages,
            TokenCrossEntropy(),
            pp=topo.pp,
            dp=topo.dp,
            device=device,
            offload_inputs=inputs,
            log=rank == 0,  # the line rank 0 prints on where the offload figures come from
        )
    except ConfigError:
        raise
    except Exception as error:  # what the rank would raise at start-up, as one configuration line
        reason = " ".join(str(error).split()) or type(error).__name__
        raise ConfigError(
            f"--check: pipeline rank {rank} cannot build {what} ({spec.schedule}, offload "
            f"{spec.offload or 'none'}, activation_checkpointing "
            f"{config.train.activation_checkpointing}): {part}: {reason}"
        ) from error
    plan = getattr(getattr(schedule, "offload", None), "plan", None)
    lowered = compat.lowered_order(schedule)[rank] if compat.is_runtime_schedule(schedule) else []
    return RankBuild(
        rank=rank,
        stages=tuple(split.stage_indices),
        layers=tuple(split.layers_per_stage[s] for s in split.stage_indices),
        recomputed=recomputed,
        actions=len(lowered),
        offloaded_chunks=len(plan.offloaded.get(rank, ())) if plan is not None else 0,
        copy_actions=sum(compat.action_parts(a)[1] in ("OFFLOAD", "RELOAD") for a in lowered),
    )


@contextlib.contextmanager
def _one_plan_for_all_ranks() -> Iterator[None]:
    """Plan offload once for every rank of the build. Why: the plan covers all ranks (the planner's global
    order), so every rank computes the same one; ``--check`` builds every rank in one process and would
    otherwise pay for it once per rank (4 x 2.5 s for Llama-3-8B at pp 4). The plan of an order, costs,
    policy and figures already planned in this build is the same object again."""
    from pp_offload.runtime import offload

    plans: dict[str, Any] = {}
    original = offload.plan_offload

    def plan_offload(order: Any, costs: Any, policy: Any, **kwargs: Any) -> Any:
        peaks = kwargs.get("peaks")
        figures = getattr(peaks, "__self__", peaks)  # OffloadInputs.peaks: the inputs it is bound to
        key = repr(
            (
                sorted((r, list(map(str, a))) for r, a in order.items()),
                costs,
                policy,
                figures,
                {k: v for k, v in kwargs.items() if k != "peaks"},
            )
        )
        if key not in plans:
            plans[key] = original(order, costs, policy, **kwargs)
        return plans[key]

    offload.plan_offload = plan_offload
    try:
        yield
    finally:
        offload.plan_offload = original


def _stand_in(module: nn.Module, index: int, num_stages: int, rank: int, pp: int) -> Any:
    """A stand-in for the ``PipelineStage`` rank ``rank`` builds around ``module``: torch's spec of the class
    with the attributes schedules and offload read (as torch's schedule visualizer builds its stages)."""
    from torch.distributed.pipelining import PipelineStage

    stage = mock.NonCallableMagicMock(spec=PipelineStage)  # autospec's signature checks: 30x slower
    stage.group_rank, stage.group_size, stage.num_stages, stage.stage_index = rank, pp, num_stages, index
    stage.submod = module
    stage.device = torch.device("cpu")  # where the activation store would copy from: nothing is copied
    stage.is_first, stage.is_last = index == 0, index == num_stages - 1
    return stage


def _planner_pick(
    config: RecipeConfig, model: nn.Module, topo: Topology, layers_per_stage: list[int]
) -> tuple[Any, Any, str]:
    """``schedule: auto``'s pick as the planner's model predicts it (no probe measurement): the config the
    ranks would build from it, its offload figures and a note saying so; (None, None, note) when the
    planner cannot model this run."""
    from pp_offload.models.lora import unwrap_peft
    from pp_offload.parallel import checkpointing_mode
    from pp_offload.plan.auto import AutoError
    from pp_offload.plan.probe import predicted_measurement
    from pp_offload.recipe.auto import choose_within, chosen_config, recompute_candidates

    spec = config.pipeline
    device = device_for(config, topo)
    machine = machine_preset(device)
    microbatch = config.train.global_batch_size // (spec.microbatches * topo.dp)
    try:
        measurement = predicted_measurement(
            unwrap_peft(model).config,
            pp=topo.pp,
            seq_len=config.data.seq_len,
            num_microbatches=spec.microbatches,
            machine=machine,
            microbatch_size=microbatch,
            layers_per_stage=layers_per_stage,  # the probe's split: the pick's figures must match it
            recompute=checkpointing_mode(config.train.activation_checkpointing) or "none",  # the probe's
            deferred_w=spec.deferred_w,  # the split the probe runs (pipeline.deferred_w)
        )
        decision = choose_within(config, measurement, recompute_candidates(config, model, device))
    except (AutoError, ValueError) as error:
        reason = " ".join(str(error).split())
        return (
            None,
            None,
            (
                f"schedule: auto: only the probe pipeline was built; the planner's model of this run on the "
                f"{machine} preset picks nothing to build ({reason[:200]}); the ranks measure and pick"
            ),
        )
    picked = chosen_config(config, decision)
    note = (
        "schedule: auto: built the probe pipeline and the pick the planner's model predicts on the "
        f"{machine} preset ({decision.schedule}, offload {decision.offload}, recompute "
        f"{checkpointing_mode(picked.train.activation_checkpointing) or 'none'}), not a measurement: the "
        "ranks measure a probe step and may pick another candidate"
    )
    return picked, decision.offload_inputs, note
