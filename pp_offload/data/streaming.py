"""``data.streaming: true``: batches packed on the fly from a `datasets.IterableDataset`, for data too big
to prepare (a hub dataset or local files), with the first step after a few hundred rows, whatever the size.

The stream is the data's documents, pass after pass, tokenized and cut into blocks exactly as
`pp_offload.data.packing` does (`pp_offload.data.blocks.Packer`, in order: no shuffling, so shuffle the
files beforehand if their order matters). Global batch ``step`` is blocks ``step * G`` to ``(step + 1) * G``
of that stream (G: the global batch size), so a batch is a pure function of the step, as with prepared data:

- each data-parallel rank reads and tokenizes the stream and keeps its slice of each global batch. No rank
  talks to another about data, and a run resumed with another data-parallel size sees the same global
  batches. The price: every rank tokenizes every row (tokenizing is rarely the bottleneck of a step);
- resuming at step ``s`` skips the first ``s * G`` blocks: it reads and tokenizes every row before them
  again (at the rate `bench/bench_data.py` reports as rows/s), and trains nothing meanwhile. Exact, and it
  needs no state in the checkpoint; for a resume deep into a huge stream, prepared data (the default)
  costs nothing to skip.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from pp_offload.data.batches import check_split
from pp_offload.data.blocks import PACKED_COLUMNS, TARGETS_COLUMN, Packer
from pp_offload.data.config import DataConfig
from pp_offload.data.errors import DataError
from pp_offload.data.loading import read_error
from pp_offload.data.packing import SkipCounts, tokenize_batch

if TYPE_CHECKING:
    import datasets
    import torch

__all__ = ["StreamingBatches"]

#: Raw rows tokenized at a time.
ROWS_PER_READ = 1_000


class StreamingBatches:
    """`pp_offload.data.PackedBatches`' interface (``batch(step)``) over a stream packed on the fly.

    ``examples`` opens the stream (a `datasets.IterableDataset`, from the start) and is called again for
    each pass over the data, and to go back to an earlier step. ``skipped_rows`` counts the rows read only
    to reach a step (a resume's cost); ``counts`` the rows of one pass skipped for having nothing to learn
    (complete once the first pass is read). ``report`` is called once with that count's line (``data:
    skipped 12 of 2,000 rows: empty or null response``) when the first pass ends, if any row was skipped.
    """

    def __init__(
        self,
        examples: Callable[[], datasets.IterableDataset],
        tokenizer: Any,
        config: DataConfig,
        global_batch_size: int,
        *,
        dp_rank: int = 0,
        dp_size: int = 1,
        report: Callable[[str], None] | None = None,
    ) -> None:
        check_split(global_batch_size, dp_rank, dp_size)
        eos = getattr(tokenizer, "eos_token_id", None)
        if eos is None:
            raise DataError("the tokenizer has no eos token; packing needs one to separate documents")
        self._open, self._tokenizer, self._config, self._eos = examples, tokenizer, config, int(eos)
        self._report = report
        self.global_batch_size = global_batch_size
        self.local_batch_size = global_batch_size // dp_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.counts = SkipCounts()
        self.skipped_rows = 0
        self._batches: Iterator[dict[str, np.ndarray]] | None = None
        self._next = 0  # the step the iterator yields next
        self._last: tuple[int, dict[str, np.ndarray]] | None = None
        self._rows_read = 0

    def batch(self, step: int) -> dict[str, torch.Tensor]:
        """This rank's rows of global batch ``step``: the same entries as `PackedBatches.batch`."""
        import torch

        from pp_offload.models.masks import packed_rows

        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if self._last is not None and self._last[0] == step:
            whole = self._last[1]
        else:
            if self._batches is None or step < self._next:  # back to the start of the stream
                self._batches, self._next = self._global_batches(), 0
            while self._next < step:
                before = self._rows_read
                next(self._batches)
                self.skipped_rows += self._rows_read - before
                self._next += 1
            whole = next(self._batches)
            self._next += 1
            self._last = (step, whole)
        mine = slice(self.dp_rank * self.local_batch_size, (self.dp_rank + 1) * self.local_batch_size)
        out = {name: torch.from_numpy(whole[name][mine].astype(np.int64)) for name in PACKED_COLUMNS}
        out["num_target_tokens"] = torch.tensor(int(whole[TARGETS_COLUMN].sum()), dtype=torch.int64)
        out["packed_rows"] = packed_rows(out["position_ids"])
        return out

    def _global_batches(self) -> Iterator[dict[str, np.ndarray]]:
        """Global batches of the block stream: passes over the data, packed as one stream."""
        packer = Packer(self._config.seq_len)
        pending: list[dict[str, np.ndarray]] = []
        size = 0
        first = True
        while True:
            documents = packer.documents
            for blocks in self._pass(packer, count=first and self.counts.rows == 0):
                pending.append(blocks)
                size += len(blocks[TARGETS_COLUMN])
                while size >= self.global_batch_size:
                    joined = {name: np.concatenate([p[name] for p in pending]) for name in pending[0]}
                    yield {name: value[: self.global_batch_size] for name, value in joined.items()}
                    rest = {name: value[self.global_batch_size :] for name, value in joined.items()}
                    size -= self.global_batch_size
                    pending = [rest] if size else []
            if packer.documents == documents:
                raise DataError(
                    f"the stream of {self._config.path!r} (split {self._config.split!r}) holds no document "
                    "with text to learn"
                )
            if first and self._report is not None and (note := self.counts.note()):
                self._report(f"data: {note}")
                self._report = None  # once, even when the stream is opened again
            first = False

    def _pass(self, packer: Packer, *, count: bool) -> Iterator[dict[str, np.ndarray]]:
        """One pass over the data: its blocks as numpy arrays, as the rows come (skipped rows counted into
        ``counts`` if ``count``: the first pass of this object, so each row once)."""
        import pyarrow as pa

        for rows in _rows(self._open(), self._config):
            tokenized = tokenize_batch(rows, self._tokenizer, self._config, self._eos)
            codes = np.asarray(tokenized["skip"], np.int8)
            if count:
                self.counts.add(codes)
            self._rows_read += len(codes)
            kept = np.flatnonzero(codes == 0)
            ids = pa.array([tokenized["ids"][i] for i in kept], type=pa.list_(pa.int32()))
            prompts = np.asarray(tokenized["n_prompt"], np.int64)[kept]
            batch = packer.add(ids, prompts)
            if batch is not None:
                yield {
                    name: _matrix(batch.column(name))
                    if name != TARGETS_COLUMN
                    else batch.column(name).to_numpy()
                    for name in (*PACKED_COLUMNS, TARGETS_COLUMN)
                }


def _rows(stream: datasets.IterableDataset, config: DataConfig) -> Iterator[dict[str, list]]:
    """The stream's rows, ``ROWS_PER_READ`` at a time; a read failure (a malformed line) as a `DataError`
    naming the file and the line where it can."""
    rows = stream.iter(batch_size=ROWS_PER_READ)
    while True:
        try:
            batch = next(rows)
        except StopIteration:
            return
        except DataError:
            raise
        except Exception as error:  # datasets raises many types while parsing (ArrowInvalid, ValueError...)
            raise read_error(config, error) from error
        yield batch


def _matrix(column: Any) -> np.ndarray:
    return column.flatten().to_numpy().reshape(len(column), column.type.list_size)
