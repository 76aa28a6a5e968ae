"""``pp-offload train``: check the recipe's config in one process, then start the ranks with torchrun.

Why: under torchrun every rank checks the config, rank 0 prints the error, and torchrun then adds its own
40-line failure report (a ``ChildFailedError`` traceback, the exit code of each rank) under it, because a
rank exited non-zero. Everything that does not need the ranks (every key's type and range, the process
count against ``pipeline.pp x pipeline.dp``, the schedule, layers against stages, the batch split, the
model and tokenizer directories, the data's columns, a tokenizer to train, and every pipeline rank's
split, recompute wrappers, lowered order and offload plan, built on the meta device by
`pp_offload.recipe.dry_build`) is checked here first, in the parent: a bad config ends in one line and exit
code 2, and torchrun is never started. What it trains or downloads here (``model.tokenizer: train``, the
embedded corpus, a hub dataset) lands in the caches the ranks then reuse.

    pp-offload train --nproc-per-node 4 --config my.yaml --dp 2
    pp-offload train --nproc-per-node 4 --config my.yaml --check     # check only, start nothing

One node by default (torchrun ``--standalone``); on several nodes the same command on every node with
``--nnodes``, ``--node-rank`` and a rendezvous (``--rdzv-backend c10d --rdzv-endpoint HOST:PORT``, or
``--master-addr`` / ``--master-port``), passed on to torchrun (docs/recipe.md#several-nodes).

Signals: SIGTERM and SIGINT to this launcher are passed to torchrun, which passes them to the workers
and gives them time to write their checkpoint; SIGUSR1 (which torchrun does not forward, and which would
end torchrun itself) goes to the workers directly. The launcher then waits and exits with torchrun's code
(`pp_offload.recipe.signals`).
"""

from __future__ import annotations

import argparse
import sys

from pp_offload.recipe import cli
from pp_offload.recipe.config import ConfigError, RecipeConfig

__all__ = [
    "DESCRIPTION",
    "EPILOG",
    "add_arguments",
    "check_before_launch",
    "run_from_args",
    "torchrun_command",
]

DESCRIPTION = (
    "Fine-tune with the recipe (recipes/finetune.py) on this machine (or, with --nnodes, on each node): "
    "check the config once, then start --nproc-per-node ranks with torchrun. A configuration error is one "
    "line (exit code 2), before any rank starts. SIGTERM, SIGINT and SIGUSR1 reach the ranks, which write "
    "a checkpoint and stop."
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
    nodes = parser.add_argument_group("several nodes (passed on to torchrun; the same command on every node)")
    nodes.add_argument("--nnodes", type=int, default=1, metavar="N", help="nodes of the job (default 1)")
    nodes.add_argument("--node-rank", type=int, default=None, metavar="R", help="this node's rank (static)")
    nodes.add_argument("--rdzv-backend", default=None, metavar="B", help="rendezvous backend, e.g. c10d")
    nodes.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT", help="rendezvous endpoint")
    nodes.add_argument(
        "--rdzv-id", default=None, metavar="ID", help="rendezvous job id (c10d; default: none)"
    )
    nodes.add_argument("--master-addr", default=None, metavar="HOST", help="node 0's address (static)")
    nodes.add_argument("--master-port", type=int, default=None, metavar="PORT", help="node 0's port (static)")
    cli.add_recipe_arguments(parser)


def torchrun_command(args: argparse.Namespace, recipe_argv: list[str]) -> list[str]:
    """torchrun's command line for ``args``: ``--standalone`` on one node without a rendezvous given,
    else the node and rendezvous options as given."""
    command = [sys.executable, "-m", "pp_offload.recipe.agent"]  # torchrun, its signal stop in one line
    given = {
        "--nnodes": args.nnodes if args.nnodes != 1 else None,
        "--node-rank": args.node_rank,
        "--rdzv-backend": args.rdzv_backend,
        "--rdzv-endpoint": args.rdzv_endpoint,
        "--rdzv-id": args.rdzv_id,
        "--master-addr": args.master_addr,
        "--master-port": args.master_port,
    }
    if all(value is None for value in given.values()):
        command.append("--standalone")
    for flag, value in given.items():
        if value is not None:
            command += [flag, str(value)]
    command += ["--nproc-per-node", str(args.nproc_per_node), "-m", "pp_offload.recipe", *recipe_argv]
    return command


def _check_nodes(args: argparse.Namespace) -> None:
    """The node options that go together, checked before anything starts (one line, exit 2)."""
    if args.nnodes < 1:
        raise ConfigError(f"--nnodes must be >= 1, got {args.nnodes}")
    if args.node_rank is not None and not 0 <= args.node_rank < args.nnodes:
        raise ConfigError(f"--node-rank={args.node_rank} must be in [0, --nnodes={args.nnodes})")
    if args.nnodes > 1 and args.rdzv_endpoint is None and args.master_addr is None:
        raise ConfigError(
            f"--nnodes {args.nnodes} needs a rendezvous every node can reach: --rdzv-backend c10d "
            "--rdzv-endpoint HOST:PORT (any node's address), or --node-rank with --master-addr/--master-port"
        )
    if args.master_addr is not None and args.nnodes > 1 and args.node_rank is None:
        raise ConfigError("--master-addr (static rendezvous) needs --node-rank on every node")


def check_before_launch(
    config: RecipeConfig, world: int, *, per_node: int | None = None, check_only: bool = True
) -> str | None:
    """Every check of a run on ``world`` processes (``per_node`` of them on this node; default: all) that
    needs no process group, as rank 0 would make it; unless ``check_only``, also the data's preparation
    (`pp_offload.data.prepared`), so no rank waits for it.

    Raises what the ranks would raise (`pp_offload.recipe.cli.CONFIGURATION_ERRORS`, `CheckpointReadError`);
    returns the line the ranks will print about the output dir's checkpoints (a resume), or None."""
    from pp_offload.data import embedded_assets, embedded_dir, load_examples
    from pp_offload.recipe.model_loading import check_config_model
    from pp_offload.recipe.preflight import preflight
    from pp_offload.recipe.resume import check_checkpoints
    from pp_offload.recipe.run_data import data_cache, prepare_data
    from pp_offload.recipe.sources import load_tokenizer
    from pp_offload.recipe.topology import topology

    config = config.validated()
    if world < 1:
        raise ConfigError(f"--nproc-per-node must be >= 1, got {world}")
    topo = topology(config, world=world)
    preflight(config, topo, per_node=world if per_node is None else per_node)
    resume = check_checkpoints(config, {"pp": topo.pp, "dp": topo.dp})
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
        if topo.distributed:  # what the ranks build before step 1 (pp_offload.recipe.dry_build)
            from pp_offload.recipe.dry_build import dry_build

            print(dry_build(config, topo, tokenizer).summary(), flush=True)
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
    return resume


def _check(args: argparse.Namespace) -> int:
    """0 when the config passes `check_before_launch` (and the data is prepared, unless ``--check``), else
    the exit code after printing the one-line error. With ``--check`` it also prints the verdict, the
    warm-up warning and what a launch would do with the output dir's checkpoints."""
    from pp_offload.recipe.checkpoint import CheckpointReadError

    world = args.nproc_per_node * args.nnodes
    try:
        _check_nodes(args)
        config = cli.config_from_args(args)
        resume = check_before_launch(config, world, per_node=args.nproc_per_node, check_only=args.check)
    except cli.CONFIGURATION_ERRORS as error:
        cli.report_configuration_error(error, "0")
        return 2
    except CheckpointReadError as error:
        print(f"finetune: {' '.join(str(error).split())}", file=sys.stderr, flush=True)
        return error.exit_code
    if args.check:
        from pp_offload.recipe.lr import warmup_warning

        if warning := warmup_warning(config):
            print(warning, file=sys.stderr)
        print(f"finetune: configuration ok for {world} process(es)")
        if resume:  # what a launch would do with the output dir's checkpoints
            print(resume.replace("finetune: resumed", "finetune: would resume", 1))
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
    from pp_offload.recipe.signals import run_forwarding_signals

    world = args.nproc_per_node * args.nnodes
    launch = world > 1 and not args.check
    code = _check_in_child(args) if launch else _check(args)
    if code or args.check:
        return code
    argv = cli.recipe_argv(args)
    if world == 1:
        return cli.main(argv)
    return run_forwarding_signals(torchrun_command(args, argv))
