"""PipeOffload on torch's runtime: OFFLOAD/RELOAD actions for any `_PipelineScheduleRuntime` schedule.

`enable_offload(schedule, offload="full")` works on pp_offload's V schedules (they call it for their
``offload=`` argument) and on torch's own multi-stage schedules (``ScheduleInterleaved1F1B``,
``ScheduleZBVZeroBubble``, ``ScheduleInterleavedZeroBubble``, ``ScheduleDualPipeV``):

1. plan: `pp_offload.order.offload.plan_offload` chooses the chunks (stage, microbatch) to offload from
   the schedule's compute order and the costs, and places each RELOAD so it ends before the chunk's first
   backward pass;
2. lower: the OFFLOAD/RELOAD actions are inserted into torch's lowered order (comms included), each
   right after the action running the compute pass that precedes it in the plan (OFFLOAD: the chunk's
   F), so they print with the rest (``3OFFLOAD1``) and show up in `ActionTimer`'s Chrome trace;
3. execute: an `ActivationStore` records the saved tensors of each chosen chunk's forward (the stage's
   own inputs, held by the pipeline's receive buffers, are not copied), moves them to host memory at
   OFFLOAD, back at RELOAD, and drops them after the chunk's last backward pass (W, or B), because split
   backward unpacks saved tensors in both I and W.

A RELOAD missing from an order makes the backward fail with an error naming the chunk, never a wrong
gradient.

Offload-aware orders (``offload="budget:close-w"``, `pp_offload.order.zb_offload`): when the plan moves
the W of some chunks right after their I, the schedule's compute order is rewritten the same way and
lowered again by torch (`pp_offload.runtime.compat.relower`) before the OFFLOAD/RELOAD actions go in, so
the runtime executes the plan's sequence pass for pass.

Budget mode (``offload="budget"``, ``"budget:0.5"``; `pp_offload.order.offload`) moves each chunk's
earliest layers instead of the whole chunk, as `pp_offload.sim` models it: the stage's layers are its
module's largest ``nn.ModuleList`` (Hugging Face's ``model.layers``, GPT-2's ``h``) or, for an
``nn.Sequential`` stage, its children. Each moved layer is its own store entry, keyed
``(stage, microbatch, layer)``: captured from a forward pre-hook on the layer, offloaded from its forward
hook (so its copy starts as soon as that layer has produced its tensors; on CUDA the copy stream waits
for exactly that compute), reloaded last layer first at the chunk's RELOAD (the backward needs the last
layer first, and on CUDA waits only for the layer it unpacks), released after the chunk's last backward.
The chunk's OFFLOAD action then copies nothing; it checks that every planned layer went out. Planning
needs every stage's layer count: this rank counts its own stages and assumes the largest of them for the
others, and it plans with scalar costs in chunk units.

Sub-layer units (``"budget:sublayer"``, ``granularity="sublayer"``): a layer with one attention submodule
(`attention_submodule`: HF Llama-family ``self_attn``, GPT-2 ``attn``) is two store entries, the tensors it
saves up to its attention's return (captured from the layer's pre-hook to the attention's forward hook)
and the rest (to the layer's forward hook); keys ``(stage, microbatch, unit)`` count units across the
stage. Other layers, and layers checkpointed as a whole, stay one unit. The first unit a chunk moves then
costs about a quarter of a layer's copy, and starts before the layer's MLP has run.

Exactly as the planner predicts: the planner places budget offload with each stage's pass times, layer
counts, per-layer copy times and bytes (the embedding's and the LM head's stages weigh differently), so
a plan from scalar costs and guessed layer counts can move other layers of other chunks and put RELOADs
elsewhere. ``enable_offload(..., inputs=OffloadInputs)`` (`pp_offload.order.offload_inputs`, made by
`pp_offload.plan.offload_inputs` or the recipe's ``schedule: auto``) plans with the planner's figures; the
plan is then the planner's, chunk for chunk and position for position (tested offline for V-Half, V-ZB and
torch's Interleaved1F1B on a Llama-3-8B-like spec). Every plan is made on the order as torch executes it
(`pp_offload.sim.as_executed_by_torch`), the order the planner simulates.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pp_offload.order.actions import Costs
from pp_offload.order.offload import OffloadPlan, plan_offload, resolve_offload
from pp_offload.order.offload_inputs import OffloadInputs
from pp_offload.order.zb_offload import pull_weight_passes
from pp_offload.runtime import compat
from pp_offload.runtime.deferred_w import WeightPass, all_deferring
from pp_offload.runtime.store import ActivationStore
from pp_offload.sim import as_executed_by_torch

__all__ = [
    "OffloadRuntime",
    "attention_submodule",
    "enable_offload",
    "is_queue_key",
    "queue_key",
    "stage_layers",
    "stage_units",
    "unit_count",
]

_DEFAULT_TRANSFER = 0.5
"""One chunk's one-way copy time in F units when costs give none: the paper's k ~ 1 regime."""


def queue_key(chunk: tuple[int, int]) -> tuple[int, int, str]:
    """The activation store's key of chunk ``(stage, microbatch)``'s deferred-W queue."""
    return (*chunk, "queue")


def is_queue_key(key: Any) -> bool:
    """Whether a store key names a deferred-W queue (`queue_key`) rather than activations: a chunk
    ``(stage, microbatch)`` or a budget layer ``(stage, microbatch, layer)``."""
    return isinstance(key, tuple) and key[-1:] == ("queue",)


_DEFAULT_QUEUE = 1.0
"""Deferred W, when neither the costs nor planner inputs give it (`Costs.queue`): a chunk's W queue as a
multiple of its saved activations. Each linear's input and output gradient is about 0.7 of what a Llama
stage saves without recompute (Llama-3-8B, seq 8192: 0.68, `pp_offload.plan.memory.queued_bytes`) and 5-17
times it under full recompute, where the planner's figures (``inputs=``) give each stage's own."""


@dataclass
class OffloadRuntime:
    """What `enable_offload` installed on a schedule (``schedule.offload``): the plan and the store.

    ``moved``: budget mode, this rank's chunks -> layers moved (their store keys are
    ``(stage, microbatch, layer)``); empty for whole-chunk policies."""

    plan: OffloadPlan
    store: ActivationStore
    offloaded: set[tuple[int, int]]
    moved: dict[tuple[int, int], int] = field(default_factory=dict)
    _active: Any = field(default=None, repr=False)  # budget: (chunk, layers moved, kept tensors) in its F
    spent: set[tuple[int, int]] = field(default_factory=set)
    """Deferred W: chunks released when their I ended, until their W ends; the plan's copies of them
    between I and W then move the chunk's W queue (`pp_offload.runtime.deferred_w.WeightPass`, store key
    `queue_key`), which is all that waits for W."""

    def moved_queues(self) -> set[tuple[int, int]]:
        """(stage, microbatch) of this rank's chunks whose W queue the last step moved to host memory (a
        queue with nothing in it moves no byte and is left out)."""
        return {key[:2] for key, nbytes in self.store.last_captured.items() if is_queue_key(key) and nbytes}


def enable_offload(
    schedule: Any,
    offload: Any = "full",
    *,
    costs: Costs | Mapping[str, float] | None = None,
    inputs: OffloadInputs | Mapping[str, Any] | None = None,
    device: torch.device | str | None = None,
) -> OffloadRuntime | None:
    """Offload activations of ``schedule`` (any torch ``_PipelineScheduleRuntime`` schedule) to host memory.

    offload: ``"full"``, ``"selective"``/``"selective:0.25"``/a fraction, ``"auto"``, ``"budget"``/
        ``"budget:0.5"``/``"budget:auto:0.1"`` (layer by layer: the stages' modules must hold their layers
        in an ``nn.ModuleList`` or be ``nn.Sequential``), a dict of
        `pp_offload.order.offload.OffloadPolicy` fields, or a policy; ``None``/``"none"`` does nothing.
    costs: relative F/I/W/comm durations and ``transfer`` (one chunk's copy time one way); default: the
        schedule's own ``costs`` if it has them, else unit costs with ``transfer = 0.5``.
    inputs: the planner's figures for this schedule (`pp_offload.order.offload_inputs.OffloadInputs` or its
        ``to_dict``; from `pp_offload.plan.offload_inputs` or the recipe's ``schedule: auto``): costs with
        each stage's pass times, every stage's layer count and per-layer copy time, and each stage's bytes.
        The plan is then the one the planner predicted for this order (same chunks, same moved layers,
        same OFFLOAD/RELOAD positions). Replaces ``costs``; this rank's stages must hold ``inputs.layers``.
    device: the device whose activations move (default: the device of this rank's stages). Asking for
        CUDA on a machine without it raises `ValueError`.

    The plan is made on the order as torch executes it (`pp_offload.sim.as_executed_by_torch`: stage 0's
    I computes nothing and its W runs the whole backward), the order the planner simulates. Call after
    building the schedule and before its first ``step``. Returns None when nothing is offloaded.
    """
    policy = resolve_offload(offload)
    if not policy.enabled:
        return None
    if not compat.is_runtime_schedule(schedule):
        raise TypeError(
            f"offload needs a multi-stage schedule on torch's runtime (_PipelineScheduleRuntime), got "
            f"{type(schedule).__name__}; single-stage schedules (Schedule1F1B, ScheduleGPipe) "
            "are not supported"
        )
    stages = compat.schedule_stages(schedule)
    own = (
        {stage.stage_index: stage_units(stage, policy.granularity) for stage in stages}
        if policy.mode == "budget"
        else {}
    )
    num_stages = 1 + max(
        a.stage_index for acts in schedule.pipeline_order.values() for a in acts if a is not None
    )
    if inputs is not None:
        if costs is not None:
            raise ValueError("give enable_offload costs= or inputs= (which carry the costs), not both")
        inputs = inputs if isinstance(inputs, OffloadInputs) else OffloadInputs.from_dict(inputs)
        _check_inputs(inputs, num_stages, own, policy.granularity)
        costs, kwargs = inputs.costs, inputs.plan_kwargs()
    else:
        costs = Costs.coerce(costs if costs is not None else getattr(schedule, "costs", None))
        kwargs = {}
        if policy.mode == "budget":
            counts = {s: unit_count(units) for s, units in own.items()}
            assumed = max(counts.values())
            kwargs["layers"] = [counts.get(s, assumed) for s in range(num_stages)]
    if costs.transfer == 0:
        costs = dataclasses.replace(costs, transfer=_DEFAULT_TRANSFER * costs.F)
    # Deferred W (`pp_offload.runtime.deferred_w`): stage 0's I is a real backward and its W the queued
    # GEMMs, so the order runs as written; torch's retained-graph split runs stage 0's backward at W.
    deferring = all_deferring(stages)
    if deferring and costs.queue is None and inputs is None:
        costs = dataclasses.replace(costs, queue=_DEFAULT_QUEUE)
    order = schedule.pipeline_order
    executed = order if deferring else as_executed_by_torch(order)
    plan = plan_offload(executed, costs, policy, **kwargs)
    if plan.pulled:  # offload-aware order (close_w): run the plan's sequence, W right after I where it moved
        pulled = [key for keys in plan.pulled.values() for key in keys]
        compat.relower(schedule, pull_weight_passes(schedule.pipeline_order, pulled))
    _insert_into_lowered_order(schedule, plan)

    store = ActivationStore(device if device is not None else stages[0].device, lanes=policy.lanes)
    rank = stages[0].group_rank
    mine = set(plan.offloaded.get(rank, ()))
    moved = {key: plan.layered[key].moved for key in mine if key in plan.layered}
    runtime = OffloadRuntime(plan, store, mine - set(moved), moved)
    for stage in stages:
        _hook_stage(stage, runtime)
        if moved:
            _hook_units(stage, runtime, own[stage.stage_index])

    by_index = {stage.stage_index: stage for stage in stages}

    def weight_pass(key: tuple[int, int]) -> WeightPass | None:
        found = compat.pending_weight_pass(by_index[key[0]], key[1])
        return found if isinstance(found, WeightPass) else None

    def offload(action: Any, ctx: Any) -> None:
        key = _key(action)
        if key in runtime.spent:  # deferred W, between I and W: what waits for W is the queue
            queued = weight_pass(key)
            if queued is not None:
                queued.offload(store, queue_key(key))
            return
        if key not in moved:
            store.offload(key)
            return
        parts = [(*key, i) for i in range(moved[key])]
        states = [store.state(part) for part in parts]
        if all(state == "reloaded" for state in states):  # after I: drop the device copies until W
            for part in parts:
                store.offload(part)
            return
        missing = [i for i, state in enumerate(states) if state != "offloaded"]
        if missing:
            raise RuntimeError(
                f"{action}: offload units {missing} of stage {key[0]}, microbatch {key[1]} were planned to "
                "move to host memory during the forward but did not; the stage's forward must call its "
                "layers (and, with granularity 'sublayer', their attention submodules) as modules: their "
                "forward hooks move them"
            )

    def reload(action: Any, ctx: Any) -> None:
        key = _key(action)
        if key in runtime.spent:
            queued = weight_pass(key)
            if queued is not None and queued.stored_key is not None:
                queued.reload()
            return
        if key not in moved:
            store.reload(key)
            return
        for i in range(moved[key] - 1, -1, -1):  # the backward needs the last moved layer first
            store.reload((*key, i))

    compat.install_action_handler(schedule, "OFFLOAD", offload)
    compat.install_action_handler(schedule, "RELOAD", reload)

    def fresh_step(step_microbatches: Any, *args: Any, **kwargs: Any) -> Any:
        store.reset()  # a step that failed half-way leaves chunks behind; never let them leak into the next
        runtime.spent.clear()
        return step_microbatches(*args, **kwargs)

    compat.wrap_step_microbatches(schedule, fresh_step)
    schedule.offload = runtime
    return runtime


def _check_inputs(
    inputs: OffloadInputs, num_stages: int, own: Mapping[int, list[Any]], granularity: str = "layer"
) -> None:
    """The planner's figures must describe this pipeline: as many stages, and this rank's stages holding
    the layers (or sub-layer units) they count (else the plan would move units that do not exist, or the
    wrong ones)."""
    if own and inputs.granularity != granularity:
        raise ValueError(
            f"offload inputs count {inputs.granularity!r} units but the policy moves {granularity!r} units; "
            f"build them with the policy's granularity (Setup.offload_inputs({granularity!r}))"
        )
    if inputs.num_stages != num_stages:
        raise ValueError(
            f"offload inputs describe {inputs.num_stages} stages but the schedule's order has {num_stages}; "
            "build them for this schedule and pipeline size"
        )
    counts = {s: unit_count(units) for s, units in own.items()}
    wrong = {s: (n, inputs.layers[s]) for s, n in counts.items() if n != inputs.layers[s]}
    if wrong:
        what = "layers" if granularity == "layer" else "sub-layer units"
        detail = ", ".join(f"stage {s} holds {n} {what}, inputs say {said}" for s, (n, said) in wrong.items())
        raise ValueError(
            f"offload inputs do not match this rank's stages ({detail}); build them with the split the "
            "pipeline uses (pp_offload.plan.offload_inputs(..., layers_per_stage=...))"
        )


def _key(action: Any) -> tuple[int, int]:
    return int(action.stage_index), int(action.microbatch_index)


def _insert_into_lowered_order(schedule: Any, plan: OffloadPlan) -> None:
    """Put the plan's OFFLOAD/RELOAD actions into torch's lowered order of every rank.

    Each goes right after the lowered action that runs the compute pass preceding it in the plan. A
    composite action (torch's OVERLAP_F_B) runs its passes back to back, so a position between its
    passes becomes "right after it"; the plan's relative order of OFFLOADs and RELOADs is kept.
    """
    lowered = compat.lowered_order(schedule)
    for rank, planned in plan.order.items():
        position = {key: i for i, action in enumerate(lowered[rank]) for key in _compute_keys(action)}
        after: dict[int, list[Any]] = {}
        anchor = None
        for action in planned:
            kind = action.computation_type
            if kind in ("OFFLOAD", "RELOAD"):
                if anchor is None:
                    raise ValueError(f"rank {rank}: {action} comes before any compute pass in the plan")
                after.setdefault(anchor, []).append(
                    compat.make_action(action.stage_index, kind, action.microbatch_index)
                )
                continue
            key = (action.stage_index, kind, action.microbatch_index)
            if key not in position:
                raise ValueError(f"rank {rank}: the plan's {action} is not in the schedule's lowered order")
            anchor = max(position[key], anchor if anchor is not None else -1)
        new_order = []
        for i, action in enumerate(lowered[rank]):
            new_order.append(action)
            new_order.extend(after.pop(i, ()))
        lowered[rank] = new_order


def _compute_keys(action: Any) -> list[tuple[int, str, int]]:
    subs = getattr(action, "sub_actions", None)
    if subs:
        return [k for sub in subs for k in _compute_keys(sub)]
    kind = str(getattr(action.computation_type, "value", action.computation_type))
    if kind not in ("F", "I", "W", "B"):
        return []
    key = (int(action.stage_index), kind, int(action.microbatch_index))
    if key[:2] == (0, "W"):  # the plan's order is as torch executes it: stage 0's W runs as B
        return [key, (0, "B", key[2])]
    return [key]


def stage_layers(stage: Any) -> list[nn.Module]:
    """The stage's layers, in forward order: its module's largest ``nn.ModuleList``, else the children of
    an ``nn.Sequential`` stage module."""
    module = stage.submod
    lists = [m for m in module.modules() if isinstance(m, nn.ModuleList)]
    if lists:  # may be empty: a stage holding only the LM head moves nothing
        return list(max(lists, key=len))
    if isinstance(module, nn.Sequential) and len(module) > 0:
        return list(module)
    raise ValueError(
        f"offload mode 'budget' moves whole layers, but stage {stage.stage_index}'s module "
        f"({type(module).__name__}) has no nn.ModuleList of layers and is not an nn.Sequential; put its "
        "layers in an nn.ModuleList, or use a whole-chunk policy ('full', 'selective', 'auto')"
    )


def stage_units(stage: Any, granularity: str = "layer") -> list[tuple[nn.Module, nn.Module | None]]:
    """The stage's budget-offload units, in forward order, as (layer, attention submodule or None) per
    layer: a layer with an attention submodule at ``granularity="sublayer"`` is two units (its saved
    tensors up to the attention's return, then the rest), any other layer one.

    The planner counts the same units (`pp_offload.plan.memory.layer_unit_bytes`); ``enable_offload``
    compares the counts with the planner's inputs, so a layer split here and not there (or the reverse)
    is an error, never a silently different plan."""
    layers = stage_layers(stage)
    if granularity == "layer":
        return [(layer, None) for layer in layers]
    return [(layer, attention_submodule(layer)) for layer in layers]


def unit_count(units: list[tuple[nn.Module, nn.Module | None]]) -> int:
    """How many offload units `stage_units` found."""
    return sum(1 if split is None else 2 for _, split in units)


def attention_submodule(layer: nn.Module) -> nn.Module | None:
    """The decoder layer's attention submodule, where a sub-layer split is well defined, else None.

    The layer's one direct child whose name (Hugging Face Llama-family ``self_attn``, GPT-2 ``attn``) or
    class name says attention (``attn``/``attention``, any case) and neither says norm (Llama's
    ``post_attention_layernorm`` is a norm); none or several (GPT-2 with cross attention): None. A layer
    whose own forward was replaced on the instance (activation checkpointing of the whole layer,
    `pp_offload.parallel.activation_checkpointing` full or selective) saves through its checkpoint (its
    input, the recompute cache), not op by op, so it stays one unit too (the planner's `layer_unit_bytes`
    says the same)."""
    if "forward" in vars(layer):
        return None
    found = []
    for name, child in layer.named_children():
        text = f"{name} {type(child).__name__}".lower()
        if ("attn" in text or "attention" in text) and "norm" not in text:
            found.append(child)
    return found[0] if len(found) == 1 else None


def _hook_units(stage: Any, runtime: OffloadRuntime, units: list[tuple[nn.Module, nn.Module | None]]) -> None:
    """Budget mode: capture each moved unit's saved tensors under its own key ``(stage, microbatch,
    unit)`` and offload them as soon as that unit's forward has produced them: a layer's first unit from
    the layer's forward pre-hook to its attention submodule's forward hook (or the layer's own, when it is
    one unit), its second from there to the layer's forward hook. One capture at a time (they never nest:
    each closes before the next opens). Active only inside the forward of a chunk with moved units
    (`_hook_stage` sets ``runtime._active``); the attention's hooks also fire in recomputations during
    backward, where no capture is open, and do nothing there."""
    store = runtime.store
    open_capture: list[tuple[int, contextlib.ExitStack] | None] = [None]

    def begin(unit: int) -> None:
        active = getattr(runtime, "_active", None)
        if active is None or active[0][0] != stage.stage_index or unit >= active[1]:
            return
        key, _, keep = active
        stack = contextlib.ExitStack()
        stack.enter_context(store.capture((*key, unit), keep=keep))
        open_capture[0] = (unit, stack)

    def end(unit: int) -> None:
        current = open_capture[0]
        if current is None or current[0] != unit:
            return
        open_capture[0] = None
        current[1].close()
        store.offload((*runtime._active[0], unit))

    def boundary(layer: int, unit: int) -> None:  # the attention returned: its unit ends, the rest begins
        if open_capture[0] is not None and open_capture[0][0] == unit:
            end(unit)
            begin(unit + 1)

    hook_unit_boundaries(
        units,
        start=lambda layer, unit: begin(unit),
        split=boundary,
        end=lambda layer, unit: end(unit),
    )


def hook_unit_boundaries(
    units: list[tuple[nn.Module, nn.Module | None]],
    *,
    start: Callable[[int, int], None],
    split: Callable[[int, int], None],
    end: Callable[[int, int], None],
) -> list[Any]:
    """Hooks at the boundaries of `stage_units`' units, each called with (layer index, unit index across
    the stage): ``start`` before a layer's forward (its first unit begins), ``split`` when a split layer's
    attention submodule returns (its first unit ends, its second begins; the unit index is the first's),
    ``end`` when the layer's forward returns (its last unit ends). The runtime's captures and the probe's
    byte marks (`pp_offload.plan.probe`) use the same boundaries through this. Returns the hook handles."""
    handles, first = [], 0
    for index, (layer, attention) in enumerate(units):
        last = first if attention is None else first + 1
        handles.append(layer.register_forward_pre_hook(lambda mod, args, i=index, u=first: start(i, u)))
        if attention is not None:
            handles.append(
                attention.register_forward_hook(lambda mod, args, out, i=index, u=first: split(i, u))
            )
        handles.append(layer.register_forward_hook(lambda mod, args, out, i=index, u=last: end(i, u)))
        first = last + 1
    return handles


def _hook_stage(stage: Any, runtime: OffloadRuntime) -> None:
    """Capture the chosen chunks' forwards and release them after their last backward pass."""
    store, chosen, moved = runtime.store, runtime.offloaded, runtime.moved
    originals = {
        name: getattr(stage, name)
        for name in (
            "forward_one_chunk",
            "forward_maybe_with_nosync",
            "backward_one_chunk",
            "backward_weight_one_chunk",
        )
    }
    current: list[tuple[int, int] | None] = [None]

    def forward_one_chunk(fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        key = (stage.stage_index, fwd_chunk_id)
        current[0] = key if key in chosen or key in moved else None
        try:
            return originals["forward_one_chunk"](fwd_chunk_id, *args, **kwargs)
        finally:
            current[0] = None

    def forward_maybe_with_nosync(*args: Any, **kwargs: Any) -> Any:
        key = current[0]
        if key is None:
            return originals["forward_maybe_with_nosync"](*args, **kwargs)
        # The stage's inputs live in the pipeline's receive buffers (or the user's microbatch) and its
        # module buffers in the module: both stay on the device anyway, so copying them gains nothing.
        kept = [*args, *kwargs.values(), *stage.submod.buffers()]
        if key in moved:  # budget: the layer hooks capture and offload the moved layers one by one
            runtime._active = (key, moved[key], kept)
            try:
                return originals["forward_maybe_with_nosync"](*args, **kwargs)
            finally:
                runtime._active = None
        with store.capture(key, keep=kept):
            return originals["forward_maybe_with_nosync"](*args, **kwargs)

    def release(key: tuple[int, int]) -> None:
        if key in chosen:
            store.release(key)
        for i in range(moved.get(key, 0)):
            store.release((*key, i))

    def backward_one_chunk(bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        result = originals["backward_one_chunk"](bwd_chunk_id, *args, **kwargs)
        full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
        key = (stage.stage_index, bwd_chunk_id)
        if full:
            release(key)
        elif all_deferring([stage]):
            # deferred W: I is the chunk's last pass over its saved tensors (W reads only the queue, which
            # holds compact copies of what it needs from a reloaded chunk: `pp_offload.runtime.deferred_w`)
            release(key)
            runtime.spent.add(key)
        return result

    def backward_weight_one_chunk(bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        result = originals["backward_weight_one_chunk"](bwd_chunk_id, *args, **kwargs)
        key = (stage.stage_index, bwd_chunk_id)
        if key in runtime.spent:
            runtime.spent.discard(key)
        else:
            release(key)
        return result

    hooks = {
        "forward_one_chunk": forward_one_chunk,
        "forward_maybe_with_nosync": forward_maybe_with_nosync,
        "backward_one_chunk": backward_one_chunk,
        "backward_weight_one_chunk": backward_weight_one_chunk,
    }
    for name, hook in hooks.items():
        setattr(stage, name, hook)
