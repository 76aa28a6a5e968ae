"""Host buffers for offloaded activations, per dtype, reused across steps (pinned on CUDA).

Why a module of its own: the activation store (`pp_offload.runtime.store`) decides what to copy and when;
where the bytes land in host memory, and how buffers are reused so that no step after the first allocates
pinned memory (a slow, synchronizing ``cudaHostAlloc``), is a separate job with its own rules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["HostPool", "PoolStats"]

_MIN_POOL_BYTES = 1 << 16


@dataclass(frozen=True)
class PoolStats:
    """Host buffers of one dtype (pinned on CUDA)."""

    buffers: int
    bytes: int
    in_use: int



class HostPool:
    """Host buffers per dtype, reused across steps.

    A chunk takes one buffer per dtype (best fit) and gives it back at release, so after the first step
    the pool holds as many buffers per dtype as chunks are ever offloaded at once, and no allocation (a
    slow, synchronizing ``cudaHostAlloc`` for pinned memory) happens in later steps. Sizes are rounded up
    to a power of two bytes: torch's pinned allocator rounds that way anyway, and chunks of slightly
    different sizes (a shorter last microbatch) then share buffers. When no free buffer is large enough
    and a smaller one is free, that one is dropped and a larger one allocated: the pool grows in size,
    not in count.

    Each free buffer carries the CUDA event of the last copy that used it (None on CPU): a new offload
    into it must not start before that copy ends. On one copy stream that holds by stream order; with a
    separate reload stream the offload's stream waits on the event (on the GPU, no host sync). A dropped
    buffer goes back to torch's host allocator, which itself waits for the copies that used it.
    """

    def __init__(self, *, pin_memory: bool) -> None:
        self._pin = pin_memory
        self._free: dict[torch.dtype, list[tuple[torch.Tensor, Any]]] = {}
        self._buffers: dict[torch.dtype, int] = {}
        self._bytes: dict[torch.dtype, int] = {}
        self._in_use: dict[torch.dtype, int] = {}

    def take(self, dtype: torch.dtype, numel: int) -> tuple[torch.Tensor, Any]:
        """A buffer of at least ``numel`` elements and the event of its last use (or None)."""
        free = self._free.setdefault(dtype, [])
        best = None
        for i, (buf, _) in enumerate(free):
            if buf.numel() >= numel and (best is None or buf.numel() < free[best][0].numel()):
                best = i
        if best is not None:
            taken = free.pop(best)
        else:
            if free:  # grow: replace the largest free buffer (too small) instead of adding one
                largest = max(range(len(free)), key=lambda i: free[i][0].numel())
                dropped, _ = free.pop(largest)
                self._buffers[dtype] -= 1
                self._bytes[dtype] -= dropped.nbytes
            itemsize = dtype.itemsize
            nbytes = max(_MIN_POOL_BYTES, 1 << (numel * itemsize - 1).bit_length())
            taken = (torch.empty(nbytes // itemsize, dtype=dtype, pin_memory=self._pin), None)
            self._buffers[dtype] = self._buffers.get(dtype, 0) + 1
            self._bytes[dtype] = self._bytes.get(dtype, 0) + taken[0].nbytes
        self._in_use[dtype] = self._in_use.get(dtype, 0) + 1
        return taken

    def give(self, buf: torch.Tensor, last_use: Any) -> None:
        self._free.setdefault(buf.dtype, []).append((buf, last_use))
        self._in_use[buf.dtype] -= 1

    def stats(self) -> dict[torch.dtype, PoolStats]:
        return {
            dt: PoolStats(buffers=n, bytes=self._bytes[dt], in_use=self._in_use.get(dt, 0))
            for dt, n in self._buffers.items()
        }
