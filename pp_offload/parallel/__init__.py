"""Hybrid pipeline x data parallelism: the ("pp", "dp") device mesh and FSDP2 on pipeline stages.

Every rank, in order: ``mesh = build_mesh(pp, dp, device_type="cpu")`` (rank = dp_rank * pp + pp_rank);
``split = split_model(model, num_stages=..., stage_indices=stage_indices(pp_rank(mesh), pp, placement))``;
``sharded = apply_fsdp(split, mesh, mixed_precision="bf16", split_backward=info.split_backward)`` (one FSDP
unit per decoder layer, then each stage root); build ``PipelineStage(sharded.modules[s], s, num_stages,
device, group=mesh["pp"].get_group())`` for each stage and the schedule on them (``scale_grads=False``,
loss `pp_offload.models.TokenCrossEntropy` over the global target count); ``sharded.attach(schedule)``
(a weight tied across this rank's two V stages gets its gradient summed over dp after each step); then
create the optimizer on the now sharded parameters, and clip with `clip_grad_norm_` (the norm over every
pipeline and data-parallel rank). ``activation_checkpointing(split)`` recomputes each decoder layer in
backward (composes with offload: a recomputed layer saves only its input); ``mode="selective"`` keeps its
matmul and attention outputs and recomputes only the cheap ops (they move with the offloaded chunk);
``mode="mlp"`` does that for the layers' MLP blocks only, and ``mode="selective:0.75,mlp"`` applies a
mode to the first share of each stage's layers and another to the rest (`pp_offload.recompute_plan`).
See `pp_offload.parallel.fsdp` for why each choice.
"""

from pp_offload.parallel.fsdp import (
    CHECKPOINTING_MODES,
    ShardedStages,
    activation_checkpointing,
    apply_fsdp,
    checkpointing_mode,
    clip_grad_norm_,
    grad_norm,
    mixed_precision_policy,
)
from pp_offload.parallel.mesh import MeshError, build_mesh, data_parallel_mesh, dp_rank, pp_rank

__all__ = [
    "CHECKPOINTING_MODES",
    "MeshError",
    "ShardedStages",
    "activation_checkpointing",
    "apply_fsdp",
    "build_mesh",
    "checkpointing_mode",
    "clip_grad_norm_",
    "data_parallel_mesh",
    "dp_rank",
    "grad_norm",
    "mixed_precision_policy",
    "pp_rank",
]
