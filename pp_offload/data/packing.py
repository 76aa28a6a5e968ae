"""Tokenize examples and pack them into fixed-length training blocks, with the labels the loss needs.

Why packing: padding each example to ``seq_len`` wastes compute on pad tokens, and a pipeline wants every
microbatch the same shape. So every document (plus eos) is appended to one token stream, and the stream is cut
into blocks of ``L = seq_len`` inputs. Block ``i`` is ``stream[i*L : i*L + L + 1]``: inputs are its first L
tokens, labels its last L, so the last label of a block is the first input of the next and no target is lost.

Documents must not see each other: ``position_ids`` restart at 0 at each document start (and at the block
start), and transformers builds a block-diagonal causal mask from such position ids. Labels are -100 (ignored
by the loss) where the target is the first token of a new document (nothing in the previous one predicts it;
as in transformers' ``DataCollatorWithFlattening``) and, for supervised fine-tuning, where the target is a
prompt token, so only responses (and their eos) are learned.

The stream is held in memory as numpy arrays: fine for fine-tuning sized data (a billion tokens is ~8 GB).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from pp_offload.data.config import DataConfig
from pp_offload.data.errors import DataError
from pp_offload.data.loading import require_columns

if TYPE_CHECKING:
    import datasets

#: Label value ignored by `torch.nn.functional.cross_entropy` (its default ``ignore_index``).
IGNORE_INDEX = -100
#: Columns of a packed dataset, each a list of ``seq_len`` ints per block.
PACKED_COLUMNS = ("input_ids", "labels", "position_ids")


def pack_examples(examples: datasets.Dataset, tokenizer: Any, config: DataConfig) -> datasets.Dataset:
    """Blocks of ``config.seq_len`` tokens with ``input_ids``, ``labels`` and ``position_ids`` (int32 lists).

    Texts are tokenized without special tokens (no bos) and each document gets ``tokenizer.eos_token_id``
    appended. Empty or missing (None) texts are skipped. The incomplete tail block is dropped.
    """
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise DataError("the tokenizer has no eos token; packing needs one to separate documents")
    require_columns(examples, config)
    tokenized = examples.map(
        _tokenize,
        batched=True,
        remove_columns=examples.column_names,
        fn_kwargs={"tokenizer": tokenizer, "config": config, "eos": int(eos)},
        desc="Tokenizing",
    )
    table = tokenized.with_format("arrow")[:]
    ids = table.column("ids").combine_chunks()
    stream = ids.flatten().to_numpy(zero_copy_only=False).astype(np.int64)
    lengths = ids.value_lengths().to_numpy(zero_copy_only=False).astype(np.int64)
    prompt_lengths = table.column("n_prompt").to_numpy().astype(np.int64)
    return _blocks(stream, lengths, prompt_lengths, config.seq_len)


def _tokenize(batch: dict[str, list], tokenizer: Any, config: DataConfig, eos: int) -> dict[str, list]:
    """Token ids of each document (prompt + response + eos) and how many of them are prompt tokens."""

    def encode(texts: list[str | None]) -> list[list[int]]:
        return tokenizer([text or "" for text in texts], add_special_tokens=False, verbose=False)["input_ids"]

    if config.prompt_column is not None and config.response_column is not None:
        # Tokenized apart so the prompt/response boundary falls exactly between two tokens.
        prompts = encode(batch[config.prompt_column])
        responses = encode(batch[config.response_column])
    else:
        responses = encode(batch[config.text_column])
        prompts = [[] for _ in responses]
    out: dict[str, list] = {"ids": [], "n_prompt": []}
    for prompt, response in zip(prompts, responses, strict=True):
        if prompt or response:
            out["ids"].append([*prompt, *response, eos])
            out["n_prompt"].append(len(prompt))
    return out


def _blocks(
    stream: np.ndarray, lengths: np.ndarray, prompt_lengths: np.ndarray, seq_len: int
) -> datasets.Dataset:
    """Cut the token stream of documents with ``lengths`` into blocks (see the module docstring)."""
    import datasets
    import pyarrow as pa

    n_tokens, L = len(stream), seq_len
    n_blocks = (n_tokens - 1) // L if n_tokens > 0 else 0
    if n_blocks == 0:
        raise DataError(
            f"too little data: {n_tokens} tokens in {len(lengths)} documents after tokenization, but "
            f"seq_len={L} needs at least {L + 1} for one block; add data or lower seq_len"
        )
    doc_starts = np.cumsum(lengths) - lengths
    offset_in_doc = np.arange(n_tokens) - np.repeat(doc_starts, lengths)
    # A target is learned unless it opens a document or belongs to a prompt (the first token is both in SFT).
    learned = (offset_in_doc > 0) & (offset_in_doc >= np.repeat(prompt_lengths, lengths))

    column = np.arange(L)
    index = np.arange(n_blocks)[:, None] * L + column[None, :]
    input_ids = stream[index]
    labels = np.where(learned[index + 1], stream[index + 1], IGNORE_INDEX)
    position_ids = np.minimum(offset_in_doc[index], column[None, :])  # restart at the block start too

    def as_lists(matrix: np.ndarray) -> pa.Array:
        return pa.FixedSizeListArray.from_arrays(pa.array(matrix.reshape(-1).astype(np.int32)), L)

    matrices = (input_ids, labels, position_ids)
    table = pa.table({name: as_lists(m) for name, m in zip(PACKED_COLUMNS, matrices, strict=True)})
    return datasets.Dataset(table)
