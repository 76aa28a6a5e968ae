"""The data of a recipe run: tokenizer, training batches and held-out batches, prepared once per machine.

Kept apart from the training loop (`pp_offload.recipe.train`) so the launcher can prepare the same cache
entry before any rank starts (`prepare_data`), and the loop only reads batches.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pp_offload.data import (
    DataConfig,
    DataError,
    PackedBatches,
    embedded_assets,
    embedded_dir,
    load_examples,
)
from pp_offload.data.prepared import Prepared, prepare
from pp_offload.data.streaming import StreamingBatches
from pp_offload.recipe.config import ConfigError, RecipeConfig
from pp_offload.recipe.sources import load_tokenizer
from pp_offload.recipe.topology import Topology

__all__ = ["RunData", "data_cache", "prepare_data", "run_data"]


def data_cache(config: RecipeConfig, cache_dir: str | os.PathLike[str] | None = None) -> Path | None:
    """The root of the run's data caches: ``cache_dir`` (`pp_offload.recipe.train.run`'s argument), else
    ``data.cache_dir``, else None: the shared defaults (the Hugging Face datasets cache for datasets and
    prepared blocks, ``~/.cache/pp_offload`` for the embedded corpus), so a new output directory reuses
    what an earlier run prepared."""
    if cache_dir is not None:
        return Path(cache_dir)
    return Path(config.data.cache_dir).expanduser() if config.data.cache_dir else None


@dataclass
class RunData:
    """What every rank trains and evaluates on."""

    tokenizer: Any
    batches: PackedBatches | StreamingBatches
    eval_batches: list[dict[str, torch.Tensor]] | None


def run_data(config: RecipeConfig, topo: Topology, cache: Path | None) -> RunData:
    """Tokenizer, training batches and the held-out batches. Local rank 0 prepares the packed blocks once per
    machine (unless the launcher or an earlier run did: `pp_offload.data.prepared`); every rank memory-maps
    them and reads only its own batches."""
    data: DataConfig = config.data
    if topo.rank != 0:  # one progress bar per job, not one per rank
        import datasets

        datasets.disable_progress_bars()
    tokenizer_dir = None
    if data.path == "embedded":
        tokenizer_dir = embedded_assets(embedded_dir(cache)).tokenizer_dir
    loaded: list[Any] = []

    def examples() -> Any:  # loaded only to train a tokenizer or prepare the data, and then once
        if not loaded:
            loaded.append(load_examples(data, cache_dir=cache))
        return loaded[0]

    tokenizer = load_tokenizer(config, tokenizer_dir, examples, cache=cache)
    batches: PackedBatches | StreamingBatches
    if data.streaming:  # packed on the fly, each rank its share (pp_offload.data.streaming)
        batches = StreamingBatches(
            lambda: load_examples(data, cache_dir=cache),
            tokenizer,
            data,
            config.train.global_batch_size,
            dp_rank=topo.dp_rank,
            dp_size=topo.dp,
            report=(lambda line: print(line, flush=True)) if topo.rank == 0 else None,
        )
    else:
        prepared = prepare_data(
            config, data, tokenizer, cache, examples, preparer=topo.local_rank == 0, in_child=True
        )
        if topo.rank == 0 and (note := prepared.note()):
            print(f"data: {note}", flush=True)
        batches = PackedBatches(
            prepared.blocks,
            config.train.global_batch_size,
            dp_rank=topo.dp_rank,
            dp_size=topo.dp,
            seed=config.train.seed,
        )
    held_out = None
    if data.has_eval:
        held_out = _eval_batches(config, topo, tokenizer, cache)
    return RunData(tokenizer, batches, held_out)


def prepare_data(
    config: RecipeConfig,
    data: DataConfig,
    tokenizer: Any,
    cache: Path | None,
    examples: Any = None,
    *,
    preparer: bool = True,
    in_child: bool = False,
) -> Prepared:
    """The packed blocks of ``data`` (the training data or `DataConfig.eval_config`), prepared here if
    ``preparer`` and not cached yet, else waited for (``train.timeout_s``). ``examples``: the raw examples
    or a function loading them (default: `load_examples`)."""
    if examples is None:
        loader = lambda: load_examples(data, cache_dir=cache)  # noqa: E731
    else:
        loader = examples if callable(examples) else (lambda: examples)
    return prepare(
        data,
        tokenizer,
        loader,
        cache_dir=cache,
        preparer=preparer,
        in_child=in_child,
        timeout_s=config.train.timeout_s,
        num_proc=data.num_proc,
        datasets_cache=cache,
    )


def _eval_batches(
    config: RecipeConfig, topo: Topology, tokenizer: Any, cache: Path | None
) -> list[dict[str, Any]]:
    """The first ``train.eval_batches`` global batches of the held-out blocks (all of them by default),
    in a fixed order, each data-parallel rank its slice: every evaluation scores the same tokens."""
    eval_data = config.data.eval_config()
    try:
        prepared = prepare_data(
            config, eval_data, tokenizer, cache, preparer=topo.local_rank == 0, in_child=True
        )
        held_out = PackedBatches(
            prepared.blocks, config.train.global_batch_size, dp_rank=topo.dp_rank, dp_size=topo.dp, seed=0
        )
    except DataError as error:
        raise ConfigError(f"evaluation data (data.eval_split / data.eval_path): {error}") from error
    count = len(held_out)
    if config.train.eval_batches is not None:
        count = min(count, config.train.eval_batches)
    return [held_out.batch(i) for i in range(count)]
