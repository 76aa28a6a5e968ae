"""The one place that touches torch's private names (pipelining's runtime, dispatch modes).

torch's multi-stage runtime (`_PipelineScheduleRuntime`), its action type (`_Action`,
`_ComputationType`) and its custom-action hook (`_comp_type_to_function_map`) are private and drift
between releases (we support torch 2.11 to 2.14). Everything else in pp_offload goes through the small
functions here, so a torch upgrade is a one-file change. Version differences are detected by looking at
what the installed torch has (signatures, attributes), never by parsing its version string.

Known drift handled here:
- ``defer_pp_recv`` (a keyword of the runtime's constructor) is newer than torch 2.11.
- ``loss_kwargs`` (``step(..., loss_kwargs=...)``, ``_maybe_compute_loss(..., loss_kwargs)``) is newer
  than torch 2.11.
- ``_check_torch_compile_compatibility`` (refuses split I/W backward on compiled stages) may be absent.
- torch 2.11 warms up the links between neighbouring stages at the first step with a send and a receive
  per neighbour, also when the neighbour is on the same rank (V placement: stages d-1 and d share the last
  rank); gloo has no link to itself and fails with "Pair is not connected". `skip_self_p2p_warmup` drops
  those ops (NCCL never needed them either: a rank's own stages hand tensors over in memory).

One recomputation per weight pass (`share_weight_pass_recomputation`): torch's ``stage_backward_weight``
makes one ``torch.autograd.grad`` call per parameter group, and non-reentrant checkpointing recomputes a
layer once per autograd call, so a checkpointed Llama layer was recomputed 9 times in every W. The W pass is
run under ``torch.utils.checkpoint.GraphExecGroup`` (public since torch 2.10: every backward call under one
group shares one recomputation), installed by replacing the ``stage_backward_weight`` name the stage module
calls; the groups of one W cover disjoint parts of the graph, as the group requires.

Selective recompute (`pp_offload.runtime.recompute`) needs two more private pieces, stable since torch 2.1:
``TorchDispatchMode`` (``torch.utils._python_dispatch``, the base of every dispatch mode, torch's own
selective checkpointing included) and the dispatch-key guard that lets a tensor detached beneath autograd
share its version counter (`views_share_version`). It does not use torch's selective checkpointing
internals (its cache layout changed between 2.11 and 2.13).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch.distributed.pipelining import schedules as _schedules
from torch.distributed.pipelining._backward import (  # noqa: F401  (re-exported for tests and tools)
    stage_backward,
    stage_backward_input,
    stage_backward_weight,
)
from torch.distributed.pipelining.schedules import (
    _Action,
    _ComputationType,
    _PipelineContext,
    _PipelineScheduleRuntime,
)
from torch.utils._python_dispatch import TorchDispatchMode

from pp_offload.order.actions import Action

__all__ = [
    "ActionContext",
    "RuntimeBase",
    "TorchAction",
    "TorchDispatchMode",
    "action_kind",
    "action_parts",
    "check_compile_compatibility",
    "compile_counters",
    "is_compiled_module",
    "wrap_shape_inference_backward",
    "share_weight_pass_recomputation",
    "installed_weight_pass",
    "views_share_version",
    "install_action_handler",
    "is_runtime_schedule",
    "lower_order_offline",
    "lowered_order",
    "make_action",
    "runtime_init_kwargs",
    "schedule_ops",
    "schedule_stages",
    "stage_group_ranks",
    "stage_backward",
    "stage_backward_input",
    "stage_backward_weight",
    "no_output_kwargs",
    "pending_weight_pass",
    "skip_self_p2p_warmup",
    "supports_defer_pp_recv",
    "supports_loss_kwargs",
    "to_torch_action",
    "to_torch_order",
    "STAGE_COMPUTE_METHODS",
    "wrap_stage_compute",
    "wrap_step_microbatches",
]

RuntimeBase = _PipelineScheduleRuntime
"""Base class of every pp_offload schedule: torch's runtime that executes a lowered per-rank order."""

TorchAction = _Action
"""torch's action tuple: (stage_index, computation_type, microbatch_index, sub_actions)."""

ActionContext = _PipelineContext
"""What a custom action handler receives next to the action: ``schedule_ref``, ``arg_mbs``,
``kwarg_mbs``, ``target_mbs``, ``losses``."""


# --- feature detection ----------------------------------------------------------------------------


def supports_defer_pp_recv() -> bool:
    """Whether torch's runtime accepts ``defer_pp_recv`` (not in torch 2.11)."""
    ctor = getattr(_schedules, "ScheduleInterleaved1F1B", None)
    if ctor is None:
        return False
    return "defer_pp_recv" in inspect.signature(ctor.__init__).parameters


def supports_loss_kwargs() -> bool:
    """Whether ``schedule.step(..., loss_kwargs=...)`` exists (not in torch 2.11)."""
    return "loss_kwargs" in inspect.signature(_PipelineScheduleRuntime.step).parameters


def runtime_init_kwargs(*, defer_pp_recv: bool = False) -> dict[str, Any]:
    """Keyword arguments for ``RuntimeBase.__init__`` that only some torch versions know.

    ``defer_pp_recv=False`` is the torch default and is simply not passed where it does not exist;
    asking for ``True`` on such a torch is an error rather than a silent no-op.
    """
    if supports_defer_pp_recv():
        return {"defer_pp_recv": bool(defer_pp_recv)}
    if defer_pp_recv:
        raise ValueError(
            "defer_pp_recv=True needs a torch whose pipelining runtime supports it (newer than 2.11); "
            "upgrade torch or pass defer_pp_recv=False"
        )
    return {}


def check_compile_compatibility(stages: Iterable[Any], schedule_name: str) -> None:
    """Refuse torch.compile'd stages where torch itself refuses them for split I/W backward."""
    check = getattr(_schedules, "_check_torch_compile_compatibility", None)
    if check is not None:
        check(list(stages), schedule_name)


def is_compiled_module(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a ``torch.compile(module)`` wrapper, was compiled in place (``module.compile()``,
    which sets the private ``_compiled_call_impl``), or has a compiled function as its own ``forward``
    (`pp_offload.runtime.compile.compile_layers`; torch marks it ``_torchdynamo_orig_callable``)."""
    from torch._dynamo.eval_frame import OptimizedModule

    forward = vars(module).get("forward")
    return (
        isinstance(module, OptimizedModule)
        or getattr(module, "_compiled_call_impl", None) is not None
        or getattr(forward, "_torchdynamo_orig_callable", None) is not None
    )


def wrap_shape_inference_backward(stage: Any, context: Callable[[], Any]) -> None:
    """Run the input-gradient call torch's shape inference makes (``_compute_input_grads``, torch 2.13;
    absent before) inside ``context()``. Idempotent; a no-op where torch has no such call."""
    method = getattr(stage, "_compute_input_grads", None)
    if method is None or getattr(method, "_pp_offload_wrapped", False):
        return

    def compute_input_grads(*args: Any, **kwargs: Any) -> Any:
        with context():
            return method(*args, **kwargs)

    compute_input_grads._pp_offload_wrapped = True  # type: ignore[attr-defined]
    stage._compute_input_grads = compute_input_grads


def compile_counters() -> tuple[float, int]:
    """(seconds spent compiling, graphs compiled) so far in this process, from dynamo's own counters
    (private: ``torch._dynamo.utils``); (0.0, 0) where they are missing."""
    try:
        from torch._dynamo.utils import compilation_time_metrics, counters
    except ImportError:
        return 0.0, 0
    seconds = sum(compilation_time_metrics.get("_compile.compile_inner", ()))
    seconds += sum(compilation_time_metrics.get("compile_fx.<locals>.bw_compiler", ()))
    return float(seconds), int(counters["stats"].get("unique_graphs", 0))


# --- actions ----------------------------------------------------------------------------------------


class ActionKind(str):
    """A computation type torch does not know (e.g. ``OFFLOAD``, ``RELOAD``).

    torch's ``_ComputationType`` is a closed Enum, but ``_Action`` only needs its ``computation_type`` to be
    hashable and to have a ``.value`` (used when printing, e.g. ``3OFFLOAD1``), and the runtime looks every
    action's type up in ``_comp_type_to_function_map`` before its built-ins. A ``str`` with ``.value`` is
    enough; such actions must be inserted after lowering (torch's lowering passes only know its own kinds).
    """

    __slots__ = ()

    @property
    def value(self) -> str:
        return str(self)

    def __repr__(self) -> str:
        return f"ActionKind({str(self)!r})"


_EXTRA_KINDS: dict[str, ActionKind] = {}


def action_kind(name: str) -> _ComputationType | ActionKind:
    """The computation type for ``name``: torch's own member if torch knows it, else an `ActionKind`.

    The same object is returned for the same name, so it can key handler maps and compare with ``is``.
    """
    try:
        return _ComputationType(name)
    except ValueError:
        pass
    if not name.isidentifier() or not name.isupper():
        raise ValueError(f"action kind names are upper-case identifiers like 'OFFLOAD', got {name!r}")
    return _EXTRA_KINDS.setdefault(name, ActionKind(name))


def make_action(stage_index: int, kind: str, microbatch_index: int | None = None) -> _Action:
    """A torch action of any kind, e.g. ``make_action(3, "OFFLOAD", 1)`` prints as ``3OFFLOAD1``."""
    return _Action(int(stage_index), action_kind(kind), microbatch_index)


def to_torch_action(action: Action) -> _Action:
    """Our plain `Action` (``2F0``) -> torch's ``_Action`` (same fields, same printout)."""
    return _Action(
        int(action.stage_index),
        _ComputationType(action.computation_type),
        int(action.microbatch_index),
    )


def to_torch_order(order: Mapping[int, Iterable[Action]]) -> dict[int, list[_Action | None]]:
    """A whole order (rank -> actions) converted for ``_prepare_schedule_with_comms``."""
    return {int(rank): [to_torch_action(a) for a in actions] for rank, actions in order.items()}


# --- runtime hooks ----------------------------------------------------------------------------------

ActionHandler = Callable[[_Action, _PipelineContext], None]


def no_output_kwargs(schedule: Any) -> dict[str, Any]:
    """``schedule.step`` keywords that stop the last stage keeping every microbatch's output for the step's
    return value (``return_outputs=False`` where torch has it). Why: a causal LM's last stage outputs
    logits, one vocabulary-wide tensor per microbatch (1 GiB at 128k vocabulary and 4096 tokens in bf16),
    which torch otherwise keeps until the step ends and then concatenates; training needs only the losses."""
    if "return_outputs" in inspect.signature(schedule.step).parameters:
        return {"return_outputs": False}
    return {}


def skip_self_p2p_warmup(stages: Iterable[Any]) -> None:
    """Drop the first-step warm-up sends and receives a stage would make to a neighbour on its own rank.

    Only torch versions whose stages have ``_get_init_p2p_neighbors_ops`` make them (2.11); idempotent."""
    for stage in stages:
        method = getattr(stage, "_get_init_p2p_neighbors_ops", None)
        if method is None or getattr(method, "_pp_offload_filtered", False):
            continue
        own = getattr(stage, "group_rank", None)

        def filtered(method: Any = method, own: Any = own) -> list[Any]:
            return [op for op in method() if not _to_self(op, own)]

        filtered._pp_offload_filtered = True  # type: ignore[attr-defined]
        stage._get_init_p2p_neighbors_ops = filtered


def _to_self(op: Any, group_rank: Any) -> bool:
    """Whether a ``P2POp`` names this rank as its peer (by group rank where the op records one, else by
    global rank: older torch keeps only the global ``peer``)."""
    import torch.distributed as dist

    group_peer = getattr(op, "group_peer", None)
    if group_peer is not None:
        return group_peer == group_rank
    peer = getattr(op, "peer", None)
    return peer is not None and dist.is_initialized() and peer == dist.get_rank()


def install_action_handler(schedule: _PipelineScheduleRuntime, kind: str, handler: ActionHandler) -> None:
    """Run ``handler(action, ctx)`` for every action of ``kind`` this schedule executes.

    Works for torch's kinds (replacing torch's built-in handling of that kind entirely) and for new kinds
    made with `action_kind`/`make_action`. torch's public ``register_custom_function`` refuses kinds it
    does not know, hence the direct write into ``_comp_type_to_function_map``.
    """
    if not is_runtime_schedule(schedule):
        raise TypeError(
            f"custom actions need a _PipelineScheduleRuntime schedule, got {type(schedule).__name__}"
        )
    schedule._comp_type_to_function_map[action_kind(kind)] = handler


def is_runtime_schedule(obj: Any) -> bool:
    return isinstance(obj, _PipelineScheduleRuntime)


def lowered_order(schedule: _PipelineScheduleRuntime) -> dict[int, list[_Action]]:
    """rank -> the actions (compute and comms) the runtime executes, as produced by lowering."""
    order = getattr(schedule, "pipeline_order_with_comms", None)
    if order is None:
        raise ValueError(f"{type(schedule).__name__} has no lowered order; call _prepare_schedule_with_comms")
    return order


def relower(schedule: _PipelineScheduleRuntime, order: Mapping[int, list[Any]]) -> None:
    """Replace the schedule's compute order with ``order`` (same passes, another sequence: e.g. W moved next
    to I by offload-aware orders) and lower it again with torch's ``_prepare_schedule_with_comms``, which
    validates it and rebuilds SEND/RECV, REDUCE_GRAD and (FSDP) UNSHARD/RESHARD around the new sequence."""
    order = {int(rank): list(actions) for rank, actions in order.items()}
    schedule.pipeline_order = order
    schedule._prepare_schedule_with_comms(order)


def schedule_stages(schedule: _PipelineScheduleRuntime) -> list[Any]:
    """The stages this rank's schedule drives (multi-stage runtime schedules, or a single-stage one)."""
    stages = getattr(schedule, "_stages", None)
    if stages is not None:
        return list(stages)
    stage = getattr(schedule, "_stage", None)
    if stage is None:
        raise TypeError(f"{type(schedule).__name__} is not a pipeline schedule (it holds no stages)")
    return [stage]


def stage_group_ranks(schedule: Any) -> dict[int, int]:
    """Stage index -> the rank (within the pipeline group) that holds it; empty when the schedule does not
    say (torch's single-stage schedules)."""
    mapping = getattr(schedule, "stage_index_to_group_rank", None)
    return dict(mapping) if mapping else {}


def action_parts(action: Any) -> tuple[int, str, int | None]:
    """``(stage_index, kind, microbatch_index)`` of a torch action; ``kind`` as printed (``F``,
    ``RECV_F``, ``OFFLOAD``...)."""
    kind = action.computation_type
    return action.stage_index, str(kind.value), action.microbatch_index


def wrap_step_microbatches(schedule: Any, wrapper: Callable[..., Any]) -> Callable[[], None]:
    """Route ``schedule._step_microbatches(*a, **k)`` through ``wrapper(original, *a, **k)``.

    ``step()`` calls ``self._step_microbatches`` once per step on every torch we support, so this is the
    narrowest place to run code around one step of one schedule instance. Returns an undo function
    (undo in reverse order of wrapping when several wrappers are stacked).
    """
    had_own = "_step_microbatches" in vars(schedule)
    previous = schedule._step_microbatches

    def step_microbatches(*args: Any, **kwargs: Any) -> Any:
        return wrapper(previous, *args, **kwargs)

    schedule._step_microbatches = step_microbatches

    def undo() -> None:
        if had_own:
            schedule._step_microbatches = previous
        else:
            vars(schedule).pop("_step_microbatches", None)

    return undo


STAGE_COMPUTE_METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")
"""The methods of torch's ``PipelineStage`` through which every compute action runs (F, I or B, W)."""


def wrap_stage_compute(
    stages: Iterable[Any], wrap: Callable[[Callable[..., Any]], Any]
) -> Callable[[], None]:
    """Route each of ``stages``' compute methods (`STAGE_COMPUTE_METHODS`) through ``wrap(method)``, as
    instance attributes over whatever the stage had (earlier wrappers stay underneath). Returns an undo
    that gives each stage back the instance attributes it had before (undo in reverse order of wrapping
    when several are stacked)."""
    saved: list[tuple[Any, dict[str, Any]]] = []
    for stage in stages:
        before = {name: vars(stage).get(name) for name in STAGE_COMPUTE_METHODS}
        for name in STAGE_COMPUTE_METHODS:
            setattr(stage, name, wrap(getattr(stage, name)))
        saved.append((stage, before))

    def undo() -> None:
        for stage, before in reversed(saved):
            for name, value in before.items():
                if value is None:
                    vars(stage).pop(name, None)
                else:
                    setattr(stage, name, value)

    return undo


# --- offline inspection (no processes) ---------------------------------------------------------------


def schedule_ops(
    schedule: Any,
    num_ranks: int,
    num_microbatches: int,
    stages_per_rank: int | None = None,
    *,
    with_comms: bool = False,
) -> list[list[_Action | None]]:
    """rank -> actions of any schedule (torch's name like ``"ZBVZeroBubble"``, or a class), built with
    mock stages by torch's private ``_schedule_visualizer.get_schedule_ops``: orders without processes."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    return get_schedule_ops(schedule, num_ranks, num_microbatches, stages_per_rank, with_comms=with_comms)


def lower_order_offline(
    order: Mapping[int, Iterable[Action | _Action]], num_microbatches: int
) -> dict[int, list[_Action]]:
    """Lower a compute-only order (ours or torch's) with torch's own ``_prepare_schedule_with_comms``.

    Uses mock stages, like ``get_schedule_ops(..., with_comms=True)``, so any generator's raw order can be
    checked by torch's validation and SEND/RECV insertion without building a schedule class or processes.
    Stage placement is inferred from the order; raises whatever torch raises on an invalid order.
    """
    from unittest import mock

    from torch.distributed.pipelining.stage import PipelineStage

    torch_order = {
        int(rank): [a if isinstance(a, _Action) else to_torch_action(a) for a in actions]
        for rank, actions in order.items()
    }
    num_ranks = len(torch_order)
    num_stages = 1 + max(a.stage_index for acts in torch_order.values() for a in acts if a is not None)
    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank, stage.group_size, stage.submod = 0, num_ranks, None
    stage.num_stages = num_stages
    stages = [stage] * max(2, num_stages // num_ranks)
    runtime = _PipelineScheduleRuntime(stages, int(num_microbatches))
    runtime._prepare_schedule_with_comms(torch_order)
    return runtime.pipeline_order_with_comms


# --- one recomputation per backward pass ----------------------------------------------------------------


def _weight_pass_in_one_group(original: Callable[..., Any]) -> Callable[..., Any]:
    from torch.utils.checkpoint import GraphExecGroup

    def stage_backward_weight(*args: Any, **kwargs: Any) -> Any:
        if GraphExecGroup._get_current_group() is not None:  # groups do not nest: the caller's one holds
            return original(*args, **kwargs)
        with GraphExecGroup():
            return original(*args, **kwargs)

    stage_backward_weight.__wrapped__ = original  # type: ignore[attr-defined]
    stage_backward_weight._pp_offload_one_group = True  # type: ignore[attr-defined]
    return stage_backward_weight


def installed_weight_pass() -> Callable[..., Any]:
    """The ``stage_backward_weight`` torch's stages call now (with `share_weight_pass_recomputation` in
    force: the one that shares a recomputation)."""
    from torch.distributed.pipelining import stage as _stage

    return _stage.stage_backward_weight


def share_weight_pass_recomputation(enabled: bool = True) -> bool:
    """Make every pipeline stage's weight pass (W) recompute each checkpointed layer once, not once per
    parameter group (module doc). Idempotent; returns whether it is in force (False only on a torch
    without ``GraphExecGroup``, where W keeps recomputing per group). Gradients are unchanged: the same
    autograd calls run, and only the recomputation they unpack from is shared. ``enabled=False`` gives
    torch's own behaviour back (``bench/bench_hotpath.py`` measures both side by side)."""
    from torch.distributed.pipelining import stage as _stage
    from torch.utils import checkpoint as _checkpoint

    current = _stage.stage_backward_weight
    installed = getattr(current, "_pp_offload_one_group", False)
    if not enabled:
        if installed:
            _stage.stage_backward_weight = current.__wrapped__
        return False
    if not hasattr(_checkpoint, "GraphExecGroup"):
        return False
    if not installed:
        _stage.stage_backward_weight = _weight_pass_in_one_group(current)
    return True


# --- dispatch modes (selective recompute) ------------------------------------------------------------


def views_share_version() -> Any:
    """A context in which views and ``detach`` made from inside ``__torch_dispatch__`` (beneath autograd)
    still share their source's version counter, and a detached tensor carries no autograd view metadata
    (a tensor returned from a dispatch mode must not). Without it they skip ADInplaceOrView, the kernel
    that links version counters, and an in-place change of the source would go unnoticed. torch's own
    selective checkpointing detaches its cached outputs the same way."""
    return torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False)


# --- one rank of a pipeline, alone (bench/bench_gpu_replay.py) -----------------------------------------


def init_fake_process_group(rank: int, world_size: int) -> None:
    """A process group whose sends and receives do nothing, so one process runs one rank of a pipeline.

    torch's "fake" backend (registered by ``torch.testing._internal.distributed.fake_pg``) completes every
    communication at once without moving data: receive buffers keep what they hold, sends are dropped.
    Compute, memory and host copies are the real ones. Only for measuring a rank, never for training."""
    import torch.distributed as dist
    from torch.testing._internal.distributed import fake_pg

    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=rank, world_size=world_size)


def use_static_stage_metadata(schedule: _PipelineScheduleRuntime) -> None:
    """Make ``schedule``'s stages use their constructor's ``input_args``/``output_args`` with no handshake.

    Newer torch (2.13) agrees on static or runtime-inferred metadata by a vote among the ranks
    (``_warmup_p2p``); on a fake process group the vote receives zeros and asks for inference, whose
    metadata exchange then reads garbage. Every stage here was built with its example inputs and outputs, so
    the vote's answer is known: static. torch without the vote infers nothing when both are given."""
    if not hasattr(schedule, "_warmup_p2p"):
        return
    from torch.distributed.pipelining.stage import InferenceMode

    def warmup_p2p(stages: list[Any], has_backward: bool, p2p_done: bool) -> None:
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC

    schedule._warmup_p2p = warmup_p2p


def receive_buffers(stage: Any) -> list[torch.Tensor]:
    """The tensors torch receives activations and gradients into for ``stage`` (all microbatches)."""
    found: list[torch.Tensor] = []
    for table in (getattr(stage, "args_recv_info", {}), getattr(stage, "grad_recv_info", {})):
        for infos in table.values():
            for info in infos:
                buffer = getattr(info, "buffer", None)
                if isinstance(buffer, torch.Tensor):
                    found.append(buffer)
    return found


def pending_weight_pass(stage: Any, microbatch: int) -> Any:
    """The runner a stage's ``dw_builder`` returned at ``microbatch``'s I, which torch calls at its W (None
    when that W already ran, or the stage has no builder). torch keeps it in ``stage.dw_runner``."""
    return getattr(stage, "dw_runner", {}).get(microbatch)
