"""Load raw examples through `datasets.load_dataset`, whatever the source, and check their columns.

Every source (the embedded corpus and local files included) goes through `load_dataset`, so the code path a
quick offline run takes is the one a real fine-tuning run takes: same Arrow tables, same caching. What this
module adds is the choice of builder for a bare local file, and turning the many ways `datasets` fails
(unknown name, missing file, absent column, an unreachable hub that it would otherwise retry for ~25 s) into a
`DataError` that says what to do instead.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pp_offload.data.config import DataConfig, require_columns
from pp_offload.data.embedded import embedded_assets, embedded_dir
from pp_offload.data.errors import DataError
from pp_offload.hub import endpoint as _endpoint
from pp_offload.hub import hub_reachable as _hub_reachable

if TYPE_CHECKING:
    import datasets

__all__ = ["BUILDERS", "SUFFIX_BUILDERS", "load_examples", "read_error", "require_columns", "source_files"]

#: `datasets` packaged builders a config may name directly (with ``data_files``).
BUILDERS = ("text", "json", "parquet", "csv")
#: Builder chosen for a local file by its extension (after a compression extension, if any).
SUFFIX_BUILDERS = {
    ".txt": "text",
    ".text": "text",
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
    ".csv": "csv",
}
_COMPRESSION_SUFFIXES = (".gz", ".bz2", ".xz", ".zst")
_HINT = (
    "pass a local file (.txt/.json/.jsonl/.parquet/.csv), a directory of such files, a builder name "
    "('text', 'json', 'parquet', 'csv') with data_files, or path='embedded'"
)


def load_examples(config: DataConfig, *, cache_dir: str | os.PathLike | None = None) -> datasets.Dataset:
    """The raw examples of ``config`` (its ``split``, at most ``max_examples`` of them), columns checked.

    ``cache_dir`` is the root for everything this writes: the embedded assets go to ``<cache_dir>/embedded``
    and the `datasets` cache to ``<cache_dir>/datasets``. Without it the embedded assets go to the default
    (``$PP_OFFLOAD_CACHE`` or ``~/.cache/pp_offload``) and `datasets` uses its own default cache.
    """
    datasets_cache = str(Path(cache_dir) / "datasets") if cache_dir is not None else None
    path = config.path
    local = Path(path).expanduser()
    if path == "embedded":
        if config.data_files is not None:
            raise DataError("data_files is not used with path='embedded'; use path='json' (or 'text', ...)")
        assets = embedded_assets(embedded_dir(cache_dir))
        dataset = _load_local("json", config, datasets_cache, data_files=assets.splits)
    elif path in BUILDERS:
        if config.data_files is None:
            raise DataError(f"the {path!r} builder needs data_files (a file, a glob or a list of files)")
        dataset = _load_local(path, config, datasets_cache, data_files=config.data_files)
    elif local.is_file():
        dataset = _load_local(_builder_for(local), config, datasets_cache, data_files=str(local))
    elif local.is_dir():
        dataset = _load_local(str(local), config, datasets_cache, data_files=config.data_files)
    elif _looks_local(path):
        raise DataError(f"no such file or directory: {path!r}; {_HINT}")
    else:
        dataset = _load_from_hub(config, datasets_cache)
    if config.streaming:
        _require_streamed_columns(dataset, config)
        return dataset.take(config.max_examples) if config.max_examples is not None else dataset
    require_columns(dataset, config)
    if config.max_examples is not None and config.max_examples < len(dataset):
        dataset = dataset.select(range(config.max_examples))
    return dataset


def _require_streamed_columns(dataset: datasets.IterableDataset, config: DataConfig) -> None:
    """`require_columns` for a stream, whose columns a builder may only know after the first row."""
    if dataset.column_names is None:
        try:
            first = next(iter(dataset.take(1)), None)
        except Exception as error:  # the first read parses the first chunk: a bad line there fails here
            raise read_error(config, error) from error
        if first is None:
            raise DataError(f"the stream of {config.path!r} (split {config.split!r}) is empty")

        class _Row:
            column_names = list(first)

        require_columns(_Row(), config)
    else:
        require_columns(dataset, config)


def source_files(config: DataConfig, *, cache_dir: str | os.PathLike | None = None) -> list[Path] | None:
    """The local files `load_examples` would read for ``config`` (a directory: all its files), or None for a
    hub dataset. Their paths, sizes and modification times identify the data without reading it."""
    path = config.path
    local = Path(path).expanduser()
    if path == "embedded":
        return [Path(f) for f in embedded_assets(embedded_dir(cache_dir)).splits.values()]
    if path in BUILDERS:
        return _files(config.data_files)
    if local.is_file():
        return [local]
    if local.is_dir():
        return _files(str(local))  # every file, whichever data_files picks: a superset identifies it too
    return None


def read_error(config: DataConfig, error: Exception) -> DataError:
    """The `DataError` for a failure while reading a stream (``data.streaming`` reads lazily, so a bad line
    shows up mid-run): the error, and for JSON files the first malformed line's file and number."""
    files = source_files(config) or []
    json_files = [f for f in files if {".json", ".jsonl"} & {s.lower() for s in f.suffixes}]
    where = _malformed_line("json", json_files) if json_files else None
    return DataError(
        f"could not read {config.path!r} (split {config.split!r}): {type(error).__name__}: {error}"
        + (f"; {where}" if where else "")
    )


def _builder_for(file: Path) -> str:
    suffixes = [s.lower() for s in file.suffixes]
    if suffixes and suffixes[-1] in _COMPRESSION_SUFFIXES:
        suffixes.pop()
    if not suffixes or suffixes[-1] not in SUFFIX_BUILDERS:
        raise DataError(
            f"cannot tell the format of {str(file)!r} from its extension; supported: "
            f"{', '.join(SUFFIX_BUILDERS)} (optionally compressed), or name the builder with path='json' "
            "(etc.) and data_files"
        )
    return SUFFIX_BUILDERS[suffixes[-1]]


def _looks_local(path: str) -> bool:
    """A path the user clearly meant as a file, so a missing one is a typo, not a hub name to look up."""
    suffixes = [s.lower() for s in Path(path).suffixes]
    return path.startswith(("/", "./", "../", "~", ".\\")) or any(
        s in SUFFIX_BUILDERS or s in _COMPRESSION_SUFFIXES for s in suffixes
    )


def _load_local(
    builder: str, config: DataConfig, cache_dir: str | None, *, data_files: Any
) -> datasets.Dataset:
    import datasets

    try:
        return datasets.load_dataset(
            builder,
            config.name,
            data_files=data_files,
            split=config.split,
            cache_dir=cache_dir,
            streaming=config.streaming,
        )
    except Exception as error:  # datasets raises many types (FileNotFoundError, ValueError, ArrowInvalid...)
        where = _malformed_line(builder, data_files) or _root_cause(error)
        raise DataError(
            f"could not load {config.path!r} (split {config.split!r}): {type(error).__name__}: {error}"
            + (f"; {where}" if where else "")
        ) from error


def _root_cause(error: BaseException) -> str | None:
    """The innermost cause's type and first line (datasets wraps a parser's error, which says where)."""
    inner = error
    while inner.__cause__ is not None or inner.__context__ is not None:
        inner = inner.__cause__ or inner.__context__  # type: ignore[assignment]
    if inner is error:
        return None
    text = str(inner).strip().splitlines()
    return f"cause: {type(inner).__name__}: {text[0] if text else ''}"


def _files(data_files: Any) -> list[Path]:
    """The local files a ``data_files`` value names (a path, a glob, a list, or a mapping of splits)."""
    if isinstance(data_files, dict):
        return [f for value in data_files.values() for f in _files(value)]
    if isinstance(data_files, (list, tuple)):
        return [f for value in data_files for f in _files(value)]
    if not isinstance(data_files, (str, os.PathLike)):
        return []
    path = Path(data_files).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        return sorted(f for f in path.rglob("*") if f.is_file())
    return sorted(f for f in Path(path.anchor or ".").glob(str(path.relative_to(path.anchor))) if f.is_file())


def _malformed_line(builder: str, data_files: Any) -> str | None:
    """``<file>:<line>: <what>`` for the first line of a JSON Lines file that is not JSON, else None.

    Why: datasets reports a bad line as an Arrow parse error of "row N" of an unnamed file, or only as
    "An error occurred while generating the dataset"; reading the files once more, only after a failure,
    names the file and the line to fix."""
    import gzip
    import json

    if builder != "json":
        return None
    for file in _files(data_files):
        suffixes = [s.lower() for s in file.suffixes]
        if not (set(suffixes) & {".json", ".jsonl"}) or (set(suffixes) & {".bz2", ".xz", ".zst"}):
            continue
        opener: Any = gzip.open if ".gz" in suffixes else open
        try:
            with opener(file, "rt", encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as error:
            return f"{file}: {type(error).__name__}: {error}"
        try:
            json.loads(text)
            continue  # one JSON document: fine
        except ValueError:
            pass
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                json.loads(line)
            except ValueError as error:
                return f"{file}:{number}: malformed JSON line ({error})"
    return None


def _load_from_hub(config: DataConfig, cache_dir: str | None) -> datasets.Dataset:
    import datasets

    offline = bool(datasets.config.HF_HUB_OFFLINE)
    unreachable = (
        f"dataset {config.path!r} not found locally and the hub is unreachable"
        f" ({'offline mode: HF_HUB_OFFLINE or HF_DATASETS_OFFLINE is set' if offline else _endpoint()}); "
        f"{_HINT}"
    )
    if not offline and not _hub_reachable():
        # Fail now instead of after datasets' ~25 s of retries.
        raise DataError(f"{unreachable} (to use a copy in your Hugging Face cache, set HF_HUB_OFFLINE=1)")
    try:
        return datasets.load_dataset(
            config.path,
            config.name,
            data_files=config.data_files,
            split=config.split,
            cache_dir=cache_dir,
            streaming=config.streaming,
        )
    except ConnectionError as error:  # includes huggingface_hub's OfflineModeIsEnabled
        raise DataError(unreachable) from error
    except datasets.exceptions.DatasetNotFoundError as error:
        raise DataError(f"dataset {config.path!r} not found locally nor on the hub; {_HINT}") from error
    except Exception as error:
        raise DataError(
            f"could not load dataset {config.path!r} from the hub: {type(error).__name__}: {error}"
        ) from error
