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

from pp_offload.data.config import PROMPT_FIELD, DataConfig, require_columns
from pp_offload.data.errors import DataError

if TYPE_CHECKING:
    import datasets

#: Label value ignored by `torch.nn.functional.cross_entropy` (its default ``ignore_index``).
IGNORE_INDEX = -100
#: Columns of a packed dataset, each a list of ``seq_len`` ints per block.
PACKED_COLUMNS = ("input_ids", "labels", "position_ids")


def pack_examples(examples: datasets.Dataset, tokenizer: Any, config: DataConfig) -> datasets.Dataset:
    """Blocks of ``config.seq_len`` tokens with ``input_ids``, ``labels`` and ``position_ids`` (int32 lists).

    Texts are tokenized without special tokens (no bos) and each document gets ``tokenizer.eos_token_id``
    appended. For supervised fine-tuning the prompt is first formatted (``prompt_template`` or the
    tokenizer's chat template, see `format_examples`), then the prompt text and the response text are
    tokenized apart, so the boundary between masked and learned tokens falls exactly between two tokens.
    Examples whose texts are all empty or missing (None) are skipped. The incomplete tail block is dropped.
    """
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise DataError("the tokenizer has no eos token; packing needs one to separate documents")
    require_columns(examples, config)
    _check_chat_template(tokenizer, config)
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

    Plain text has an empty prompt. An example is skipped when its prompt and response (or its text) are both
    empty or missing, before any template is applied.
    """
    if config.prompt_column is None or config.response_column is None:
        texts = [text or "" for text in batch[config.text_column]]
        return [("" if text else None) for text in texts], texts
    raw_prompts = [text or "" for text in batch[config.prompt_column]]
    responses = [text or "" for text in batch[config.response_column]]
    prompts: list[str | None] = []
    for i, (prompt, response) in enumerate(zip(raw_prompts, responses, strict=True)):
        if not (prompt or response):
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


def _tokenize(batch: dict[str, list], tokenizer: Any, config: DataConfig, eos: int) -> dict[str, list]:
    """Token ids of each document (prompt + response + eos) and how many of them are prompt tokens."""

    def encode(texts: list[str]) -> list[list[int]]:
        return tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"] if texts else []

    prompts, responses = _texts(batch, config, tokenizer)
    kept = [i for i, prompt in enumerate(prompts) if prompt is not None]
    # Tokenized apart so the prompt/response boundary falls exactly between two tokens.
    prompt_ids = encode([prompts[i] or "" for i in kept]) if config.is_sft else [[] for _ in kept]
    response_ids = encode([responses[i] for i in kept])
    out: dict[str, list] = {"ids": [], "n_prompt": []}
    for prompt, response in zip(prompt_ids, response_ids, strict=True):
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
