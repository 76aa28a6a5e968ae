"""The planner's per-stage figures for a hand-set ``pipeline.offload: budget...`` (no ``schedule: auto``).

Why: budget offload is placed from per-stage pass times, layer counts, per-layer copy times and bytes
(`pp_offload.order.offload_inputs`). ``schedule: auto`` hands the runtime the figures it measured and
chose with; a schedule named by hand gets the planner's figures for this model on the machine preset the
device names (`pp_offload.plan.offload_inputs`, with the split the pipeline was built with), so the run
places what ``pp-offload plan`` predicts for the same setting. When the planner cannot model the setting
(a model family it does not know, a schedule it does not evaluate) or the user set ``pipeline.costs`` (an
order and a plan in the user's own units), the runtime plans as before, and a log line says why.
"""

from __future__ import annotations

import torch
from torch import nn

from pp_offload.order.offload import resolve_offload
from pp_offload.order.offload_inputs import OffloadInputs
from pp_offload.recipe.config import RecipeConfig
from pp_offload.recipe.topology import machine_preset

__all__ = ["planner_offload_inputs"]


def planner_offload_inputs(
    config: RecipeConfig,
    model: nn.Module,
    *,
    schedule: str,
    stages_per_rank: int,
    pp: int,
    dp: int,
    layers_per_stage: list[int],
    device: torch.device,
    log: bool,
) -> OffloadInputs | None:
    """The planner's figures for this run's budget offload, or None (today's runtime plan) with a log line
    (on ``log`` ranks) saying why. None without a line when the policy is not a budget."""
    spec = config.pipeline
    if resolve_offload(spec.offload).mode != "budget":
        return None
    reason = _why_not(config, schedule)
    inputs = None
    if reason is None:
        from pp_offload.models.lora import unwrap_peft
        from pp_offload.parallel import checkpointing_mode
        from pp_offload.plan import offload_inputs

        machine = machine_preset(device)
        per_microbatch = config.train.global_batch_size // (spec.microbatches * dp)  # preflight: exact
        try:
            inputs = offload_inputs(
                unwrap_peft(model).config,
                schedule=schedule,
                offload=spec.offload,
                pp=pp,
                seq_len=config.data.seq_len,
                microbatch_size=per_microbatch,
                num_microbatches=spec.microbatches,
                machine=machine,
                dtype=config.train.precision,
                recompute=checkpointing_mode(config.train.activation_checkpointing) or "none",
                virtual_stages=stages_per_rank,
                dp=dp,
                dp_shard=dp > 1,
                lora_rank=config.lora.r if config.lora is not None else 0,
                layers_per_stage=layers_per_stage,
                deferred_w=spec.deferred_w,
            )
        except ValueError as error:  # a config or schedule the planner does not model
            reason = f"the planner cannot model this run ({error})"
    if log and reason is not None:
        print(
            f"offload {spec.offload}: placed from scalar costs and this rank's layer counts, not the "
            f"planner's per-stage figures: {reason}",
            flush=True,
        )
    elif log:
        split = "" if spec.deferred_w else ", under torch's retained-graph split (pipeline.deferred_w: false)"
        print(
            f"offload {spec.offload}: placed with the planner's per-stage figures for this model on the "
            f"{machine} preset (pass times, layers, per-layer copy times, bytes{split}); the run places what "
            "the planner predicts for this run (its model, split and machine preset)",
            flush=True,
        )
    return inputs


def _why_not(config: RecipeConfig, schedule: str) -> str | None:
    from pp_offload.plan.orders import OURS, TORCH

    if config.pipeline.costs is not None:
        return "pipeline.costs is set (the order and the plan use those costs, in their own units)"
    if schedule not in OURS + TORCH:
        return f"the planner does not evaluate {schedule}"
    return None
