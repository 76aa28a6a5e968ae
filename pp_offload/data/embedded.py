"""Offline data for the default recipe: real English text from the standard library, and a tokenizer for it.

The README's main command must run with no downloads. `pydoc_data.topics` ships with every CPython and
holds the language reference's help topics (~465k characters of English prose and code): enough text to
fine-tune on and watch the loss fall. `embedded_assets` writes it as a jsonl corpus of paragraph-sized
documents and trains a small byte-level BPE tokenizer on it (about a second).

The files are built once and reused. A build lands in a directory named by a hash of everything that decides
its content (format version, vocab size and the corpus text itself, which changes with the Python version),
is written in a private temporary directory and then renamed into place. A rename is atomic, so ranks calling
this at the same time, or a run killed halfway, never expose half-written files: the first rename wins and
the other builders throw their identical copies away.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path

from pp_offload.data.errors import DataError
from pp_offload.data.tokenizer import EOS_TOKEN, train_tokenizer
from pp_offload.fsutil import publish_once

#: Bump when the corpus splitting or the tokenizer recipe changes: old builds are then ignored, not reused.
FORMAT_VERSION = 2
#: Every HELDOUT_EVERY-th document (spread over all topics) goes to the ``validation`` split, not ``train``:
#: the main job's evaluation must score text the model never trained on.
HELDOUT_EVERY = 20
#: Paragraphs shorter than this (headings, underlines, one-line code fragments) are dropped: too short to
#: learn from, they would mostly be document boundaries.
MIN_DOC_CHARS = 64
#: Environment variable overriding the default cache root (``~/.cache/pp_offload``).
CACHE_ENV = "PP_OFFLOAD_CACHE"

_CORPUS_FILE = "corpus.jsonl"
_VALIDATION_FILE = "validation.jsonl"
_TOKENIZER_DIR = "tokenizer"
_STAMP_FILE = "stamp.json"


@dataclass(frozen=True)
class EmbeddedAssets:
    """The built files: jsonl corpora (one ``{"text", "topic"}`` object a line) and a tokenizer directory.

    ``corpus_file`` is the ``train`` split, ``validation_file`` the held-out documents (every
    ``HELDOUT_EVERY``-th), disjoint from it. The tokenizer is trained on both (it is not what is evaluated).
    """

    corpus_file: Path
    tokenizer_dir: Path
    validation_file: Path

    @property
    def splits(self) -> dict[str, str]:
        """``data_files`` for `datasets.load_dataset`: split name -> file."""
        return {"train": str(self.corpus_file), "validation": str(self.validation_file)}


def default_cache_dir() -> Path:
    """Root of pp_offload's caches: ``$PP_OFFLOAD_CACHE`` or ``~/.cache/pp_offload``."""
    root = os.environ.get(CACHE_ENV)
    return Path(root).expanduser() if root else Path.home() / ".cache" / "pp_offload"


def embedded_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where `load_examples` keeps the embedded assets for a cache root (the default root when None).

    A recipe passes the same directory to `embedded_assets` to get the matching tokenizer.
    """
    return Path(cache_dir if cache_dir is not None else default_cache_dir()).expanduser() / "embedded"


def embedded_documents() -> list[tuple[str, str]]:
    """The corpus as ``(topic, text)`` pairs: each help topic split on blank lines, tiny paragraphs dropped.

    Topics are taken in sorted order and paragraphs in text order, so the corpus is the same on every call.
    """
    from pydoc_data.topics import topics

    documents = []
    for topic in sorted(topics):
        for paragraph in re.split(r"\n[ \t]*\n", topics[topic]):
            text = textwrap.dedent(paragraph).strip()
            if len(text) >= MIN_DOC_CHARS:
                documents.append((topic, text))
    return documents


def embedded_assets(out_dir: str | os.PathLike, *, vocab_size: int = 2048) -> EmbeddedAssets:
    """Build (or reuse) the embedded corpus and its byte-level BPE tokenizer under ``out_dir``.

    Safe to call from several processes at once, and cheap when the files already exist.
    """
    if vocab_size < 257:
        raise DataError(f"vocab_size must be >= 257 (256 byte tokens + {EOS_TOKEN}), got {vocab_size}")
    documents = embedded_documents()
    identity = {
        "format": FORMAT_VERSION,
        "vocab_size": vocab_size,
        "corpus_sha256": hashlib.sha256(json.dumps(documents).encode()).hexdigest(),
    }
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]
    out = Path(out_dir).expanduser()
    final = out / f"pydoc-bpe{vocab_size}-{key}"
    if not _is_complete(final, identity):
        out.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=out))
        try:
            tmp.chmod(0o755)  # mkdtemp makes it private; the published cache is shared like any other.
            _build(tmp, documents, vocab_size, identity)
            publish_once(tmp, final, lambda path: _is_complete(path, identity))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return EmbeddedAssets(
        corpus_file=final / _CORPUS_FILE,
        tokenizer_dir=final / _TOKENIZER_DIR,
        validation_file=final / _VALIDATION_FILE,
    )


def _is_complete(final: Path, identity: dict) -> bool:
    """Whether ``final`` holds a finished build of ``identity`` (its stamp is written last of all)."""
    try:
        stamp = json.loads((final / _STAMP_FILE).read_text())
    except (OSError, ValueError):
        return False
    return (
        all(stamp.get(name) == value for name, value in identity.items())
        and (final / _CORPUS_FILE).is_file()
        and (final / _VALIDATION_FILE).is_file()
        and (final / _TOKENIZER_DIR).is_dir()
    )


def _build(tmp: Path, documents: list[tuple[str, str]], vocab_size: int, identity: dict) -> None:
    with (
        (tmp / _CORPUS_FILE).open("w", encoding="utf-8") as train,
        (tmp / _VALIDATION_FILE).open("w", encoding="utf-8") as heldout,
    ):
        for index, (topic, text) in enumerate(documents):
            f = heldout if index % HELDOUT_EVERY == HELDOUT_EVERY // 2 else train
            f.write(json.dumps({"text": text, "topic": topic}) + "\n")
    tokenizer = train_tokenizer([text for _, text in documents], vocab_size=vocab_size)
    tokenizer.save_pretrained(tmp / _TOKENIZER_DIR)
    import tokenizers

    stamp = {**identity, "documents": len(documents), "tokenizers": tokenizers.__version__}
    (tmp / _STAMP_FILE).write_text(json.dumps(stamp, indent=2, sort_keys=True) + "\n")
