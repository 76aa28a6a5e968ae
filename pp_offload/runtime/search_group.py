"""The pipeline ranks' process group as the order search's `pp_offload.order.spread.Gather`.

Why: every rank of a pipeline builds the same order when its schedule is constructed. With this, the
ranks split the search's independent tasks between them and exchange the results (one
``all_gather_object`` per batch of tasks), so start-up costs each rank a share of the search instead of
all of it, and every rank still gets exactly the order a single process would build.

The exchange uses the group's own timeout (the one it was created with): a rank that never arrives
makes the others fail after that, never wait forever. On a NCCL group the pickled objects travel
through the rank's GPU, so the exchange runs under the stages' CUDA device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["GroupGather", "stage_gather"]


class GroupGather:
    """`Gather` over a torch process group (``None``: the default group)."""

    def __init__(self, group: Any = None, device: torch.device | None = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.device = device

    def all_gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.size
        on_gpu = self.device is not None and self.device.type == "cuda"
        with torch.cuda.device(self.device) if on_gpu else contextlib.nullcontext():
            dist.all_gather_object(out, obj, group=self.group)
        return out


def stage_gather(stages: Sequence[Any]) -> GroupGather | None:
    """The gather of the group the stages communicate in, or None where there is nothing to spread over
    (no initialised process group, a group of one, or mock stages without a group)."""
    if not stages or not dist.is_available() or not dist.is_initialized():
        return None
    stage = stages[0]
    group = getattr(stage, "group", None)
    size = getattr(stage, "group_size", None)
    try:
        if size is None or size <= 1 or dist.get_world_size(group) != size:
            return None
        if dist.get_rank(group) != getattr(stage, "group_rank", None):
            return None
    except (RuntimeError, ValueError):  # a rank outside that group
        return None
    device = getattr(stage, "device", None)
    return GroupGather(group, device if isinstance(device, torch.device) else None)
