"""FSDP2 on pipeline stages, wrapped the one way that gives correct gradients with split backward.

`apply_fsdp(split, mesh, mixed_precision=...)` shards each stage module of this rank over the
data-parallel ranks: every decoder layer is its own FSDP unit (one all-gather / reduce-scatter per layer),
then the stage root (embedding, final norm, LM head, rotary buffers) is the stage's root unit. torch's
pipeline runtime (``_PipelineScheduleRuntime``, under every pp_offload schedule and torch's multi-stage
ones) recognises a stage whose ``submod`` is an ``FSDPModule`` and drives it: UNSHARD before a stage's
first pass, RESHARD when the stage goes idle, no gradient sync during its backward passes and one
REDUCE_GRAD after its last one. So gradients are reduce-scattered once per step per stage.

Why ``reshard_after_forward=False`` (and why ``True`` is refused under split backward): torch's split
backward looks the stage's weights up as ``submod.parameters()`` twice per microbatch: when the I pass
starts (``stage_backward_input`` keeps, for the W pass, the autograd paths that lead to those weights'
gradient accumulators) and when the W pass starts (``stage_backward_weight`` maps each kept accumulator
back to a weight). FSDP2 registers a unit's *unsharded* parameters on its modules while the unit is
unsharded and its *sharded* DTensor parameters otherwise. A layer unit that reshards after its forward
(``reshard_after_forward=True``, FSDP2's default for non-root units) is sharded or unsharded at those two
moments depending on which passes ran in between (another microbatch's forward reshards it, a backward
unshards it), so the I pass may miss the parameters the forward used (their W-pass gradient for that
microbatch is never computed: silently wrong or missing weight gradients; torch 2.13, CPU/gloo,
ScheduleZBVZeroBubble: up to 96% off on some layers, none at all on others) or the W pass may not find
them (``KeyError: <AccumulateGrad ...>`` in ``stage_backward_weight``: our V schedules). With ``False`` a
unit stays unsharded from the runtime's UNSHARD to its RESHARD, which the runtime issues around whole
stages, and always unshards before a stage's pass, so both lookups see the parameters the forward used.
torchtitan uses ``False`` under pipeline parallelism too. A full backward (B) looks nothing up and is
right either way (tested with Interleaved1F1B): pass ``split_backward=False`` to allow ``True`` there.
Memory: torch's runtime keeps up to 3 stages unsharded (its prefetch window), so with 2 stages per rank
both stay unsharded for the whole step; FSDP then saves gradient, optimizer-state and between-step
parameter memory (resharded at REDUCE_GRAD), not parameter memory inside a step.

Why the reduction is a sum: the loss of a step is the token cross entropy summed over every token of the
*global* batch, divided by the global target count (`pp_offload.models.TokenCrossEntropy`), so each data
parallel rank's gradient is already its share of the global gradient and the reduction must add them.
FSDP2 averages by default; the divide factor is set to 1 and the collectives are forced to plain
``ReduceOp.SUM`` (a divide factor other than the group size otherwise uses ``PREMUL_SUM``, which gloo
does not implement: "Cannot use ReduceOp.PREMUL_SUM with Gloo"). HSDP adds an all-reduce SUM over the
replicas.

A weight shared by two stage modules of one rank (V placement puts stage 0 and stage 2d-1 on rank 0, so a
tied input embedding / LM head is one ``Parameter`` used by both) cannot be sharded: FSDP2 places each
parameter in exactly one unit, a unit belongs to one root, and each stage module must be its own root
(the runtime reduces and reshards per stage; a unit reached from two roots fails FSDP's lazy
initialisation: "FSDP state has already been lazily initialized ... requires running forward through the
root module first", both for a shared unit and for ``fully_shard([embedding, head])``). It is therefore
kept whole on every data-parallel rank (``ignored_params`` of both roots: not sharded, not reduced by FSDP)
and its gradient, the sum of both stages' uses, is all-reduced (SUM) over the data-parallel ranks once
per step, after the schedule's step: `ShardedStages.attach` arranges that (a training forward of such a
stage before ``attach`` raises, so the reduction cannot be forgotten). Its cost is the memory of one
unsharded embedding (and its optimizer state) on pipeline rank 0 only. A tie whose two ends sit on
different pipeline ranks (loop placement) is two ordinary sharded parameters, one per rank; their
shards cover the same slices, so summing the two ranks' local gradient shards (the recipe's cross-rank
tie) stays correct under FSDP.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

from pp_offload.models.split import KeptLayers, ModelSplit
from pp_offload.parallel.mesh import data_parallel_mesh
from pp_offload.recompute_plan import parse_recompute
from pp_offload.runtime import compat

__all__ = [
    "CHECKPOINTING_MODES",
    "ShardedStages",
    "activation_checkpointing",
    "apply_fsdp",
    "checkpointed_mode",
    "checkpointing_mode",
    "clip_grad_norm_",
    "grad_norm",
    "mixed_precision_policy",
]

_PRECISIONS = {
    None: MixedPrecisionPolicy(),
    "fp32": MixedPrecisionPolicy(),
    # parameters all-gathered and used in bf16, gradients reduced (and accumulated by FSDP) in fp32
    "bf16": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
}


def mixed_precision_policy(precision: str | MixedPrecisionPolicy | None) -> MixedPrecisionPolicy:
    """The FSDP policy for the recipe's ``train.precision`` (``"fp32"``, ``"bf16"``) or a policy as is."""
    if isinstance(precision, MixedPrecisionPolicy):
        return precision
    if precision not in _PRECISIONS:
        raise ValueError(
            f"mixed_precision must be None, 'fp32', 'bf16' or a MixedPrecisionPolicy, got {precision!r}"
        )
    return _PRECISIONS[precision]


@dataclass
class ShardedStages:
    """This rank's stage modules after `apply_fsdp`.

    ``modules``: stage index -> the stage module, now an ``FSDPModule`` root (the same objects that were
    passed in: build the ``PipelineStage``s on them). ``replicated``: parameters shared by two stage
    modules of this rank, kept whole; their gradients are summed over ``mesh`` by
    `reduce_replicated_grads` (once per step, after all of the step's backward passes).
    """

    modules: dict[int, nn.Module]
    mesh: DeviceMesh
    replicated: tuple[nn.Parameter, ...]
    reshard_after_forward: bool
    _attached: set[int] = field(default_factory=set, repr=False)

    def reduce_replicated_grads(self, before_step: Mapping[int, torch.Tensor | None] | None = None) -> None:
        """Sum the replicated parameters' gradients over the data-parallel ranks.

        ``before_step``: gradients the parameters held before the step began (already reduced by an
        earlier call); they are added back after the reduction, so gradient accumulation over several
        steps stays a sum. A parameter without a gradient contributes zeros (every data-parallel rank of
        one pipeline rank holds the same replicated parameters, so the collectives always match).
        """
        if not self.replicated:
            return
        groups = [self.mesh.get_group(dim) for dim in range(self.mesh.ndim)]
        for param in self.replicated:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            for group in groups:
                if dist.get_world_size(group) > 1:
                    dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=group)
            earlier = None if before_step is None else before_step.get(id(param))
            if earlier is not None:
                param.grad += earlier

    def _require_attached(self, module: nn.Module, args: Any) -> None:
        if self._attached or not torch.is_grad_enabled():
            return
        raise RuntimeError(
            "a training forward of a stage holding a weight shared by two of this rank's stages (a tied "
            "embedding / LM head under V placement) before ShardedStages.attach(schedule): without it that "
            "weight's gradient is never summed over the data-parallel ranks; call attach after building "
            "the schedule"
        )

    def attach(self, schedule: Any) -> None:
        """Check that ``schedule`` drives these FSDP roots and reduce the replicated gradients after each
        of its steps (a no-op wrapper when nothing is replicated).

        Call once, after building the schedule on ``PipelineStage``s of ``modules``."""
        if id(schedule) in self._attached:
            raise ValueError("this schedule is already attached")
        stages = (
            compat.schedule_stages(schedule) if compat.is_runtime_schedule(schedule) else _stages_of(schedule)
        )
        ours = {id(m) for m in self.modules.values()}
        for stage in stages:
            if id(stage.submod) not in ours:
                raise ValueError(
                    f"stage {stage.stage_index}'s module is not one of the FSDP roots apply_fsdp wrapped "
                    f"(stages {sorted(self.modules)}): build each PipelineStage on ShardedStages.modules[s]"
                )
        self._attached.add(id(schedule))
        if not self.replicated:
            return

        def step_then_reduce(step_microbatches: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            earlier = {id(p): p.grad for p in self.replicated}
            for param in self.replicated:
                param.grad = None
            result = step_microbatches(*args, **kwargs)
            self.reduce_replicated_grads(earlier)
            return result

        compat.wrap_step_microbatches(schedule, step_then_reduce)


def _stages_of(schedule: Any) -> list[Any]:
    stage = getattr(schedule, "_stage", None)
    if stage is None:
        raise TypeError(f"{type(schedule).__name__} is not a torch pipeline schedule")
    return [stage]


def _stage_modules(
    modules: ModelSplit | Mapping[int, nn.Module] | Sequence[nn.Module] | nn.Module,
) -> dict[int, nn.Module]:
    if isinstance(modules, ModelSplit):
        return dict(modules.stages)
    if isinstance(modules, nn.Module):
        return {getattr(modules, "stage_index", 0): modules}
    if isinstance(modules, Mapping):
        return dict(modules)
    return {getattr(m, "stage_index", i): m for i, m in enumerate(modules)}


def _decoder_layers(stage: nn.Module) -> list[nn.Module]:
    """The per-layer FSDP units of a stage: the layers held in its `KeptLayers`."""
    return [layer for module in stage.modules() if isinstance(module, KeptLayers) for layer in module]


def _shared_parameters(stages: Iterable[nn.Module]) -> list[nn.Parameter]:
    """Parameters that appear in more than one of ``stages`` (a tied embedding / LM head under V)."""
    seen: dict[int, int] = {}
    params: dict[int, nn.Parameter] = {}
    for stage in stages:
        for param in {id(p): p for p in stage.parameters()}.values():
            seen[id(param)] = seen.get(id(param), 0) + 1
            params[id(param)] = param
    return [params[k] for k, n in seen.items() if n > 1]


def _cast_inputs_to(dtype: torch.dtype) -> Callable[..., Any]:
    """Forward pre-hook: floating inputs to ``dtype`` (a replicated fp32 weight under a bf16 policy)."""

    def hook(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(a.to(dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args)

    return hook


def apply_fsdp(
    modules: ModelSplit | Mapping[int, nn.Module] | Sequence[nn.Module] | nn.Module,
    mesh: DeviceMesh,
    *,
    mixed_precision: str | MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = False,
    split_backward: bool = True,
    layers: Callable[[nn.Module], Iterable[nn.Module]] | None = None,
) -> ShardedStages:
    """Shard this rank's stage modules with FSDP2 over the data-parallel part of ``mesh``.

    modules: a `ModelSplit` (its ``stages``), ``{stage_index: module}``, a list of stage modules, or one.
        Apply before building the ``PipelineStage``s (they must hold the FSDP roots as ``submod``) and
        before creating the optimizer (the parameters become sharded DTensors).
    mesh: the job's mesh from `pp_offload.parallel.build_mesh` (its data-parallel part is used) or a
        data-parallel mesh (1-D: FSDP; 2-D ``(replicate, shard)``: HSDP).
    mixed_precision: ``None``/``"fp32"``, ``"bf16"`` (bf16 parameters in forward/backward, fp32 gradient
        reduction) or a ``MixedPrecisionPolicy``.
    reshard_after_forward: must stay False with split backward (see the module docstring: True gives
        wrong weight gradients); True is accepted with ``split_backward=False`` (schedules that only run
        full backward passes, e.g. ScheduleInterleaved1F1B).
    split_backward: whether the schedule splits backward into I and W (`ScheduleInfo.split_backward`).
    layers: the per-layer units of a stage module (default: the decoder layers of a `CausalLMStage`).
    """
    if reshard_after_forward is not False and split_backward:
        raise ValueError(
            f"reshard_after_forward={reshard_after_forward!r} with a split-backward (I/W) schedule gives "
            "wrong weight gradients: torch's I and W passes each look the stage's weights up as "
            "submod.parameters(), and a layer resharded after its forward shows its sharded parameters "
            "instead of the unsharded ones the forward used at one of them, so the W pass computes no "
            "gradient for them (silently with ScheduleZBVZeroBubble, a KeyError in stage_backward_weight "
            "with others). Keep reshard_after_forward=False (the pipeline runtime reshards whole stages "
            "between uses), or pass split_backward=False for a schedule without I/W passes"
        )
    stages = _stage_modules(modules)
    if not stages:
        raise ValueError("apply_fsdp got no stage modules")
    for index, stage in stages.items():
        if isinstance(stage, FSDPModule):
            raise ValueError(f"stage {index}'s module is already an FSDP module; apply_fsdp wraps it once")
    policy = mixed_precision_policy(mixed_precision)
    dp_mesh = data_parallel_mesh(mesh)
    find_layers = layers if layers is not None else _decoder_layers
    shared = _shared_parameters(stages.values())
    ignored = set(shared)
    kwargs: dict[str, Any] = {
        "mesh": dp_mesh,
        "reshard_after_forward": reshard_after_forward,
        "mp_policy": policy,
        "ignored_params": ignored,
    }
    units: list[nn.Module] = []
    for stage in stages.values():
        for layer in find_layers(stage):
            units.append(fully_shard(layer, **kwargs))
        units.append(fully_shard(stage, **kwargs))
    for unit in units:
        assert isinstance(unit, FSDPModule)
        unit.set_gradient_divide_factor(1.0)  # our loss is already normalised over the global batch
        unit.set_force_sum_reduction_for_comms(True)  # SUM, not PREMUL_SUM(1.0): gloo has no PREMUL_SUM
    if shared and policy.param_dtype is not None:
        owners = {
            id(module)
            for stage in stages.values()
            for module in stage.modules()
            for p in module.parameters(recurse=False)
            if p in ignored
        }
        for stage in stages.values():
            for module in stage.modules():
                if id(module) in owners:
                    dtype = next(p.dtype for p in module.parameters(recurse=False) if p in ignored)
                    module.register_forward_pre_hook(_cast_inputs_to(dtype))
                    owners.discard(id(module))
    sharded = ShardedStages(
        modules=stages, mesh=dp_mesh, replicated=tuple(shared), reshard_after_forward=reshard_after_forward
    )
    for stage in stages.values():
        if any(p in ignored for p in stage.parameters()):
            # before FSDP's own pre-hook: fail before any all-gather, on every dp rank alike
            stage.register_forward_pre_hook(sharded._require_attached, prepend=True)
    return sharded


CHECKPOINTING_MODES = ("full", "selective", "mlp")
"""`activation_checkpointing` modes: ``full`` recomputes a layer's whole forward from its input,
``selective`` keeps the outputs of matmuls and attention kernels and recomputes the rest
(`pp_offload.runtime.recompute`), ``mlp`` does that for the layer's ``mlp`` submodule only (its
activation function and gated product: the recompute that frees the most bytes per byte of HBM traffic,
`pp_offload.plan.recompute_groups`)."""


def _checkpointed(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _selective(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return checkpoint(forward, *args, use_reentrant=False, context_fn=_selective_context(), **kwargs)


def _checkpointed_once(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    from pp_offload.runtime.recompute_once import checkpoint_once

    return checkpoint_once(forward, *args, **kwargs)


def _selective_once(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    from pp_offload.runtime.recompute_once import checkpoint_once

    return checkpoint_once(forward, *args, context_fn=_selective_context(), **kwargs)


def _selective_context() -> Callable[[], Any]:
    from pp_offload.runtime.recompute import selective_context

    return selective_context()  # eager: our dispatch modes; compiled: torch's selective-checkpoint policy


_WRAPPERS: dict[tuple[str, bool], Callable[..., Any]] = {
    ("full", False): _checkpointed,
    ("selective", False): _selective,
    ("mlp", False): _selective,
    ("full", True): _checkpointed_once,
    ("selective", True): _selective_once,
    ("mlp", True): _selective_once,
}
"""The forward wrapper of each (mode, once) (`pp_offload.recompute_plan.RecomputePlan.once`)."""

_MODE_OF = {wrapper: key for key, wrapper in _WRAPPERS.items() if key[0] != "mlp"}
"""(mode, once) of a wrapper found on a layer's own forward; on its ``mlp`` a selective one means mlp."""

_NOT_WRAPPED = ("none", False)


def _target(layer: nn.Module, mode: str) -> nn.Module:
    """The module a mode checkpoints: the layer, or (``mlp``) its ``mlp`` submodule (Hugging Face's
    decoder layers of Llama-family models and GPT-2 name it so)."""
    if mode != "mlp":
        return layer
    mlp = getattr(layer, "mlp", None)
    if not isinstance(mlp, nn.Module):
        raise ValueError(
            f"recompute mode 'mlp' checkpoints a layer's `mlp` submodule; {type(layer).__name__} has none "
            "(use 'selective' or 'full')"
        )
    return mlp


def _wrapper_of(module: nn.Module) -> Callable[..., Any] | None:
    forward = vars(module).get("forward")
    if isinstance(forward, functools.partial) and forward.func in _WRAPPERS.values():
        return forward.func
    return None


def checkpointed_mode(layer: nn.Module) -> tuple[str, bool]:
    """How ``layer`` is checkpointed now, as (mode, once): its own forward wrapped (``full``/
    ``selective``), its ``mlp``'s (``mlp``), or not at all (``("none", False)``)."""
    own = _wrapper_of(layer)
    if own is not None:
        return _MODE_OF[own]
    mlp = getattr(layer, "mlp", None)
    inner = _wrapper_of(mlp) if isinstance(mlp, nn.Module) else None
    if inner is not None and _MODE_OF[inner][0] == "selective":
        return ("mlp", _MODE_OF[inner][1])
    return _NOT_WRAPPED


def checkpointing_mode(value: Any) -> str | None:
    """The recipe's ``train.activation_checkpointing`` as a plan string: ``false``/``"none"`` -> None,
    ``true`` -> ``"full"``, ``"full"``/``"selective"`` and those on a share of each stage's layers
    (``"selective:0.75"``, `pp_offload.recompute_plan`) in canonical form; anything else raises ValueError
    naming the choices."""
    if value is False or value is None or value == "none":
        return None
    if value is True:
        return "full"
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            plan = parse_recompute(value)
            if plan.mode != "none":
                return plan.label
    raise ValueError(
        f"activation checkpointing must be false, true, 'full', 'selective', 'mlp', or one of them with a "
        f"share, 'selective:S' for the first share S in (0, 1] of each stage's layers, got {value!r}; 'full' "
        "recomputes each decoder layer from its input, 'selective' keeps matmul and attention outputs, "
        "'mlp' recomputes the MLP's activation and product only; '+once' after any of them "
        "('selective+once') recomputes once per microbatch under split backward"
    )


def _unwrap(layer: nn.Module, inner: Callable[..., Any]) -> None:
    """Give ``layer`` back the forward a checkpointing wrapper wrapped: its class's own (the instance
    attribute goes) or whatever instance forward it had before."""
    if getattr(inner, "__self__", None) is layer and getattr(inner, "__func__", None) is type(layer).forward:
        del layer.forward
    else:
        layer.forward = inner


def activation_checkpointing(
    modules: ModelSplit | Mapping[int, nn.Module] | Sequence[nn.Module] | nn.Module,
    *,
    layers: Callable[[nn.Module], Iterable[nn.Module]] | None = None,
    mode: str = "full",
) -> int:
    """Recompute the decoder layers of the stage modules in backward; returns how many layers it wrapped.

    ``mode`` may name a share of each stage's layers, ``"selective:0.75"`` (`pp_offload.recompute_plan`):
    then only the first ``ceil(0.75 x n)`` of a stage's ``n`` layers (``layers(stage)`` order) are
    checkpointed and the others keep everything (unwrapped again if an earlier call wrapped them), as the
    planner's `pp_offload.plan.memory.chunk_activation` counts them. ``"none"`` unwraps every layer.

    mode ``"full"``: a checkpointed layer saves only its inputs in forward (non-reentrant
    ``torch.utils.checkpoint``): it saves them as autograd saved tensors, so the activation store's hooks
    see them, and under offload a layer's input moves to host memory like any activation (the first
    layer's input is the stage's own input, which the pipeline holds anyway and the store leaves in
    place); nothing inside the layer reaches the store.

    mode ``"selective"``: the layer also keeps the outputs of matmuls and attention kernels
    (`pp_offload.runtime.recompute.SAVED_OPS`; not its trailing matmul, which a recomputation never
    reaches) and recomputes only the cheap ops (norms, rotary,
    activation functions, products): less recompute time than ``full``, far fewer bytes than no
    checkpointing. Under offload the kept outputs belong to the chunk (or, with a budget policy, the
    layer) being captured, so they move to host memory and back with it.

    mode ``"mlp"``: ``"selective"`` on the layer's ``mlp`` submodule only (its matmul outputs kept, its
    activation function and gated product recomputed; norms, rotary and attention keep everything): about
    half of selective's bytes for a quarter of its recompute traffic on a Llama layer
    (`pp_offload.plan.recompute_groups`).

    Parameter names are unchanged: the layer's own ``forward`` is replaced by a checkpointed call of it
    (an instance attribute), inside the module call, so FSDP's forward hooks (all-gather, reshard) run
    once around it and never during recomputation, which reads the parameters the pipeline runtime keeps
    unsharded for the whole backward of the stage.

    Cost with split backward: the I and the W pass each recompute the layer's forward once (they are two
    autograd calls, and one shared recomputation would have to keep the layer's activations alive from
    I to W, which is what checkpointing avoids); a full backward (B) recomputes it once; torch's stage 0
    (no input gradient) runs its whole backward at W, once (`pp_offload.recompute_plan.recomputations`, the
    rule the planner charges). W makes one autograd call per parameter group; checkpointing a layer installs
    `pp_offload.runtime.compat.share_weight_pass_recomputation` so that they share one recomputation.
    A ``+once`` plan (``"selective+once"``) recomputes in I only and keeps what it recomputed for W
    (`pp_offload.runtime.recompute_once`): two runs per microbatch instead of three, the layer's
    activations held on the device from I to W.
    Idempotent; a second call with another mode switches the layers to it. Apply before or after
    `apply_fsdp`, before the first step.
    """
    try:
        plan = parse_recompute(mode)
    except ValueError:
        plan = None
    if plan is None:
        raise ValueError(
            f"mode must be one of {CHECKPOINTING_MODES}, or one of them with a share ('selective:0.75'), "
            f"or 'none' (undo), got {mode!r}"
        )
    find_layers = layers if layers is not None else _decoder_layers
    if plan.mode != "none":
        compat.share_weight_pass_recomputation()
    wrapped = 0
    for stage in _stage_modules(modules).values():
        found = list(find_layers(stage))
        for layer, mode in zip(found, plan.modes(len(found)), strict=True):
            want = (mode, plan.once and mode != "none")
            current = checkpointed_mode(layer)
            if current == want:
                continue
            if current != _NOT_WRAPPED:  # another mode, or out of the share
                target = _target(layer, current[0])
                _unwrap(target, vars(target)["forward"].args[0])
            if want != _NOT_WRAPPED:
                target = _target(layer, mode)
                target.forward = functools.partial(_WRAPPERS[want], target.forward)
                wrapped += 1
    return wrapped


def grad_norm(
    parameters: Iterable[nn.Parameter], mesh: DeviceMesh, *, skip: Iterable[int] = ()
) -> torch.Tensor:
    """The 2-norm of the whole model's gradient, the same on every rank (fp64, on the CPU).

    ``parameters``: this rank's (e.g. ``ModelSplit.module.parameters()``); ``mesh``: the job's mesh (its
    ``"pp"`` dimension sums the pipeline's stages; without one, only data parallelism is assumed);
    ``skip``: ids of parameters not to count (the second copy of a weight tied across pipeline ranks).

    Why not ``torch.nn.utils.clip_grad_norm_``: it sees one rank's gradients, and a V rank holding the
    replicated tied weight mixes plain and DTensor gradients, which torch's foreach kernels refuse. Here a
    sharded gradient contributes its local shard, summed over the mesh dimensions it is sharded on (not
    over HSDP replicas, which hold the same shard), a replicated one counts once (every data-parallel rank
    holds all of it), and the total is summed over the pipeline ranks.
    """
    from torch.distributed.tensor import DTensor

    skipped = set(skip)
    whole = torch.zeros((), dtype=torch.float64)
    sharded: dict[tuple[int, tuple[int, ...]], list[Any]] = {}
    for param in parameters:
        grad = param.grad
        if grad is None or id(param) in skipped:
            continue
        if isinstance(grad, DTensor):
            dims = tuple(i for i, placement in enumerate(grad.placements) if placement.is_shard())
            entry = sharded.setdefault(
                (id(grad.device_mesh), dims), [grad.device_mesh, torch.zeros_like(whole)]
            )
            entry[1] += grad.to_local().detach().double().pow(2).sum().cpu()
        else:
            whole += grad.detach().double().pow(2).sum().cpu()
    for (_, dims), (grad_mesh, total) in sorted(sharded.items(), key=lambda item: item[0][1]):
        reduced = total.to(grad_mesh.device_type)
        for dim in dims:
            dist.all_reduce(reduced, group=grad_mesh.get_group(dim))
        whole += reduced.cpu()
    if "pp" in (mesh.mesh_dim_names or ()):
        pipeline = whole.to(mesh.device_type)
        dist.all_reduce(pipeline, group=mesh["pp"].get_group())
        whole = pipeline.cpu()
    return whole.sqrt()


def clip_grad_norm_(
    parameters: Iterable[nn.Parameter], max_norm: float, mesh: DeviceMesh, *, skip: Iterable[int] = ()
) -> torch.Tensor:
    """Scale every gradient so that the whole model's gradient norm is at most ``max_norm``; returns the
    norm before clipping (see `grad_norm`). Skipped parameters are scaled too (they only do not count)."""
    params = [p for p in parameters if p.grad is not None]
    total = grad_norm(params, mesh, skip=skip)
    from torch.distributed.tensor import DTensor

    for kind in (True, False):  # torch's foreach kernels refuse a mix of DTensor and plain gradients
        group = [p for p in params if isinstance(p.grad, DTensor) is kind]
        if group:
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total.float())
    return total
