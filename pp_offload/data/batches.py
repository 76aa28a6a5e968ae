"""Deterministic, resumable, data-parallel batches of packed blocks.

A training run that restarts from a checkpoint must see exactly the batches the uninterrupted run would have
seen, without saving any sampler state. So ``batch(step)`` is a pure function of ``(seed, step)``: the
epoch is ``step // len(self)``, each epoch visits the blocks in a permutation seeded by ``(seed, epoch)``, and
step ``step`` takes the next ``global_batch_size`` rows of it. Resuming is calling ``batch(step)`` from the
saved step.

Data-parallel ranks build the same global batch and each takes its contiguous slice, so no rank needs to talk
to another about data. Each batch also carries the number of learned targets in the *global* batch, so every
rank can divide its summed loss by the same global count (the mean over all tokens of all ranks) without an
all-reduce.

Memory: the blocks are read through `pp_offload.data.blocks.PackedBlocks` (memory-mapped when prepared), and
a step copies only this rank's rows; the per-epoch permutation (8 bytes a block) and the per-block target
counts (8 bytes a block) are the only arrays that grow with the data.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from pp_offload.data.blocks import PACKED_COLUMNS, PackedBlocks
from pp_offload.data.errors import DataError

if TYPE_CHECKING:
    import datasets
    import torch


class PackedBatches:
    """Deterministic, resumable batches: batch(step) is a pure function of (seed, step), so a resumed run sees
    exactly the batches an uninterrupted run would, and data-parallel ranks split one global batch."""

    def __init__(
        self,
        packed: datasets.Dataset | PackedBlocks,
        global_batch_size: int,
        *,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
    ) -> None:
        check_split(global_batch_size, dp_rank, dp_size)
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        if not isinstance(packed, PackedBlocks):
            missing = [name for name in PACKED_COLUMNS if name not in packed.column_names]
            if missing:
                raise DataError(
                    f"not a packed dataset: missing columns {missing} (it has {packed.column_names})"
                )
            packed = PackedBlocks(packed.with_format("arrow")[:])
        if len(packed) < global_batch_size:
            raise DataError(
                f"only {len(packed)} packed blocks, fewer than one global batch of {global_batch_size}: "
                "add data, lower seq_len or lower the global batch size"
            )
        self.global_batch_size = global_batch_size
        self.local_batch_size = global_batch_size // dp_size
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self._blocks = packed
        self._targets = packed.targets  # learned targets per block: a batch's global count reads no rows
        self._epoch: int | None = None
        self._order: np.ndarray | None = None

    @property
    def num_blocks(self) -> int:
        """Packed blocks available (each epoch uses ``len(self) * global_batch_size`` of them)."""
        return len(self._targets)

    def __len__(self) -> int:
        """Steps per epoch; the last incomplete global batch is dropped."""
        return self.num_blocks // self.global_batch_size

    def permutation(self, epoch: int) -> np.ndarray:
        """The order in which ``epoch`` visits the blocks (the same in every process)."""
        if epoch != self._epoch:
            self._order = np.random.default_rng([self.seed, epoch]).permutation(self.num_blocks)
            self._epoch = epoch
        assert self._order is not None
        return self._order

    def batch(self, step: int) -> dict[str, torch.Tensor]:
        """This rank's rows of global batch ``step``.

        int64 ``input_ids``, ``labels``, ``position_ids`` of shape
        ``(global_batch_size // dp_size, seq_len)``,
        ``num_target_tokens``, the 0-d count of labels != -100 in the whole global batch (all ranks), and
        ``packed_rows``, whether each row packs several documents (`pp_offload.models.masks.packed_rows`).
        The last two are host facts: `to_device` leaves them on the CPU.
        """
        import torch

        from pp_offload.models.masks import packed_rows

        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        epoch, index = divmod(step, len(self))
        rows = self.permutation(epoch)[index * self.global_batch_size : (index + 1) * self.global_batch_size]
        mine = rows[self.dp_rank * self.local_batch_size : (self.dp_rank + 1) * self.local_batch_size]
        data = self._blocks.rows(mine)
        out = {name: torch.from_numpy(data[name].astype(np.int64)) for name in PACKED_COLUMNS}
        out["num_target_tokens"] = torch.tensor(int(self._targets[rows].sum()), dtype=torch.int64)
        out["packed_rows"] = packed_rows(out["position_ids"])
        return out


def check_split(global_batch_size: int, dp_rank: int, dp_size: int) -> None:
    """Raise a `ValueError` unless ``dp_size`` ranks can each take rank ``dp_rank``'s equal share of a
    global batch."""
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"need 0 <= dp_rank < dp_size, got dp_rank={dp_rank}, dp_size={dp_size}")
    if global_batch_size < 1 or global_batch_size % dp_size:
        raise ValueError(
            f"global_batch_size must be a positive multiple of dp_size={dp_size}, got {global_batch_size}"
        )


HOST_KEYS = ("num_target_tokens", "packed_rows")  # packed_rows: pp_offload.models.masks.PACKED_ROWS_KEY
"""Batch entries the step reads on the host (the loss's target count, the masks' packed rows): kept on the
CPU, so reading them never waits for the device."""


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """``batch`` with its tensors on ``device``, except the host facts (`HOST_KEYS`): they stay on the CPU."""
    return {k: v if k in HOST_KEYS else v.to(device) for k, v in batch.items()}
