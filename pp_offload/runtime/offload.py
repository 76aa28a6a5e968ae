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
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from pp_offload.order.actions import Costs
from pp_offload.order.offload import OffloadPlan, plan_offload, resolve_offload
from pp_offload.runtime import compat
from pp_offload.runtime.store import ActivationStore

__all__ = ["OffloadRuntime", "enable_offload"]

_DEFAULT_TRANSFER = 0.5
"""One chunk's one-way copy time in F units when costs give none: the paper's k ~ 1 regime."""


@dataclass
class OffloadRuntime:
    """What `enable_offload` installed on a schedule (``schedule.offload``): the plan and the store."""

    plan: OffloadPlan
    store: ActivationStore
    offloaded: set[tuple[int, int]]


def enable_offload(
    schedule: Any,
    offload: Any = "full",
    *,
    costs: Costs | Mapping[str, float] | None = None,
    device: torch.device | str | None = None,
) -> OffloadRuntime | None:
    """Offload activations of ``schedule`` (any torch ``_PipelineScheduleRuntime`` schedule) to host memory.

    offload: ``"full"``, ``"selective"``/``"selective:0.25"``/a fraction, ``"auto"``, a dict of
        `pp_offload.order.offload.OffloadPolicy` fields, or a policy; ``None``/``"none"`` does nothing.
    costs: relative F/I/W/comm durations and ``transfer`` (one chunk's copy time one way); default: the
        schedule's own ``costs`` if it has them, else unit costs with ``transfer = 0.5``.
    device: the device whose activations move (default: the device of this rank's stages). Asking for
        CUDA on a machine without it raises `ValueError`.

    Call after building the schedule and before its first ``step``. Returns None when nothing is offloaded.
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
    costs = Costs.coerce(costs if costs is not None else getattr(schedule, "costs", None))
    if costs.transfer == 0:
        costs = Costs(costs.F, costs.I, costs.W, costs.comm, transfer=_DEFAULT_TRANSFER * costs.F)
    plan = plan_offload(schedule.pipeline_order, costs, policy)
    _insert_into_lowered_order(schedule, plan)

    stages = compat.schedule_stages(schedule)
    store = ActivationStore(device if device is not None else stages[0].device)
    rank = stages[0].group_rank
    runtime = OffloadRuntime(plan, store, set(plan.offloaded.get(rank, ())))
    for stage in stages:
        _hook_stage(stage, runtime)
    compat.install_action_handler(schedule, "OFFLOAD", lambda action, ctx: store.offload(_key(action)))
    compat.install_action_handler(schedule, "RELOAD", lambda action, ctx: store.reload(_key(action)))

    def fresh_step(step_microbatches: Any, *args: Any, **kwargs: Any) -> Any:
        store.reset()  # a step that failed half-way leaves chunks behind; never let them leak into the next
        return step_microbatches(*args, **kwargs)

    compat.wrap_step_microbatches(schedule, fresh_step)
    schedule.offload = runtime
    return runtime


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
    if kind in ("F", "I", "W", "B"):
        return [(int(action.stage_index), kind, int(action.microbatch_index))]
    return []


def _hook_stage(stage: Any, runtime: OffloadRuntime) -> None:
    """Capture the chosen chunks' forwards and release them after their last backward pass."""
    store, chosen = runtime.store, runtime.offloaded
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
        current[0] = key if key in chosen else None
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
        with store.capture(key, keep=kept):
            return originals["forward_maybe_with_nosync"](*args, **kwargs)

    def backward_one_chunk(bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        result = originals["backward_one_chunk"](bwd_chunk_id, *args, **kwargs)
        full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
        key = (stage.stage_index, bwd_chunk_id)
        if full and key in chosen:
            store.release(key)
        return result

    def backward_weight_one_chunk(bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        result = originals["backward_weight_one_chunk"](bwd_chunk_id, *args, **kwargs)
        key = (stage.stage_index, bwd_chunk_id)
        if key in chosen:
            store.release(key)
        return result

    hooks = {
        "forward_one_chunk": forward_one_chunk,
        "forward_maybe_with_nosync": forward_maybe_with_nosync,
        "backward_one_chunk": backward_one_chunk,
        "backward_weight_one_chunk": backward_weight_one_chunk,
    }
    for name, hook in hooks.items():
        setattr(stage, name, hook)
