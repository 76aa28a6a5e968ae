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

The stream is cut a chunk of documents at a time (`pp_offload.data.blocks.Packer`), so memory does not grow
with the data; `pp_offload.data.prepared` writes the blocks to a shared, memory-mapped cache.

Rows with nothing to learn are skipped and counted (`SkipCounts`): an empty or null text, or in supervised
fine-tuning an empty or null response (a prompt alone would teach only the eos).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from pp_offload.data.blocks import IGNORE_INDEX, PACKED_COLUMNS, Packer
from pp_offload.data.config import PROMPT_FIELD, DataConfig, require_columns
from pp_offload.data.errors import DataError

if TYPE_CHECKING:
    import datasets
    import pyarrow as pa

__all__ = [
    "IGNORE_INDEX",
    "PACKED_COLUMNS",
    "SkipCounts",
    "format_examples",
    "pack_examples",
    "pack_tokenized",
    "tokenize_batch",
    "tokenize_examples",
]

#: Rows of tokenized documents read at a time while packing: bounds packing's memory.
CHUNK_ROWS = 16_384
#: Why a row is skipped, by the code `tokenize_examples` writes in its ``skip`` column (0: kept).
SKIP_REASONS = {1: "empty or null text", 2: "empty or null response"}


@dataclass
class SkipCounts:
    """Rows read and rows skipped by reason: reported once per run, e.g. "skipped 12 of 2,000 rows:
    empty response"."""

    rows: int = 0
    skipped: dict[str, int] | None = None

    def add(self, codes: np.ndarray) -> None:
        self.rows += len(codes)
        found = np.bincount(np.asarray(codes, np.int64), minlength=len(SKIP_REASONS) + 1)
        self.skipped = dict(self.skipped or {})
        for code, reason in SKIP_REASONS.items():
            if found[code]:
                self.skipped[reason] = self.skipped.get(reason, 0) + int(found[code])

    def note(self) -> str | None:
        """One line saying how many rows were skipped and why, or None when none was."""
        if not self.skipped:
            return None
        reasons = ", ".join(self.skipped)
        return f"skipped {sum(self.skipped.values()):,} of {self.rows:,} rows: {reasons}"


def pack_examples(examples: datasets.Dataset, tokenizer: Any, config: DataConfig) -> datasets.Dataset:
    """Blocks of ``config.seq_len`` tokens with ``input_ids``, ``labels`` and ``position_ids`` (int32 lists).

    Texts are tokenized without special tokens (no bos) and each document gets ``tokenizer.eos_token_id``
    appended. For supervised fine-tuning the prompt is first formatted (``prompt_template`` or the
    tokenizer's chat template, see `format_examples`), then the prompt text and the response text are
    tokenized apart, so the boundary between masked and learned tokens falls exactly between two tokens.
    Examples whose texts are all empty or missing (None) are skipped. The incomplete tail block is dropped.
    """
    tokenized = tokenize_examples(examples, tokenizer, config)
    import datasets
    import pyarrow as pa

    batches = list(pack_tokenized(tokenized, config.seq_len, SkipCounts()))
    return datasets.Dataset(pa.Table.from_batches(batches).select(list(PACKED_COLUMNS)))


def tokenize_examples(
    examples: datasets.Dataset,
    tokenizer: Any,
    config: DataConfig,
    *,
    num_proc: int | None = None,
    cache_file_name: str | None = None,
) -> datasets.Dataset:
    """One row per example: its token ids ``ids`` (prompt + response + eos, int32), ``n_prompt`` (masked
    prompt tokens) and ``skip`` (0, or the `SKIP_REASONS` code of a row with nothing to learn, whose ids are
    empty). ``num_proc`` processes tokenize in parallel (`datasets.Dataset.map`)."""
    import datasets

    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise DataError("the tokenizer has no eos token; packing needs one to separate documents")
    require_columns(examples, config)
    _check_chat_template(tokenizer, config)
    features = datasets.Features(
        {
            "ids": datasets.Sequence(datasets.Value("int32")),
            "n_prompt": datasets.Value("int32"),
            "skip": datasets.Value("int8"),
        }
    )
    return examples.map(
        tokenize_batch,
        batched=True,
        remove_columns=examples.column_names,
        fn_kwargs={"tokenizer": tokenizer, "config": config, "eos": int(eos)},
        features=features,
        num_proc=num_proc if num_proc and num_proc > 1 else None,
        cache_file_name=cache_file_name,
        desc="Tokenizing",
    )


def pack_tokenized(
    tokenized: datasets.Dataset, seq_len: int, counts: SkipCounts, *, chunk_rows: int = CHUNK_ROWS
) -> Iterator[pa.RecordBatch]:
    """The blocks of `tokenize_examples`' rows, a chunk of rows at a time (memory: one chunk), counting the
    skipped rows into ``counts``. Raises a `DataError` at the end if they fill no block."""
    packer = Packer(seq_len)
    for chunk in tokenized.with_format("arrow").iter(batch_size=chunk_rows):
        codes = chunk.column("skip").to_numpy(zero_copy_only=False)
        counts.add(codes)
        kept = (
            chunk.filter(chunk.column("skip").to_numpy(zero_copy_only=False) == 0) if codes.any() else chunk
        )
        blocks = packer.add(kept.column("ids"), kept.column("n_prompt").to_numpy(zero_copy_only=False))
        if blocks is not None:
            yield blocks
    packer.check()


def format_examples(
    examples: datasets.Dataset, config: DataConfig, tokenizer: Any = None
) -> datasets.Dataset:
    """The texts `pack_examples` tokenizes: columns ``prompt`` (masked) and ``response`` (learned, before
    the eos) for supervised fine-tuning, ``text`` otherwise. Skipped (empty) examples are left out.

    Useful to look at what a template does, or to save the formatted data. ``tokenizer`` is needed only with
    ``chat_template``.
    """
    require_columns(examples, config)
    _check_chat_template(tokenizer, config)

    def texts(batch: dict[str, list]) -> dict[str, list]:
        prompts, responses = _texts(batch, config, tokenizer)
        if not config.is_sft:
            return {"text": [r for p, r in zip(prompts, responses, strict=True) if p is not None]}
        kept = [(p, r) for p, r in zip(prompts, responses, strict=True) if p is not None]
        return {"prompt": [p for p, _ in kept], "response": [r for _, r in kept]}

    return examples.map(texts, batched=True, remove_columns=examples.column_names, desc="Formatting")


def _check_chat_template(tokenizer: Any, config: DataConfig) -> None:
    if config.chat_template and getattr(tokenizer, "chat_template", None) is None:
        raise DataError(
            f"chat_template is set but the tokenizer {_tokenizer_name(tokenizer)} has no chat template; "
            'use prompt_template instead (e.g. "### Instruction:\\n{prompt}\\n\\n### Response:\\n") or a '
            "tokenizer that has one"
        )


def _tokenizer_name(tokenizer: Any) -> str:
    return repr(getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__)


def _texts(batch: dict[str, list], config: DataConfig, tokenizer: Any) -> tuple[list[str | None], list[str]]:
    """Each example's prompt text (None: skip the example) and response text, templates applied.

    Plain text has an empty prompt. An example is skipped when its text, or in supervised fine-tuning its
    response, is empty or missing (None): it has nothing to learn. Templates apply to the kept ones only.
    """
    if config.prompt_column is None or config.response_column is None:
        texts = [text or "" for text in batch[config.text_column]]
        return [("" if text else None) for text in texts], texts
    raw_prompts = [text or "" for text in batch[config.prompt_column]]
    responses = [text or "" for text in batch[config.response_column]]
    prompts: list[str | None] = []
    for i, (prompt, response) in enumerate(zip(raw_prompts, responses, strict=True)):
        if not response:
            prompts.append(None)
        elif config.prompt_template is not None:
            values = {column: _text(batch[column][i]) for column in config.template_columns}
            prompts.append(config.prompt_template.format_map({**values, PROMPT_FIELD: prompt}))
        elif config.chat_template:
            head, responses[i] = _chat(tokenizer, prompt, response)
            prompts.append(head)
        else:
            prompts.append(prompt)
    return prompts, responses


def _text(value: Any) -> str:
    return "" if value is None else str(value)


def _chat(tokenizer: Any, prompt: str, response: str) -> tuple[str, str]:
    """The chat template's rendering of one exchange, cut where the assistant's content starts."""
    user = {"role": "user", "content": prompt}
    head = tokenizer.apply_chat_template([user], tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(
        [user, {"role": "assistant", "content": response}], tokenize=False, add_generation_prompt=False
    )
    if not full.startswith(head):
        raise DataError(
            f"the chat template of tokenizer {_tokenizer_name(tokenizer)} does not render a conversation as "
            "its prompt (the user message with add_generation_prompt=True) followed by the assistant's turn, "
            f"so the prompt cannot be masked exactly: prompt rendering {head[-80:]!r}, conversation "
            f"rendering {full[: len(head) + 40]!r}; use prompt_template instead"
        )
    return head, full[len(head) :]


def _encode(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, no special tokens. A fast tokenizer's Rust backend is called directly (the
    ids `tokenizer(texts)` gives, without the per-text Python conversion or the offsets it would compute:
    about twice the speed), unless the backend itself truncates or pads."""
    if not texts:
        return []
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and backend.truncation is None and backend.padding is None:
        encode = getattr(backend, "encode_batch_fast", backend.encode_batch)  # tokenizers >= 0.21: no offsets
        return [encoding.ids for encoding in encode(texts, add_special_tokens=False)]
    return tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]


def tokenize_batch(batch: dict[str, list], tokenizer: Any, config: DataConfig, eos: int) -> dict[str, list]:
    """Each example's token ids (prompt + response + eos), how many are prompt tokens, and its skip code."""

    prompts, responses = _texts(batch, config, tokenizer)
    kept = [i for i, prompt in enumerate(prompts) if prompt is not None]
    # Tokenized apart so the prompt/response boundary falls exactly between two tokens (in one call).
    if config.is_sft:
        ids = _encode(tokenizer, [prompts[i] or "" for i in kept] + [responses[i] for i in kept])
        prompt_ids, response_ids = ids[: len(kept)], ids[len(kept) :]
    else:
        prompt_ids, response_ids = [[] for _ in kept], _encode(tokenizer, [responses[i] for i in kept])
    code = 2 if config.is_sft else 1
    out: dict[str, list] = {
        "ids": [[] for _ in prompts],
        "n_prompt": [0] * len(prompts),
        "skip": [code] * len(prompts),
    }
    for i, prompt, response in zip(kept, prompt_ids, response_ids, strict=True):
        if prompt or response:  # a text of only whitespace a tokenizer drops is skipped too
            out["ids"][i] = [*prompt, *response, eos]
            out["n_prompt"][i] = len(prompt)
            out["skip"][i] = 0
    return out
