"""The ("pp", "dp") device mesh of a hybrid pipeline x data-parallel run.

Rank layout: pipeline rank inner, ``rank = dp_rank * pp + pp_rank``. That is the recipe's `Topology`
(``pp_rank = rank % pp``), and it keeps a pipeline's ranks adjacent: with one process per GPU they land on
one node when ``pp`` divides the GPUs per node, so the point-to-point activation traffic (every
microbatch) stays on the fast intra-node links, and only the gradient reduction of FSDP (once per step
per stage) and its parameter all-gathers cross nodes.

HSDP (``dp_replicate > 1``): the data-parallel ranks form a ``dp_replicate x dp_shard`` grid, shard
inner: ``dp_rank = replicate_rank * dp_shard + shard_rank``. Parameters are sharded over ``dp_shard`` and
replicated over ``dp_replicate``. No flattened ``"dp"`` dimension is made (flattening is private API, and
slicing a flattened dimension from the root mesh is deprecated since torch 2.11): a sum over every
data-parallel rank is a sum over ``dp_shard`` then over ``dp_replicate``, which is how
`pp_offload.parallel.ShardedStages` reduces a replicated weight's gradient.

Every check runs before any collective, so a wrong world size stops every rank alike with the same
message instead of leaving some ranks waiting in a collective.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["MeshError", "build_mesh", "data_parallel_mesh", "dp_rank", "pp_rank"]

_HSDP_DIMS = ("dp_replicate", "dp_shard")


class MeshError(ValueError):
    """The process count or the requested sizes do not make a pp x dp mesh."""


def build_mesh(pp: int, dp: int, *, device_type: str, dp_replicate: int = 1) -> DeviceMesh:
    """The mesh of this job: ``("dp", "pp")`` (``pp`` inner), or ``("dp_replicate", "dp_shard", "pp")``
    for HSDP.

    ``mesh["pp"]`` is this rank's pipeline (give ``mesh["pp"].get_group()`` to ``PipelineStage``),
    ``data_parallel_mesh(mesh)`` what FSDP shards over. Needs an initialised default process group of
    exactly ``pp * dp`` processes (gloo for ``device_type="cpu"``, NCCL for ``"cuda"``); every rank must
    call this with the same arguments.
    """
    for name, value in (("pp", pp), ("dp", dp), ("dp_replicate", dp_replicate)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise MeshError(f"{name} must be an int >= 1, got {value!r}")
    if dp % dp_replicate:
        raise MeshError(
            f"dp={dp} is not a multiple of dp_replicate={dp_replicate}: HSDP splits the data-parallel ranks "
            f"into dp_replicate x dp_shard replicas x shards; pick dp_replicate among "
            f"{[d for d in range(1, dp + 1) if dp % d == 0]}"
        )
    if device_type not in ("cpu", "cuda"):
        raise MeshError(f"device_type must be 'cpu' or 'cuda' (no index), got {device_type!r}")
    if not (dist.is_available() and dist.is_initialized()):
        raise MeshError(
            "build_mesh needs the default process group: call torch.distributed.init_process_group first "
            "(torchrun / accelerate launch set up the environment for it)"
        )
    world = dist.get_world_size()
    if world != pp * dp:
        raise MeshError(
            f"world size {world} is not pp x dp = {pp} x {dp} = {pp * dp}: launch {pp * dp} processes or "
            f"choose pp and dp whose product is {world}"
        )
    if dp_replicate == 1:
        return init_device_mesh(device_type, (dp, pp), mesh_dim_names=("dp", "pp"))
    return init_device_mesh(
        device_type, (dp_replicate, dp // dp_replicate, pp), mesh_dim_names=(*_HSDP_DIMS, "pp")
    )


def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """What FSDP shards over: the 1-D ``"dp"`` mesh, or the 2-D ``("dp_replicate", "dp_shard")`` mesh
    (HSDP) when the mesh has those dimensions. A mesh without ``"pp"`` is returned as it is (already a
    data-parallel mesh)."""
    names = tuple(mesh.mesh_dim_names or ())
    if "pp" not in names:
        return mesh
    if all(n in names for n in _HSDP_DIMS):
        return mesh[_HSDP_DIMS]
    if "dp" not in names:
        raise MeshError(f"the mesh has dimensions {names}; expected 'dp' or 'dp_replicate' and 'dp_shard'")
    return mesh["dp"]


def pp_rank(mesh: DeviceMesh) -> int:
    """This process's pipeline rank."""
    return mesh.get_local_rank("pp")


def dp_rank(mesh: DeviceMesh) -> int:
    """This process's data-parallel rank (HSDP: ``replicate_rank * dp_shard + shard_rank``)."""
    names = tuple(mesh.mesh_dim_names or ())
    if "dp" in names:
        return mesh.get_local_rank("dp")
    replicate, shard = (names.index(n) for n in _HSDP_DIMS)
    return mesh.get_local_rank(replicate) * mesh.size(shard) + mesh.get_local_rank(shard)
