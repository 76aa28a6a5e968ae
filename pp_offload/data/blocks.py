"""Packed blocks at constant memory: cut documents into blocks a chunk at a time, and read blocks by index
from memory-mapped Arrow files.

Why chunks: holding the whole token stream (and the index matrices cut from it) costs ~2 KB per 100-byte row
in every rank, so memory grew with the dataset. `Packer` takes the tokenized documents a chunk at a time and
carries the unfinished tail over to the next chunk; the blocks are exactly those of cutting the whole stream
(see `pp_offload.data.packing`), so the batches a run sees do not depend on the chunk size.

Why Arrow record batches of fixed-size int32 lists: the prepared file is memory-mapped by every rank, and a
fixed-size list column's values are one contiguous int32 buffer per record batch, so `PackedBlocks` reads it
as ``(blocks, seq_len)`` numpy views without copying. A rank copies only the rows of its own batches. The
learned-target count of each block (``num_targets``) is stored with it, so the global count of a batch needs
no labels matrix.
"""

from __future__ import annotations

import mmap
import os
from typing import TYPE_CHECKING

import numpy as np

from pp_offload.data.errors import DataError

if TYPE_CHECKING:
    import pyarrow as pa

#: Label value ignored by `torch.nn.functional.cross_entropy` (its default ``ignore_index``).
IGNORE_INDEX = -100
#: Columns of a packed dataset, each a list of ``seq_len`` ints per block.
PACKED_COLUMNS = ("input_ids", "labels", "position_ids")
#: The per-block count of learned targets (labels != IGNORE_INDEX), stored when the blocks are prepared.
TARGETS_COLUMN = "num_targets"


def block_schema(seq_len: int) -> pa.Schema:
    """The Arrow schema of packed blocks: three ``seq_len``-long int32 lists and the target count."""
    import pyarrow as pa

    lists = [pa.field(name, pa.list_(pa.int32(), seq_len)) for name in PACKED_COLUMNS]
    return pa.schema([*lists, pa.field(TARGETS_COLUMN, pa.int32())])


class Packer:
    """Cuts a stream of tokenized documents into ``seq_len`` blocks, one chunk of documents at a time.

    ``add`` returns the blocks the documents so far complete (an Arrow record batch, or None) and keeps the
    rest, at most ``seq_len`` tokens, for the next chunk. ``documents`` and ``tokens`` count what went in.
    """

    def __init__(self, seq_len: int) -> None:
        if seq_len < 1:
            raise DataError(f"seq_len must be >= 1, got {seq_len}")
        self.seq_len = seq_len
        self.documents = 0
        self.tokens = 0
        self.blocks = 0
        self._ids = np.empty(0, np.int32)
        self._offsets = np.empty(0, np.int64)  # each token's position in its document
        self._learned = np.empty(0, bool)  # whether the token is learned as a target

    def add(self, ids: pa.Array | pa.ChunkedArray, prompt_lengths: np.ndarray) -> pa.RecordBatch | None:
        """Append documents (``ids``: a list array of token ids, eos included; ``prompt_lengths``: their
        masked prompt tokens) and return the blocks they complete."""
        import pyarrow as pa

        if isinstance(ids, pa.ChunkedArray):
            ids = ids.combine_chunks()
        lengths = ids.value_lengths().to_numpy(zero_copy_only=False).astype(np.int64)
        flat = ids.flatten().to_numpy(zero_copy_only=False).astype(np.int32)
        self.documents += len(lengths)
        self.tokens += len(flat)
        starts = np.cumsum(lengths) - lengths
        offsets = np.arange(len(flat), dtype=np.int64) - np.repeat(starts, lengths)
        # A target is learned unless it opens a document or belongs to a prompt (in SFT the first is both).
        learned = (offsets > 0) & (offsets >= np.repeat(np.asarray(prompt_lengths, np.int64), lengths))
        stream = np.concatenate([self._ids, flat])
        offsets = np.concatenate([self._offsets, offsets])
        learned = np.concatenate([self._learned, learned])
        L = self.seq_len
        count = (len(stream) - 1) // L if len(stream) else 0
        # Block i is stream[i*L : i*L + L + 1]: the tail from count*L on starts the next block.
        self._ids, self._offsets, self._learned = (
            stream[count * L :],
            offsets[count * L :],
            learned[count * L :],
        )
        if count == 0:
            return None
        self.blocks += count
        column = np.arange(L)
        index = np.arange(count)[:, None] * L + column[None, :]
        labels = np.where(learned[index + 1], stream[index + 1], IGNORE_INDEX).astype(np.int32)
        matrices = {
            "input_ids": stream[index],
            "labels": labels,
            "position_ids": np.minimum(offsets[index], column[None, :]).astype(np.int32),  # restart per block
        }
        arrays = [pa.FixedSizeListArray.from_arrays(pa.array(m.reshape(-1)), L) for m in matrices.values()]
        targets = pa.array((labels != IGNORE_INDEX).sum(axis=1).astype(np.int32))
        return pa.RecordBatch.from_arrays([*arrays, targets], schema=block_schema(L))

    def check(self) -> None:
        """Raise a `DataError` if the documents so far fill no block at all."""
        if self.blocks == 0:
            raise DataError(
                f"too little data: {self.tokens} tokens in {self.documents} documents after tokenization, "
                f"but seq_len={self.seq_len} needs at least {self.seq_len + 1} for one block; add data or "
                "lower seq_len"
            )


class PackedBlocks:
    """Packed blocks read by index without copying the table: numpy views over its record batches.

    Built from any Arrow table with the `PACKED_COLUMNS` (and `TARGETS_COLUMN`, else counted here, one
    record batch at a time); `open` memory-maps a prepared file, so the blocks cost no memory until read.
    """

    def __init__(self, table: pa.Table, *, mapping: mmap.mmap | None = None) -> None:
        missing = [name for name in PACKED_COLUMNS if name not in table.column_names]
        if missing:
            raise DataError(f"not a packed dataset: missing columns {missing} (it has {table.column_names})")
        self._views: dict[str, list[np.ndarray]] = {name: [] for name in PACKED_COLUMNS}
        counts = []
        for batch in table.to_batches():
            if batch.num_rows == 0:
                continue
            for name in PACKED_COLUMNS:
                self._views[name].append(_rows_view(batch.column(name)))
            if TARGETS_COLUMN in table.column_names:
                counts.append(batch.column(TARGETS_COLUMN).to_numpy(zero_copy_only=False))
            else:
                counts.append((self._views["labels"][-1] != IGNORE_INDEX).sum(axis=1))
        sizes = [len(view) for view in self._views["input_ids"]]
        self._starts = np.cumsum([0, *sizes])
        self.targets = np.concatenate(counts).astype(np.int64) if counts else np.empty(0, np.int64)
        self.seq_len = self._views["input_ids"][0].shape[1] if sizes else 0
        self._table = table  # keeps the buffers the views point into alive
        self._mapping = mapping

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> PackedBlocks:
        """The blocks of an Arrow stream file written by preparation, memory-mapped (no copy).

        The mapping is read without readahead (a block is a few KB, read at random), and the pages a read
        touched are dropped from this process after it (`rows`): they stay in the page cache, shared by
        the ranks, but this rank's resident memory does not grow with the blocks an epoch visits."""
        import pyarrow as pa

        with open(path, "rb") as file:
            mapping = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        if hasattr(mmap, "MADV_RANDOM"):
            mapping.madvise(mmap.MADV_RANDOM)
        table = pa.ipc.open_stream(pa.py_buffer(mapping)).read_all()
        return cls(table, mapping=mapping)

    def __len__(self) -> int:
        return len(self.targets)

    def rows(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """The blocks at ``indices`` (in that order) as ``(len(indices), seq_len)`` int32 arrays: a copy
        of those rows only."""
        indices = np.asarray(indices, dtype=np.int64)
        which = np.searchsorted(self._starts, indices, side="right") - 1
        local = indices - self._starts[which]
        rows = {
            name: np.stack([views[c][r] for c, r in zip(which.tolist(), local.tolist(), strict=True)])
            if len(indices)
            else np.empty((0, self.seq_len), np.int32)
            for name, views in self._views.items()
        }
        if self._mapping is not None and hasattr(mmap, "MADV_DONTNEED"):
            self._mapping.madvise(mmap.MADV_DONTNEED)  # copied: let the pages go (see `open`)
        return rows


def _rows_view(column: pa.Array) -> np.ndarray:
    """A fixed-size (or equal-length) list column as a ``(rows, width)`` array, without a copy when the
    column is already a fixed-size int list."""
    import pyarrow as pa

    if pa.types.is_fixed_size_list(column.type):
        width = column.type.list_size
        values = column.flatten()  # respects a slice's offset
    else:
        lengths = column.value_lengths().to_numpy(zero_copy_only=False)
        if len(lengths) and (lengths != lengths[0]).any():
            raise DataError("packed rows must all have the same length")
        width = int(lengths[0]) if len(lengths) else 0
        values = column.flatten()
    array = values.to_numpy(zero_copy_only=False)
    return array.reshape(len(column), width)
