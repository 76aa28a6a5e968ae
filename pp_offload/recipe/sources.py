"""The run's tokenizer (``model.tokenizer``, ``model.path``'s, the embedded one, or one trained on the data),
and the one-line error for a hub id missing from an offline cache.

What ``model.path`` and ``model.tokenizer`` name is checked before anything loads, by
`pp_offload.recipe.preflight.check_model_sources`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pp_offload.recipe.config import TRAIN_TOKENIZER, ConfigError, RecipeConfig

__all__ = ["load_tokenizer", "missing_from_cache"]


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
