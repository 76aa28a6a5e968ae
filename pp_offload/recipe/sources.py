"""What ``model.path`` and ``model.tokenizer`` name, checked before anything loads, and the tokenizer itself.

Why separate: these checks run in the launcher too (``pp-offload train``, ``--check``), in a second and
without torch.distributed, so a typo stops the job before any rank starts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pp_offload.recipe.config import ConfigError, RecipeConfig

__all__ = ["TRAIN_TOKENIZER", "check_model_sources", "load_tokenizer", "missing_from_cache"]

#: Files of which at least one is in a tokenizer's directory (fast, slow and sentencepiece tokenizers).
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
)
#: Weight files of a transformers model directory (safetensors, sharded or not, or the older .bin).
_WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "*.bin.index.json")
#: ``model.tokenizer``'s value that trains a byte-level BPE on the training data.
TRAIN_TOKENIZER = "train"


def check_model_sources(config: RecipeConfig) -> None:
    """What ``model.path`` and ``model.tokenizer`` name must be there, checked in a second before anything
    loads: a local directory must hold a config, weights and (unless ``model.tokenizer`` is set) a
    tokenizer, each missing one named with the key that provides it; a hub id fails fast when the hub
    cannot be reached (offline mode uses the local cache) instead of after transformers' half minute of
    retries."""
    from pp_offload.hub import endpoint, hub_reachable, offline_mode

    spec = config.model
    if spec.tokenizer == TRAIN_TOKENIZER and spec.path is not None:
        raise ConfigError(
            f"model.tokenizer=train trains a new tokenizer, whose token ids the pretrained model.path="
            f"{spec.path!r} has never seen: use its own tokenizer (leave model.tokenizer unset), or build a "
            "new model from model.config"
        )
    if spec.path is not None:
        _check_model_dir(spec.path, tokenizer_given=spec.tokenizer is not None)
    if spec.tokenizer not in (None, TRAIN_TOKENIZER):
        _check_tokenizer_dir(spec.tokenizer)
    remote = [
        (key, value)
        for key, value in (("model.path", spec.path), ("model.tokenizer", spec.tokenizer))
        if value is not None and value != TRAIN_TOKENIZER and not Path(value).exists()
    ]
    if remote and not offline_mode() and not hub_reachable():
        key, value = remote[0]
        raise ConfigError(
            f"{key}={value!r} is not a local path and the hub ({endpoint()}) is unreachable: download it "
            "first and give its directory, or set HF_HUB_OFFLINE=1 to use a copy in your Hugging Face cache"
        )


def _looks_local(value: str) -> bool:
    """A path the user clearly meant as a directory, so a missing one is a typo, not a hub id to look up."""
    return value.startswith(("/", "./", "../", "~"))


def _check_model_dir(path: str, *, tokenizer_given: bool) -> None:
    local = Path(path).expanduser()
    if not local.exists():
        if _looks_local(path):
            raise ConfigError(f"model.path={path!r}: no such directory")
        return  # a hub id
    if not local.is_dir():
        raise ConfigError(
            f"model.path={path!r} is a file; give the model's directory (config.json, weights, tokenizer)"
        )
    if not (local / "config.json").is_file():
        raise ConfigError(
            f"model.path={path!r} holds no config.json: give a transformers model directory (as written by "
            "save_pretrained), or build a new model from its config with model.config: {model_type: ...}"
        )
    if not any(next(local.glob(pattern), None) for pattern in _WEIGHT_PATTERNS):
        raise ConfigError(
            f"model.path={path!r} holds a config.json but no weights (model.safetensors): to train a new "
            "model from that config, give its entries as model.config (e.g. model.config: {model_type: gpt2, "
            "n_layer: 4}) instead of model.path, with model.tokenizer (a tokenizer directory, or train)"
        )
    if not tokenizer_given and not _has_tokenizer(local):
        raise ConfigError(
            f"model.path={path!r} holds no tokenizer (none of {', '.join(_TOKENIZER_FILES)}): set "
            "model.tokenizer to a tokenizer's directory or hub id"
        )


def _has_tokenizer(directory: Path) -> bool:
    return any((directory / name).is_file() for name in _TOKENIZER_FILES)


def _check_tokenizer_dir(value: str) -> None:
    local = Path(value).expanduser()
    if not local.exists():
        if _looks_local(value):
            raise ConfigError(f"model.tokenizer={value!r}: no such directory")
        return  # a hub id
    if not local.is_dir() or not _has_tokenizer(local):
        raise ConfigError(
            f"model.tokenizer={value!r} is not a tokenizer directory (none of "
            f"{', '.join(_TOKENIZER_FILES)}): give the directory a tokenizer's save_pretrained wrote, a hub "
            "id, or train (a byte-level BPE trained on data.path)"
        )


def load_tokenizer(
    config: RecipeConfig, embedded_tokenizer: Path | None, examples: Any = None, *, cache: Path | None = None
) -> Any:
    """The tokenizer: ``model.tokenizer``, else ``model.path``, else the embedded one. With
    ``model.tokenizer: train``, the byte-level BPE of the training ``examples`` (a dataset, or a function
    loading it: called only if a tokenizer must be trained), kept in ``<output.dir>/tokenizer`` and shared
    through the data cache (``cache``: the run's data cache root) by every run on the same data
    (`pp_offload.data.tokenizer.trained_tokenizer`)."""
    from transformers import AutoTokenizer

    if config.model.tokenizer == TRAIN_TOKENIZER:
        from pp_offload.data import DataError
        from pp_offload.data.prepared import data_cache_root, data_identity, data_key
        from pp_offload.data.tokenizer import trained_tokenizer

        if examples is None:
            raise ValueError("model.tokenizer=train needs the training examples")
        if config.data.streaming:
            raise ConfigError(
                "model.tokenizer=train reads all the data to train a tokenizer, data.streaming never does: "
                "train one once (pp_offload.data.tokenizer.train_tokenizer on a sample, then "
                "save_pretrained) and set model.tokenizer to its directory, or prepare the data "
                "(data.streaming: false)"
            )
        try:
            loader = examples if callable(examples) else (lambda: examples)
            key = data_key(data_identity(config.data, cache_dir=cache, examples=loader))
            return trained_tokenizer(
                examples,
                config.data,
                config.output.dir,
                vocab_size=config.model.tokenizer_vocab_size,
                keep_existing=config.output.resume,
                data_key=key,
                cache_dir=data_cache_root(cache),
            )
        except DataError as error:
            raise ConfigError(f"model.tokenizer=train: {error}") from error
    source = config.model.tokenizer or config.model.path
    if source is None:
        if embedded_tokenizer is None:
            raise ConfigError(
                "no tokenizer: set model.tokenizer to a tokenizer's directory or hub id, or to train (a "
                "byte-level BPE trained on data.path, for a model built from model.config)"
            )
        source = str(embedded_tokenizer)
    key = "model.tokenizer" if config.model.tokenizer else "model.path"
    with missing_from_cache(key, source):
        return AutoTokenizer.from_pretrained(source)


@contextlib.contextmanager
def missing_from_cache(key: str, value: str) -> Iterator[None]:
    """Offline, transformers reports a hub id missing from the cache as a failed connection, with a
    traceback on every rank: say which key names it and what to do, as a configuration error."""
    from pp_offload.hub import offline_mode

    try:
        yield
    except OSError as error:
        if not offline_mode() or Path(value).exists():
            raise
        raise ConfigError(
            f"{key}={value!r} is not a local path and not in your Hugging Face cache, and offline mode "
            f"(HF_HUB_OFFLINE) forbids downloading it: download it first (`hf download {value}` where the "
            f"hub is reachable) and give its directory, or unset HF_HUB_OFFLINE (transformers: "
            f"{str(error).splitlines()[0] if str(error) else type(error).__name__})"
        ) from error
