"""This rank's share of the pipelined model: split, FSDP2 sharding, recompute wrappers, offload, stages and
the schedule, built in the one order every rank follows; and how the training loop runs it (`Pipeline` is
the recipe's `pp_offload.recipe.runner.Runner` for more than one process).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from pp_offload.models import ModelSplit, TokenCrossEntropy, split_model
from pp_offload.models.evaluate import EvalResult, evaluate_pipeline
from pp_offload.parallel import ShardedStages, clip_grad_norm_, grad_norm
from pp_offload.recipe.config import ConfigError, RecipeConfig
from pp_offload.recipe.offload_figures import planner_offload_inputs
from pp_offload.recipe.runner import Runner
from pp_offload.recipe.timeline import StepTimeline
from pp_offload.recipe.topology import Topology
from pp_offload.runtime import compat
from pp_offload.runtime.catalog import ScheduleInfo, build_schedule, schedule_info, stage_indices
from pp_offload.runtime.compile import CompileOptions, CompileWatch, compile_layers
from pp_offload.runtime.dropout_keys import DropoutKeys, key_pipeline_dropout, unkeyed_dropout
from pp_offload.runtime.progress import StepProgress, track_actions, waiting_peer

__all__ = [
    "Pipeline",
    "apply_recompute",
    "build_pipeline",
    "rank_schedule",
    "refuse_reused_weights",
    "split_for_rank",
    "torch_split_counts_a_reused_weight_once",
]


@dataclass
class Pipeline(Runner):
    """This rank's share of the pipelined model: stages, schedule, loss and the tied-weight fix-up.

    ``mesh``: the job's ``("dp", "pp")`` mesh (``pp`` inner); ``sharded``: the FSDP2 roots when
    ``pipeline.dp > 1`` (None otherwise: every pipeline replica would hold whole stages).
    """

    info: ScheduleInfo
    split: ModelSplit
    schedule: Any
    loss_fn: TokenCrossEntropy
    tied: _TiedAcrossRanks | None
    has_first: bool
    has_last: bool
    mesh: DeviceMesh
    sharded: ShardedStages | None = None
    dropout: DropoutKeys | None = None  # the training loop sets .step (pp_offload.runtime.dropout_keys)
    compile_watch: CompileWatch | None = None  # train.compile: reports compile time after the second step

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def module(self) -> nn.Module:
        return self.split.module

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.mesh["pp"].get_group()

    @property
    def group(self) -> dist.ProcessGroup:
        return self.pp_group

    def skip_in_norm(self) -> set[int]:
        """Ids of parameters not counted in the global gradient norm (the second copy of a tied weight)."""
        return self.tied.skip_in_norm() if self.tied is not None else set()

    def begin_step(self, step: int) -> None:
        if self.dropout is not None:
            self.dropout.step = step

    def forward_backward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """One schedule step: the loss is told the global target count first, the last stage's logits are
        not kept (only the losses are needed), and the masks are decided on the CPU from the batch's
        ``packed_rows`` (no device read)."""
        self.loss_fn.num_target_tokens = int(batch["num_target_tokens"])
        losses: list[torch.Tensor] = []
        kwargs = compat.no_output_kwargs(self.schedule)
        args = (batch["input_ids"],) if self.has_first else ()
        target = batch["labels"] if self.has_last else None
        self.schedule.step(
            *args,
            target=target,
            losses=losses,
            position_ids=batch["position_ids"],
            packed_rows=batch["packed_rows"],
            **kwargs,
        )
        if not losses:
            return torch.zeros((), dtype=torch.float64)
        return torch.stack([loss.detach().double() for loss in losses]).sum()

    def finish_backward(self, where: StepProgress, say: Callable[[str], None]) -> None:
        """Report the compile time once (after the second step); sum a tied weight's two copies' gradients
        where the embedding and the head sit on different ranks."""
        if self.compile_watch is not None:
            self.compile_watch.after_step(say)
        if self.tied is not None:
            where.enter("the tied weight's gradient all-reduce")
            self.tied.sync_grads()

    def grad_norm(self, max_norm: float | None) -> torch.Tensor:
        skip = self.skip_in_norm()
        if max_norm is None:
            return grad_norm(self.module.parameters(), self.mesh, skip=skip)
        return clip_grad_norm_(self.module.parameters(), max_norm, self.mesh, skip=skip)

    def evaluate(self, batches: list[dict[str, torch.Tensor]], microbatches: int) -> EvalResult:
        return evaluate_pipeline(self.schedule, batches, microbatches=microbatches)

    def track(self, where: StepProgress) -> Callable[[], None]:
        return track_actions(self.schedule, where)

    def waiting_peer(self, where: StepProgress) -> int | None:
        ranks = dist.get_process_group_ranks(self.pp_group)
        return waiting_peer(self.schedule, where.action, lambda r: ranks[r])

    def timeline(self, out: Path, rank: int) -> Any:
        if not StepTimeline.supported(self.schedule):
            return None
        return StepTimeline(
            self.schedule, out, rank=rank, title=f"{self.name}, this run", group=self.pp_group
        )


class _TiedAcrossRanks:
    """An input embedding tied to the LM head when the first and last stages sit on different ranks.

    Each of the two ranks holds its own copy; after backward the copies' gradients are summed between the
    two ranks of each pipeline replica, so both take the same optimizer step and stay equal, exactly as
    the one shared weight of the unsplit model would. The last-stage copy is left out of the gradient norm
    and of the export. Under FSDP both copies are sharded the same way over the data-parallel ranks, so
    the two ranks' local shards cover the same slice and summing them is right.
    """

    def __init__(self, model: nn.Module, split: ModelSplit, topo: Topology, num_stages: int, placement: str):
        last = _rank_of(num_stages - 1, topo.pp, placement)
        self.group: dist.ProcessGroup | None = None
        if last != 0:
            for replica in range(topo.dp):  # every rank creates every group, in the same order
                group = dist.new_group([replica * topo.pp, replica * topo.pp + last])
                if replica == topo.dp_rank:
                    self.group = group
        self.weight: nn.Parameter | None = None
        self.is_copy = False
        if 0 in split.stages:
            self.weight = model.get_input_embeddings().weight
        elif num_stages - 1 in split.stages:
            self.weight = model.get_output_embeddings().weight
            self.is_copy = True

    def sync_grads(self) -> None:
        if self.group is None or self.weight is None or not self.weight.requires_grad:
            return  # a frozen embedding (LoRA) has no gradient to share
        if self.weight.grad is None:
            self.weight.grad = torch.zeros_like(self.weight)
        grad = self.weight.grad
        local = grad.to_local() if hasattr(grad, "to_local") else grad  # a DTensor's shard, in place
        dist.all_reduce(local, group=self.group)

    def skip_in_norm(self) -> set[int]:
        return {id(self.weight)} if self.is_copy and self.weight is not None else set()


def _rank_of(stage: int, pp: int, placement: str) -> int:
    if placement == "v":
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def build_pipeline(
    config: RecipeConfig,
    model: nn.Module,
    topo: Topology,
    device: torch.device,
    mesh: DeviceMesh,
    *,
    shard: bool = True,
    offload_inputs: Any = None,
) -> Pipeline:
    """Split ``model`` for this rank, shard it over the data-parallel ranks when ``pipeline.dp > 1`` (and
    ``shard``), and build its ``PipelineStage``s (on this replica's pipeline group) and the schedule.

    ``offload_inputs``: the figures ``schedule: auto`` chose with (`pp_offload.order.offload_inputs`, or
    its ``to_dict``), so the offload plan is the predicted one; without them a budget policy gets the
    planner's figures for this model and machine preset when it can (`pp_offload.recipe.offload_figures`).

    The split, the recompute wrappers and the schedule (its order, offload plan and figures) are built by
    `split_for_rank`, `apply_recompute` and `rank_schedule`, which ``--check`` calls on the meta device
    with stand-in stages (`pp_offload.recipe.dry_build`): what passes the check is what the ranks build."""
    from torch.distributed.pipelining import PipelineStage

    from pp_offload.parallel import apply_fsdp

    spec = config.pipeline
    info = schedule_info(spec.schedule)
    compile_options = CompileOptions.coerce(config.train.compile)  # checked by preflight
    num_stages = topo.pp * info.stages_per_rank(spec.stages_per_rank)
    model.train()
    split = split_for_rank(config, model, info, pp=topo.pp, pp_rank=topo.pp_rank)
    if any(p.is_meta for p in split.module.parameters()):  # a skeleton from load_model(partial=True)
        from pp_offload.models.loading import load_split_weights
        from pp_offload.models.lora import init_adapters, unwrap_peft

        load_split_weights(split, unwrap_peft(model), str(config.model.path))
        if config.lora is not None:
            init_adapters(split.module, seed=config.train.seed)
    split.module.to(device)
    apply_recompute(config, split)
    compile_watch = None
    if compile_options is not None:
        compile_watch = CompileWatch(compile_layers(split.stages.values(), compile_options))
    sharded = None
    if topo.dp > 1 and shard:
        sharded = apply_fsdp(
            split, mesh, mixed_precision=config.train.precision, split_backward=info.split_backward
        )
    tied = None
    if bool(getattr(model.config, "tie_word_embeddings", False)) and info.placement != "v":
        tied = _TiedAcrossRanks(model, split, topo, num_stages, info.placement)  # after FSDP: its params
    group = mesh["pp"].get_group()
    stages = [PipelineStage(split.stages[s], s, num_stages, device, group=group) for s in split.stage_indices]
    loss_fn = TokenCrossEntropy()
    if split.router_aux is not None:  # each of the step's microbatches (all replicas) adds coef x aux / count
        loss_fn.router_aux_weight = split.router_aux.coef / (spec.microbatches * topo.dp)
    schedule = rank_schedule(
        config,
        model,
        info,
        split,
        stages,
        loss_fn,
        pp=topo.pp,
        dp=topo.dp,
        device=device,
        offload_inputs=offload_inputs,
        log=topo.rank == 0,
    )
    if sharded is not None:
        sharded.attach(schedule)
    dropout = key_pipeline_dropout(
        split, schedule, seed=config.train.seed, offset=topo.dp_rank * spec.microbatches
    )
    if topo.rank == 0 and (unkeyed := unkeyed_dropout(model)):
        print(f"dropout: {', '.join(unkeyed)} not keyed: their masks depend on the schedule", flush=True)
    return Pipeline(
        info=info,
        split=split,
        schedule=schedule,
        loss_fn=loss_fn,
        tied=tied,
        has_first=0 in split.stages,
        has_last=num_stages - 1 in split.stages,
        mesh=mesh,
        sharded=sharded,
        dropout=dropout,
        compile_watch=compile_watch,
    )


def split_for_rank(
    config: RecipeConfig, model: nn.Module, info: ScheduleInfo, *, pp: int, pp_rank: int, verify: bool = True
) -> ModelSplit:
    """The stages pipeline rank ``pp_rank`` of ``pp`` holds under ``info``'s placement, split as the config
    asks (``pipeline.layers_per_stage``; ``model.verify_split`` unless ``verify`` is off)."""
    spec = config.pipeline
    per_rank = info.stages_per_rank(spec.stages_per_rank)
    split = split_model(
        model,
        num_stages=pp * per_rank,
        stage_indices=stage_indices(pp_rank, pp, info.placement, per_rank),
        layers_per_stage=spec.layers_per_stage,
        verify=verify and config.model.verify_split,
    )
    refuse_reused_weights(info, split.stages, deferred_w=spec.deferred_w)
    return split


def refuse_reused_weights(info: ScheduleInfo, stages: dict[int, nn.Module], *, deferred_w: bool) -> None:
    """Refuse torch's retained-graph split (``pipeline.deferred_w: false`` on a split-backward schedule) for
    a stage that holds one parameter under two names (a weight tied within the stage, a block shared by
    two of its layers: used twice on the stage's one path) where torch's split counts such a weight's
    gradient twice (pytorch #180952, fixed in torch 2.14; asked of torch itself). A weight used twice
    through one module called twice is not seen here: the split's proof (``model.verify_split``) runs
    unsplit against chained stages, not torch's split."""
    if deferred_w or not info.split_backward:
        return
    for index, module in sorted(stages.items()):
        names: dict[int, list[str]] = {}
        for name, param in module.named_parameters(remove_duplicate=False):
            names.setdefault(id(param), []).append(name)
        shared = [found for found in names.values() if len(found) > 1]
        if shared and not torch_split_counts_a_reused_weight_once():
            raise ConfigError(
                f"pipeline.deferred_w=false on {info.name}: stage {index} uses one weight twice "
                f"({' and '.join(shared[0])}), and torch {torch.__version__}'s retained-graph split adds "
                "such a weight's gradient twice (pytorch #180952, fixed in torch 2.14): keep "
                "pipeline.deferred_w=true (the default), or use torch 2.14 or later"
            )


@functools.cache
def torch_split_counts_a_reused_weight_once() -> bool:
    """Whether torch's split backward (``stage_backward_input`` then ``stage_backward_weight``) gives a
    weight used twice on one path (``x @ w @ w``) the gradient autograd gives it: the behaviour pytorch
    #180952 fixed, asked of the installed torch rather than read from its version."""
    from pp_offload.runtime.compat import stage_backward_input, stage_backward_weight

    start = torch.tensor([[0.4, -0.2], [0.7, 0.3]])
    x = torch.tensor([[1.1, -0.7]])
    w = start.clone().requires_grad_()
    (want,) = torch.autograd.grad((x @ w @ w).sum(), [w])
    weight = nn.Parameter(start.clone())
    inputs = x.clone().requires_grad_()
    _, groups = stage_backward_input([(inputs @ weight @ weight).sum()], None, [inputs], iter([weight]))
    stage_backward_weight(iter([weight]), groups)
    return weight.grad is not None and torch.allclose(weight.grad, want)


def apply_recompute(config: RecipeConfig, split: ModelSplit) -> int:
    """Wrap the split's decoder layers in ``train.activation_checkpointing``'s recompute plan; returns how
    many layers it wrapped (0: no recompute)."""
    from pp_offload.parallel import activation_checkpointing, checkpointing_mode

    recompute = checkpointing_mode(config.train.activation_checkpointing)
    return 0 if recompute is None else activation_checkpointing(split, mode=recompute)


def rank_schedule(
    config: RecipeConfig,
    model: nn.Module,
    info: ScheduleInfo,
    split: ModelSplit,
    stages: list[Any],
    loss_fn: Any,
    *,
    pp: int,
    dp: int,
    device: torch.device,
    offload_inputs: Any = None,
    log: bool = False,
) -> Any:
    """The schedule of this rank's ``stages``: its order lowered by torch, with the offload policy's plan
    (made from ``offload_inputs``, else from the planner's figures for a budget policy,
    `pp_offload.recipe.offload_figures.planner_offload_inputs`) and its OFFLOAD/RELOAD actions in it,
    splitting backward as ``pipeline.deferred_w`` asks (`pp_offload.runtime.catalog.build_schedule`)."""
    from pp_offload.runtime.offload import enable_offload

    spec = config.pipeline
    per_rank = info.stages_per_rank(spec.stages_per_rank)
    offload = spec.offload not in (None, "none")
    if offload and offload_inputs is None:
        offload_inputs = planner_offload_inputs(
            config,
            model,
            schedule=info.name,
            stages_per_rank=per_rank,
            pp=pp,
            dp=dp,
            layers_per_stage=list(split.layers_per_stage),
            device=device,
            log=log,
        )
    figures: dict[str, Any] = {"costs": spec.costs}
    if offload and offload_inputs is not None:
        figures = {"inputs": offload_inputs}
    # pipeline.deferred_w: deferred weight gradients or torch's retained-graph split (split backward only)
    kwargs: dict[str, Any] = {"loss_fn": loss_fn, "scale_grads": False, "deferred_w": spec.deferred_w}
    if info.module == "pp_offload.runtime.schedules":
        kwargs["costs"] = spec.costs  # None with inputs: the order is built from their scalar costs
        if spec.memory_limit is not None:
            kwargs["memory_limit"] = spec.memory_limit
        if offload:
            kwargs["offload"] = spec.offload
            if "inputs" in figures:
                kwargs["offload_inputs"] = figures["inputs"]
    schedule = build_schedule(info, stages, spec.microbatches, **kwargs)
    if info.module != "pp_offload.runtime.schedules" and offload:
        enable_offload(schedule, spec.offload, **figures, device=device)
    return schedule
