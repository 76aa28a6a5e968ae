"""What the planner hands the runtime: its per-stage figures for one setting, as `OffloadInputs`.

Why: the planner predicts a budget offload plan (which layers of which chunks move, where each RELOAD
goes) from each stage's pass times, layer counts, per-layer copy times and bytes. The runtime places the
same plan only when it plans with the same figures: ``enable_offload(schedule, "budget",
inputs=offload_inputs(...))`` or ``ScheduleVHalf(..., offload="budget", offload_inputs=...)``.

    from pp_offload.plan import offload_inputs
    inputs = offload_inputs("llama-3-8b", schedule="ScheduleVHalf", pp=4, seq_len=4096,
                            microbatch_size=1, num_microbatches=8, machine="H100")
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from pp_offload.order.offload_inputs import OffloadInputs
from pp_offload.plan.evaluate import Setup, setup_schedule
from pp_offload.plan.machines import Machine, resolve_machine
from pp_offload.plan.memory import check_recompute, precision
from pp_offload.plan.model import model_spec
from pp_offload.plan.orders import canonical_schedule

__all__ = ["offload_inputs", "planner_setup", "policy_inputs"]


def offload_inputs(model: Any, *, schedule: str, offload: Any = "budget", **setting: Any) -> OffloadInputs:
    """The planner's offload figures for ``schedule`` on ``model`` (anything `pp_offload.plan.model_spec`
    reads: a config, a dict, a path, a known name like ``"llama-3-8b"``), as `pp_offload.plan.plan`
    evaluates that setting, for the offload policy ``offload`` (its units: `policy_inputs`);
    ``setting``: the arguments of `planner_setup`. Costs are in seconds."""
    return policy_inputs(planner_setup(model, schedule=schedule, **setting), offload)


def policy_inputs(setup: Setup, offload: Any) -> OffloadInputs:
    """``setup``'s offload figures counted in the units ``offload`` moves (whole layers, or half layers
    for a ``:sublayer`` budget).

    Why one function: the runtime refuses figures in other units than its policy's, and the figures reach
    it by two roads, ``schedule: auto``'s decision (`pp_offload.plan.auto.choose`) and a hand-set budget
    policy (`pp_offload.recipe.offload_figures`); both call this, so neither can count layers while the
    policy moves sub-layer units."""
    from pp_offload.order.offload import resolve_offload

    return setup.offload_inputs(resolve_offload(offload).granularity)


def planner_setup(
    model: Any,
    *,
    schedule: str,
    pp: int,
    seq_len: int,
    microbatch_size: int,
    num_microbatches: int,
    machine: str | Machine = "H100",
    dtype: str = "bf16",
    recompute: str = "none",
    virtual_stages: int = 2,
    dp: int = 1,
    dp_shard: bool = False,
    lora_rank: int = 0,
    layers_per_stage: Sequence[int] | None = None,
    deferred_w: bool = True,
) -> Setup:
    """The planner's `pp_offload.plan.evaluate.Setup` of one schedule in one setting (stages, costs,
    bytes): with `pp_offload.plan.evaluate.build_orders` and `offload_plan`, the offload plan it predicts.

    ``layers_per_stage``: the split the pipeline is built with, when it is not the planner's balanced one
    (the runtime checks its stages hold the layers the inputs count). ``recompute``: ``"none"``,
    ``"selective"`` or ``"full"`` (what ``train.activation_checkpointing`` applies). ``deferred_w``: how
    split-backward stages split their backward (the recipe's ``pipeline.deferred_w``;
    `pp_offload.plan.evaluate.setup_schedule`). The rest as for `pp_offload.plan.plan`.
    """
    spec = model_spec(model)
    if lora_rank:
        spec = replace(spec, lora_rank=lora_rank)
    return setup_schedule(
        canonical_schedule(schedule),
        spec=spec,
        machine=resolve_machine(machine),
        precision=precision(dtype),
        seq_len=seq_len,
        microbatch_size=microbatch_size,
        num_microbatches=num_microbatches,
        pp=pp,
        dp=dp,
        dp_shard=dp_shard,
        virtual_stages=virtual_stages,
        reserve=0,
        recompute=check_recompute(recompute),
        layers_per_stage=None if layers_per_stage is None else list(layers_per_stage),
        deferred_w=deferred_w,
    )
