"""Tokenize and pack once per machine into a content-addressed cache that every rank and every later run
memory-maps.

Why: every rank of every run used to tokenize and pack the whole dataset again, holding the token stream in
memory (~2 KB per 100-byte row, in each rank), and a new output directory started from nothing. Now one
process per machine (the `pp-offload train` launcher before the ranks start, or else local rank 0 of each
node) prepares the blocks with ``datasets.map(num_proc=...)`` and writes them as one Arrow file; the other
ranks wait for it, and everyone memory-maps it (`pp_offload.data.blocks.PackedBlocks`).

The cache directory is named by a hash of everything that decides its content (`identity`): the data
files' paths, sizes and modification times (a hub dataset: its `datasets` fingerprint), the split, columns,
template and ``max_examples``, the tokenizer (its serialized vocabulary and rules, eos, chat template),
``seq_len`` and `FORMAT_VERSION`. Another output directory with the same data and tokenizer finds it
ready. It lives under the Hugging Face datasets cache (``$HF_DATASETS_CACHE/pp_offload``, by default
``~/.cache/huggingface/datasets/pp_offload``), or under ``data.cache_dir``.

A build is written in a private temporary directory and renamed into place (`pp_offload.fsutil.publish_once`),
so a reader never sees half a file and a killed preparer leaves nothing behind. A preparer that fails writes
its error next to the cache entry (``<entry>.failed``): waiting ranks raise the same error instead of
waiting for their timeout.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pp_offload.data.blocks import PackedBlocks, block_schema
from pp_offload.data.config import DataConfig
from pp_offload.data.errors import DataError
from pp_offload.data.loading import source_files
from pp_offload.data.packing import SkipCounts, pack_tokenized, tokenize_examples
from pp_offload.fsutil import publish_once

if TYPE_CHECKING:
    import datasets

__all__ = [
    "FORMAT_VERSION",
    "Prepared",
    "data_cache_root",
    "data_identity",
    "data_key",
    "identity",
    "prepare",
    "tokenizer_fingerprint",
]

#: Bump when the packed format or the packing rules change: entries of another version are not reused.
FORMAT_VERSION = 1
_BLOCKS_FILE = "blocks.arrow"
_INFO_FILE = "info.json"
#: Seconds between two looks of a waiting rank at the cache entry.
_POLL_S = 0.2
#: Rows per tokenizing process below which one process is faster than starting more.
_ROWS_PER_PROCESS = 50_000


def data_cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where prepared data lives: ``cache_dir`` (``data.cache_dir``), else ``$HF_DATASETS_CACHE/pp_offload``
    (by default ``~/.cache/huggingface/datasets/pp_offload``), shared by every run on the machine."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    import datasets

    return Path(datasets.config.HF_DATASETS_CACHE) / "pp_offload"


@dataclass
class Prepared:
    """A prepared cache entry: its directory, its memory-mapped blocks and what preparation counted."""

    path: Path
    blocks: PackedBlocks
    info: dict[str, Any] = field(default_factory=dict)

    def note(self) -> str | None:
        """The one line to print about skipped rows (None: none skipped)."""
        counts = SkipCounts(rows=self.info.get("rows", 0), skipped=self.info.get("skipped") or None)
        return counts.note()


def data_identity(
    config: DataConfig,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    examples: Callable[[], datasets.Dataset] | None = None,
) -> dict[str, Any]:
    """What identifies the texts of ``config`` without reading them: the data files' paths, sizes and
    modification times (a hub dataset: its `datasets` fingerprint, for which ``examples`` loads it), and
    the split, columns, template and ``max_examples``. ``cache_dir``: `load_examples`' root."""
    files = source_files(config, cache_dir=cache_dir)
    if files is not None:
        missing = [str(f) for f in files if not f.is_file()]
        if missing or not files:
            raise DataError(f"no data files for {config.path!r}: {missing or config.data_files!r}")
        stats = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
        data = hashlib.sha256(json.dumps(stats).encode()).hexdigest()
    else:
        if examples is None:
            raise ValueError("a hub dataset's identity needs its examples")
        data = getattr(examples(), "_fingerprint", None) or ""
        if not data:
            raise DataError(f"dataset {config.path!r} has no datasets fingerprint to key its cache by")
    fields = ("path", "name", "split", "text_column", "prompt_column", "response_column", "prompt_template")
    return {
        "data": data,
        "config": {name: getattr(config, name) for name in fields}
        | {"chat_template": config.chat_template, "max_examples": config.max_examples},
    }


def data_key(identity: dict[str, Any]) -> str:
    """A short hash of an identity (`data_identity`, `identity`): names cache entries."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def identity(
    config: DataConfig,
    tokenizer: Any,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    examples: Callable[[], datasets.Dataset] | None = None,
) -> dict[str, Any]:
    """Everything that decides the prepared blocks' content (see the module docstring): `data_identity`,
    the tokenizer, ``seq_len`` and `FORMAT_VERSION`."""
    return {
        "format": FORMAT_VERSION,
        **data_identity(config, cache_dir=cache_dir, examples=examples),
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "seq_len": config.seq_len,
    }


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A hash of what decides a tokenizer's ids: its serialized model and rules (fast tokenizers), eos and
    chat template; the same in every process (ranks must agree on the cache entry's name).

    A tokenizer without a serialized form (a slow, Python one) is identified by its class, vocabulary,
    ``name_or_path`` and constructor arguments instead: deterministic, but blind to a change of its
    merges alone (prefer fast tokenizers, the transformers default)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        body = backend.to_str()
    else:
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        body = json.dumps(
            [
                sorted(vocab.items()),
                getattr(tokenizer, "name_or_path", None),
                getattr(tokenizer, "init_kwargs", {}),
            ],
            sort_keys=True,
            default=str,
        )
    digest = hashlib.sha256(body.encode())
    extra = [type(tokenizer).__name__, getattr(tokenizer, "eos_token_id", None)]
    extra.append(getattr(tokenizer, "chat_template", None))
    digest.update(json.dumps(extra, default=str).encode())
    return digest.hexdigest()


def prepare(
    config: DataConfig,
    tokenizer: Any,
    examples: Callable[[], datasets.Dataset],
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    preparer: bool = True,
    timeout_s: float = 600.0,
    num_proc: int | None = None,
    datasets_cache: str | os.PathLike[str] | None = None,
    in_child: bool = False,
) -> Prepared:
    """The packed blocks of ``config`` tokenized by ``tokenizer``, from the cache when present.

    The ``preparer`` builds a missing entry (``examples`` loads the raw examples); any other process waits
    up to ``timeout_s`` seconds for it, and raises the preparer's own error if it failed. ``num_proc``
    tokenizing processes (None: one per 50k rows, at most the CPU count). ``datasets_cache`` is the root
    `load_examples` uses (the embedded corpus lives there), for the data's identity. ``in_child``: build in
    a forked child process, so that the memory preparation touches (the raw and tokenized tables it maps,
    growing with the data) is never this process's: a rank that prepares then trains at the same resident
    memory as the others.
    """
    loaded: list[datasets.Dataset] = []

    def once() -> datasets.Dataset:  # a hub dataset is loaded for its identity: load it only once
        if not loaded:
            loaded.append(examples())
        return loaded[0]

    key = identity(config, tokenizer, cache_dir=datasets_cache, examples=once)
    root = data_cache_root(cache_dir)
    final = root / f"packed-L{config.seq_len}-{data_key(key)}"
    failed = final.with_name(final.name + ".failed")
    if not _complete(final, key):
        if preparer:
            failed.unlink(missing_ok=True)

            def build() -> None:
                try:
                    _build(root, final, key, config, tokenizer, once(), num_proc)
                except BaseException as error:
                    _write_failure(failed, error)
                    raise

            if in_child:
                _run_in_child(build, failed)
            else:
                build()
        else:
            _wait(final, key, failed, timeout_s)
    info = json.loads((final / _INFO_FILE).read_text())
    return Prepared(final, PackedBlocks.open(final / _BLOCKS_FILE), info)


def _complete(final: Path, key: dict[str, Any]) -> bool:
    """Whether ``final`` holds a finished build of ``key`` (its info file is written last)."""
    try:
        info = json.loads((final / _INFO_FILE).read_text())
    except (OSError, ValueError):
        return False
    return info.get("identity") == json.loads(json.dumps(key)) and (final / _BLOCKS_FILE).is_file()


def _build(
    root: Path,
    final: Path,
    key: dict[str, Any],
    config: DataConfig,
    tokenizer: Any,
    examples: datasets.Dataset,
    num_proc: int | None,
) -> None:
    import pyarrow as pa

    started = time.perf_counter()
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared like any other
        procs = num_proc or max(1, min(os.cpu_count() or 1, len(examples) // _ROWS_PER_PROCESS))
        tokenized = tokenize_examples(
            examples, tokenizer, config, num_proc=procs, cache_file_name=str(tmp / "tokenized.arrow")
        )
        counts = SkipCounts()
        blocks = 0
        with pa.OSFile(str(tmp / _BLOCKS_FILE), "wb") as sink:
            with pa.ipc.new_stream(sink, block_schema(config.seq_len)) as writer:
                for batch in pack_tokenized(tokenized, config.seq_len, counts):
                    writer.write_batch(batch)
                    blocks += batch.num_rows
        tokenized_files = [Path(f["filename"]) for f in tokenized.cache_files]
        del tokenized
        for file in tokenized_files:
            file.unlink(missing_ok=True)
        info = {
            "identity": key,
            "rows": counts.rows,
            "skipped": counts.skipped or {},
            "blocks": blocks,
            "seq_len": config.seq_len,
            "data": config.path,
            "num_proc": procs,
            "seconds": round(time.perf_counter() - started, 3),
        }
        (tmp / _INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
        publish_once(tmp, final, lambda path: _complete(path, key))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _run_in_child(build: Callable[[], None], failed: Path) -> None:
    """Run ``build`` in a forked child; raise a `DataError` with the failure it wrote if it failed.

    A bare `os.fork`, not `multiprocessing`: a rank may itself be a daemonic multiprocessing process
    (`pp_offload.local_ranks.run_on_ranks`), which multiprocessing forbids to have children."""
    import sys
    import traceback

    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: build, report through `failed`, and leave without running the parent's exits
        code = 0
        try:
            build()
        except DataError:
            code = 1  # the parent raises it, as one line
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        try:
            message = failed.read_text()
        except OSError:
            message = f"the process preparing the data ended with exit code {code}"
        raise DataError(message)


def _write_failure(failed: Path, error: BaseException) -> None:
    try:
        failed.parent.mkdir(parents=True, exist_ok=True)
        failed.write_text(str(error) if isinstance(error, DataError) else f"{type(error).__name__}: {error}")
    except OSError:
        pass  # the error itself is what matters; torchrun ends the waiting ranks when this one exits


def _wait(final: Path, key: dict[str, Any], failed: Path, timeout_s: float) -> None:
    """Wait for the preparer's build of ``key``; raise its error if it failed (a failure written after this
    rank started waiting, not one left by an earlier run)."""
    started = time.time()
    while not _complete(final, key):
        try:
            if failed.stat().st_mtime >= started - 1.0:
                raise DataError(f"the process preparing the data failed: {failed.read_text()}")
        except FileNotFoundError:
            pass
        if time.time() - started > timeout_s:
            raise DataError(
                f"waited {timeout_s:g} s (train.timeout_s) for local rank 0 to prepare the data into "
                f"{final}: prepare it first (pp-offload train does, before starting the ranks) or raise "
                "train.timeout_s"
            )
        time.sleep(_POLL_S)
