"""Byte-level BPE tokenizers trained on the training data itself: the embedded corpus's, and the one
``model.tokenizer: train`` trains on your own data for a model built from its config.

Why train one: a model built from a config (``model.config``) has no tokenizer of its own, and a new user
with their own data and no hub access has none to borrow. A GPT-2 style byte-level BPE encodes any text
losslessly and trains in seconds on fine-tuning sized data with the `tokenizers` library.

Why the result is a directory keyed by the texts: every rank of a job, and every resumed run, must use the
same token ids. `trained_tokenizer` writes ``<dir>/tokenizer`` once, stamped with a hash of the texts it
was trained on; the next call with the same texts (another rank, a rerun) loads it instead of training,
and a resumed run keeps it even if the data changed (its checkpoints' embeddings belong to those ids).
Ranks that train at the same time publish by an atomic rename (`pp_offload.fsutil.publish_once`): the
first wins and the others load its files.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pp_offload.data.config import DataConfig
from pp_offload.data.errors import DataError
from pp_offload.fsutil import publish_once

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedTokenizerFast

__all__ = ["EOS_TOKEN", "train_tokenizer", "trained_tokenizer", "training_texts"]

#: The one special token: end of document, and also bos/unk/pad (as GPT-2 does), so nothing else is reserved.
EOS_TOKEN = "<|endoftext|>"
#: Bump when the tokenizer recipe changes: a build stamped with another version is retrained, not reused.
FORMAT_VERSION = 1
_STAMP_FILE = "trained_on.json"


def train_tokenizer(texts: Iterable[str], *, vocab_size: int) -> PreTrainedTokenizerFast:
    """A GPT-2 style byte-level BPE tokenizer trained on ``texts``: any string encodes and decodes losslessly.

    ``<|endoftext|>`` is eos, bos, unk and pad (byte-level BPE never needs unk; pad = eos lets padding
    collators work, and packing never pads). The vocabulary holds at most ``vocab_size`` tokens (fewer when
    the texts offer fewer merges seen at least twice).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 257:
        raise DataError(f"vocab_size must be >= 257 (256 byte tokens + {EOS_TOKEN}), got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
    )


def training_texts(examples: datasets.Dataset, config: DataConfig) -> Iterator[str]:
    """The texts packing will tokenize (`pp_offload.data.format_examples`: prompts with their template
    applied, and responses; or the text column), in order, empty ones left out."""
    from pp_offload.data.packing import format_examples

    if config.chat_template:
        raise DataError(
            "chat_template formats with the tokenizer's own chat template, and a trained tokenizer has none: "
            "use prompt_template instead"
        )
    formatted = format_examples(examples, config)
    for batch in formatted.iter(batch_size=1000):
        for column in formatted.column_names:
            yield from (text for text in batch[column] if text)


def trained_tokenizer(
    examples: datasets.Dataset | Callable[[], datasets.Dataset],
    config: DataConfig,
    out_dir: str | os.PathLike[str],
    *,
    vocab_size: int,
    keep_existing: bool = False,
    data_key: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> PreTrainedTokenizerFast:
    """The byte-level BPE tokenizer of ``examples`` (as ``config`` formats them), saved in
    ``<out_dir>/tokenizer``: trained there unless that directory already holds one trained on the same
    texts with the same ``vocab_size`` (or any complete one, with ``keep_existing``: a resumed run).

    ``data_key`` (a hash of the data's files and of ``config``'s columns and template:
    `pp_offload.data.prepared.data_identity`) identifies the texts without reading them, and with
    ``cache_dir`` the build is shared: kept in ``<cache_dir>/tokenizer-<hash>`` and copied into each output
    directory, so a new run on the same data trains nothing. ``examples`` may be a function that loads them:
    it is called only when a tokenizer must be trained (or, without ``data_key``, its texts hashed).

    Safe to call from several processes at once: they train the same tokenizer and the first to publish
    wins."""
    from transformers import AutoTokenizer

    final = Path(out_dir) / "tokenizer"
    loaded: list[datasets.Dataset] = []

    def load() -> datasets.Dataset:
        if not loaded:
            loaded.append(examples() if callable(examples) else examples)
        return loaded[0]

    if not (keep_existing and _stamp(final) is not None):
        if data_key is not None:
            identity = {"format": FORMAT_VERSION, "vocab_size": vocab_size, "data_key": data_key}
        else:
            identity = {
                "format": FORMAT_VERSION,
                "vocab_size": vocab_size,
                "texts_sha256": _texts_sha(load(), config),
            }
        if _stamp(final) != identity:
            if data_key is not None and cache_dir is not None:
                name = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
                shared = Path(cache_dir).expanduser() / f"tokenizer-{name}"
                if _stamp(shared) != identity:
                    _build(load(), config, shared, identity)
                _copy(shared, final, identity)
            else:
                _build(load(), config, final, identity)
    return AutoTokenizer.from_pretrained(str(final))


def _texts_sha(examples: datasets.Dataset, config: DataConfig) -> str:
    digest = hashlib.sha256()
    count = 0
    for text in training_texts(examples, config):
        digest.update(text.encode("utf-8", "surrogatepass"))
        digest.update(b"\0")
        count += 1
    if count == 0:
        raise DataError(f"no text to train a tokenizer on in {config.path!r} (split {config.split!r})")
    return digest.hexdigest()


def _copy(shared: Path, final: Path, identity: dict) -> None:
    """Publish a copy of the shared build ``shared`` as ``final`` (atomically, like a build)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        shutil.copytree(shared, tmp, dirs_exist_ok=True)
        tmp.chmod(0o755)
        publish_once(tmp, final, lambda path: _stamp(path) == identity)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _stamp(final: Path) -> dict[str, Any] | None:
    """The identity a complete build in ``final`` was trained with (its stamp is written last), or None."""
    try:
        stamp = json.loads((final / _STAMP_FILE).read_text())
    except (OSError, ValueError):
        return None
    keys = ("format", "vocab_size", "data_key" if "data_key" in stamp else "texts_sha256")
    return {k: stamp.get(k) for k in keys}


def _build(examples: datasets.Dataset, config: DataConfig, final: Path, identity: dict) -> None:
    import tokenizers

    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        tmp.chmod(0o755)
        count = 0

        def texts() -> Iterator[str]:
            nonlocal count
            for text in training_texts(examples, config):
                count += 1
                yield text

        tokenizer = train_tokenizer(texts(), vocab_size=identity["vocab_size"])
        if count == 0:
            raise DataError(f"no text to train a tokenizer on in {config.path!r} (split {config.split!r})")
        tokenizer.save_pretrained(str(tmp))
        stamp = {**identity, "texts": count, "data": config.path, "tokenizers": tokenizers.__version__}
        (tmp / _STAMP_FILE).write_text(json.dumps(stamp, indent=2, sort_keys=True) + "\n")
        publish_once(tmp, final, lambda path: _stamp(path) == identity)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
