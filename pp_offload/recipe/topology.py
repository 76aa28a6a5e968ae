"""Where this process sits in the job: rank, world, pipeline x data-parallel sizes, its device and the
process group it joins (with torchrun's restart-safe store).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pp_offload.recipe.config import ConfigError, RecipeConfig

__all__ = [
    "Topology",
    "device_for",
    "init_process_group",
    "launcher_store",
    "machine_preset",
    "restart_count",
    "topology",
]


@dataclass(frozen=True)
class Topology:
    """Where this process sits: ``rank`` of ``world`` processes, ``pp`` pipeline ranks x ``dp`` replicas."""

    rank: int
    world: int
    local_rank: int
    pp: int
    dp: int

    @property
    def pp_rank(self) -> int:
        return self.rank % self.pp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.pp

    @property
    def distributed(self) -> bool:
        return self.world > 1


def topology(config: RecipeConfig, *, world: int | None = None) -> Topology:
    """Read rank and world size from the launcher's environment (torchrun, accelerate launch) and check them
    against the config's pipeline and data-parallel sizes. ``world``: check for that many processes
    instead, as rank 0 (a launcher checking a config before it starts them)."""
    if world is not None:
        rank = 0
    elif dist.is_available() and dist.is_initialized():  # the caller made the group (tests, notebooks)
        world, rank = dist.get_world_size(), dist.get_rank()
    else:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dp = int(config.pipeline.dp)
    if config.pipeline.pp is None and world % dp:
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        raise ConfigError(
            f"world size {world} is not a multiple of pipeline.dp={dp} (pipeline ranks = world size / dp): "
            f"launch a multiple of {dp} processes, or use a pipeline.dp among {divisors}"
        )
    pp = config.pipeline.pp if config.pipeline.pp is not None else world // dp
    if pp < 1 or pp * dp != world:
        raise ConfigError(
            f"world size {world} is not pipeline.pp x pipeline.dp = {config.pipeline.pp} x {dp}: launch "
            f"{max(pp, 1) * dp} processes or change pipeline.pp / pipeline.dp"
        )
    replicate = int(config.pipeline.dp_replicate)
    if replicate < 1 or dp % replicate:
        raise ConfigError(
            f"pipeline.dp_replicate={replicate} must divide pipeline.dp={dp} (HSDP: dp = dp_replicate x "
            f"dp_shard); pick one of {[d for d in range(1, dp + 1) if dp % d == 0]}"
        )
    return Topology(rank=rank, world=world, local_rank=local_rank, pp=pp, dp=dp)


def device_for(config: RecipeConfig, topo: Topology) -> torch.device:
    """``train.device``: ``auto`` picks this rank's GPU when there is one, else the CPU; ``cuda`` this rank's
    GPU (a machine without one is refused by `pp_offload.recipe.preflight.preflight`, and here by the count
    of devices)."""
    choice = config.train.device
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":
        # joined before the recipe ran (a test harness, a notebook): gloo carries no CUDA tensors
        if choice == "cuda":
            raise ConfigError(
                "train.device=cuda, but the process group was initialized with the gloo backend, which "
                "cannot send CUDA tensors between pipeline stages; initialize it with nccl, or let the "
                "recipe do it"
            )
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if topo.local_rank >= count:
        raise ConfigError(
            f"rank {topo.rank} (local rank {topo.local_rank}) needs its own GPU, cuda:{topo.local_rank}, but "
            f"this machine shows {count} CUDA device(s): launch at most {count} process(es) per node "
            "(torchrun --nproc-per-node), or train.device=cpu; ranks cannot share a GPU (NCCL refuses a "
            "communicator between two ranks on one device)"
        )
    torch.cuda.set_device(topo.local_rank)
    return torch.device("cuda", topo.local_rank)


def init_process_group(config: RecipeConfig, topo: Topology, device: torch.device) -> bool:
    """Join the job's process group (gloo on CPU, NCCL on CUDA) with the configured collective timeout.

    Returns whether it created the group (and so should destroy it at the end)."""
    if not topo.distributed or dist.is_initialized():
        return False
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=float(config.train.timeout_s))
    store = launcher_store(timeout)
    if store is None:
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, store=store, rank=topo.rank, world_size=topo.world, timeout=timeout)
    return True


def launcher_store(timeout: datetime.timedelta) -> dist.Store | None:
    """Under torchrun: the agent's key-value store, with keys private to this restart; else None.

    Why: torchrun's workers share the store its agent hosts (``TORCHELASTIC_USE_AGENT_STORE``), and that
    store lives across ``--max-restarts`` rounds, so the keys by which the gloo (or NCCL) ranks of round
    0 found each other are still there when the workers of round 1 start. A restarted rank that reads
    them before its peer has written its new address connects to the dead one (gloo's ``connectFullMesh``:
    connection refused) or waits for a peer that never answers; a plain script whose ranks start within
    milliseconds of each other rarely loses that race, the recipe (seconds of data loading first) often
    does. Prefixing every key with the restart count gives each round a clean namespace.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=False,
        timeout=timeout,
    )
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"pp_offload/{run_id}/restart_{restart}", store)


def restart_count() -> int:
    """How many times torchrun restarted this job's workers (0 outside torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def machine_preset(device: torch.device) -> str:
    """The planner's preset for ``device``: the CUDA device's name when it names one (GH200 before H200 and
    H100, which its name contains), else H100 (a CPU run rehearses a GPU one)."""
    from pp_offload.plan.machines import MACHINES

    if device.type == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(device).upper()
        for preset in sorted(MACHINES, key=len, reverse=True):
            if preset.upper() in name:
                return preset
    return "H100"
