"""``pp-offload train``: check the recipe's config in one process, then start the ranks with torchrun.

Why: under torchrun every rank checks the config, rank 0 prints the error, and torchrun then adds its own
40-line failure report (a ``ChildFailedError`` traceback, the exit code of each rank) under it, because a
rank exited non-zero. Everything that does not need the ranks (every key's type and range, the process
count against ``pipeline.pp x pipeline.dp``, the schedule, layers against stages, the batch split, the
model and tokenizer directories, the data's columns, a tokenizer to train) is checked here first, in the
parent: a bad config ends in one line and exit code 2, and torchrun is never started. What it trains or
downloads here (``model.tokenizer: train``, the embedded corpus, a hub dataset) lands in the caches the
ranks then reuse.

    pp-offload train --nproc-per-node 4 --config my.yaml --dp 2
    pp-offload train --nproc-per-node 4 --config my.yaml --check     # check only, start nothing

One node (torchrun ``--standalone``); on several nodes use torchrun directly (docs/hybrid.md).
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from pp_offload.recipe import cli
from pp_offload.recipe.config import ConfigError, RecipeConfig

__all__ = ["DESCRIPTION", "EPILOG", "add_arguments", "check_before_launch", "run_from_args"]

DESCRIPTION = (
    "Fine-tune with the recipe (recipes/finetune.py) on this machine: check the config once, then start "
    "--nproc-per-node ranks with torchrun. A configuration error is one line (exit code 2), before any "
    "rank starts."
)
EPILOG = "example: pp-offload train --nproc-per-node 4 --config recipes/configs/tiny_llama.yaml --dp 2"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--nproc-per-node",
        type=int,
        default=1,
        metavar="N",
        help="processes (ranks) to start here: pipeline ranks x --dp (default 1: the unsplit model)",
    )
    parser.add_argument("--check", action="store_true", help="check the config and the inputs, start nothing")
    cli.add_recipe_arguments(parser)


def check_before_launch(config: RecipeConfig, world: int, *, check_only: bool = True) -> None:
    """Every check of a run on ``world`` processes that needs no process group, as rank 0 would make it;
    unless ``check_only``, also the data's preparation (`pp_offload.data.prepared`), so no rank waits for it.

    Raises what the ranks would raise (`pp_offload.recipe.cli.CONFIGURATION_ERRORS`)."""
    from pp_offload.data import embedded_assets, embedded_dir, load_examples
    from pp_offload.recipe.model_loading import check_config_model, num_layers_of
    from pp_offload.recipe.preflight import preflight
    from pp_offload.recipe.run_data import data_cache, prepare_data
    from pp_offload.recipe.sources import check_model_sources, load_tokenizer
    from pp_offload.recipe.topology import topology
    from pp_offload.recipe.train import _check

    config = config.validated()
    _check(config)
    if world < 1:
        raise ConfigError(f"--nproc-per-node must be >= 1, got {world}")
    topo = topology(config, world=world)
    if config.train.device == "cuda":
        import torch

        count = torch.cuda.device_count()
        if count < world:
            raise ConfigError(
                f"train.device=cuda with {world} processes needs {world} GPUs (one per rank), this machine "
                f"shows {count}: fewer processes, or train.device=cpu"
            )
    check_model_sources(config)
    if topo.distributed:
        preflight(config, topo, num_layers_of(config))
    elif config.pipeline.pp not in (None, 1):
        raise ConfigError(f"pipeline.pp={config.pipeline.pp} needs that many processes: --nproc-per-node")
    import datasets

    quiet = datasets.utils.are_progress_bars_disabled()
    datasets.disable_progress_bars()  # the error, if any, is the one line on stderr
    try:
        cache = data_cache(config)  # the ranks' cache (train.run): what is prepared here is reused
        examples = load_examples(config.data, cache_dir=cache)
        embedded = None
        if config.data.path == "embedded":
            embedded = embedded_assets(embedded_dir(cache)).tokenizer_dir
        tokenizer = load_tokenizer(config, embedded, examples, cache=cache)
        check_config_model(config, tokenizer, pipelined=topo.distributed)
        if not (check_only or config.data.streaming):  # prepared once here; the ranks memory-map it
            prepare_data(config, config.data, tokenizer, cache, examples)
        if config.data.has_eval:
            from pp_offload.data import DataError

            try:
                eval_data = config.data.eval_config()
                load_examples(eval_data, cache_dir=cache)
                if not check_only:
                    prepare_data(config, eval_data, tokenizer, cache)
            except DataError as error:
                raise ConfigError(f"evaluation data (data.eval_split / data.eval_path): {error}") from error
    finally:
        if not quiet:
            datasets.enable_progress_bars()


def _check(args: argparse.Namespace) -> int:
    """0 when the config passes `check_before_launch` (and the data is prepared, unless ``--check``), else
    2 after printing the one-line error."""
    try:
        config = cli.config_from_args(args)
        check_before_launch(config, args.nproc_per_node, check_only=args.check)
    except cli.CONFIGURATION_ERRORS as error:
        cli.report_configuration_error(error, "0")
        return 2
    return 0


def _check_in_child(args: argparse.Namespace) -> int:
    """`_check` in a forked child: the checks and the data's preparation import datasets and transformers
    and build tokenizers and tables, hundreds of MB this launcher would otherwise hold while the ranks
    train. The child's exit code is `_check`'s (1 with a traceback for an unexpected error)."""
    import multiprocessing

    child = multiprocessing.get_context("fork").Process(target=lambda: sys.exit(_check(args)), daemon=True)
    child.start()
    child.join()
    code = child.exitcode if child.exitcode is not None else 1
    return 128 - code if code < 0 else code  # killed by a signal: the shell's 128 + signal number


def run_from_args(args: argparse.Namespace) -> int:
    launch = args.nproc_per_node > 1 and not args.check
    code = _check_in_child(args) if launch else _check(args)
    if code:
        return code
    if args.check:
        print(f"finetune: configuration ok for {args.nproc_per_node} process(es)")
        return 0
    argv = cli.recipe_argv(args)
    if args.nproc_per_node == 1:
        return cli.main(argv)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", str(args.nproc_per_node), "-m", "pp_offload.recipe", *argv]
    return subprocess.run(command, check=False).returncode
