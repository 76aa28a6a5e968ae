"""Command line of the fine-tuning recipe (``recipes/finetune.py``, ``python -m pp_offload.recipe``).

Launch one process per pipeline rank with torchrun or accelerate::

    torchrun --nproc-per-node 2 recipes/finetune.py --config recipes/configs/tiny_llama.yaml
    torchrun --nproc-per-node 4 recipes/finetune.py --config recipes/configs/tiny_llama.yaml --dp 2
    accelerate launch --config_file recipes/accelerate_cpu.yaml recipes/finetune.py --config ...

With one process (plain ``python``) the same config trains the unsplit model: the reference a pipelined run
reproduces.

Exit codes: 0 done, or stopped by SIGTERM / SIGUSR1 / SIGINT after writing a checkpoint (a rerun
continues); 1 a rank failed, or a checkpoint could not be written; 2 a configuration error, or a checkpoint
file refused as corrupt or tampered with; 3 too many non-finite steps in a row (``train.max_bad_steps``);
4 a step stalled (``train.stall_timeout``). See docs/reliability.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from collections.abc import Sequence

from pp_offload.data import DataError
from pp_offload.models.families import UnsupportedModelError
from pp_offload.recipe.config import ConfigError, RecipeConfig, load_config
from pp_offload.recipe.stops import RunStopped

__all__ = [
    "CONFIGURATION_ERRORS",
    "add_recipe_arguments",
    "config_from_args",
    "failure_hint",
    "main",
    "parser",
    "recipe_argv",
    "report_configuration_error",
]

OUT_OF_MEMORY_HINT = (
    "out of memory. Each of these lowers a rank's peak: pipeline.offload=full (saved activations to host "
    "memory), pipeline.schedule=ScheduleVMin (about 1/3 of 1F1B's activations) or schedule=auto with "
    "pipeline.memory_limit, train.activation_checkpointing=true, a smaller data.seq_len or more "
    "pipeline.microbatches (smaller microbatches), pipeline.dp > 1 (FSDP2 shards gradients and optimizer "
    "state), train.precision=bf16. Under V placement rank 0 holds both the embedding and the LM head. "
    "`pp-offload plan` estimates every stage's memory before a run."
)
MISSING_RANK_HINT = (
    "not every rank joined within train.timeout_s. Start all WORLD_SIZE processes: torchrun "
    "--nproc-per-node (times --nnodes, the same command on every node with the same --master-addr and "
    "--master-port), or accelerate's num_processes / num_machines."
)
TIMEOUT_HINT = (
    "a collective timed out (train.timeout_s): another rank is stuck or has died; its own error, if any, is "
    "in its output. Raise train.timeout_s only if a rank legitimately needs longer between collectives."
)
PEER_EXITED_HINT = (
    "another rank exited while this one waited for it: read that rank's own error. A rank with none was "
    "killed: torchrun's summary then shows exitcode -9 (SIGKILL), often the system's out-of-memory killer."
)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="finetune",
        description="Pipeline-parallel fine-tuning of a Hugging Face causal LM with pp-offload's schedules.",
        epilog="Example: torchrun --nproc-per-node 2 recipes/finetune.py "
        "--config recipes/configs/tiny_llama.yaml --set train.steps=20 --set pipeline.schedule=ScheduleVMin",
    )
    add_recipe_arguments(p)
    return p


def add_recipe_arguments(p: argparse.ArgumentParser) -> None:
    """The recipe's options (shared by ``recipes/finetune.py`` and ``pp-offload train``)."""
    p.add_argument("--config", help="YAML recipe config (sections model, data, pipeline, train, output)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config value (YAML syntax), e.g. --set pipeline.offload=full; repeatable",
    )
    p.add_argument("--output-dir", help="shortcut for --set output.dir=...")
    p.add_argument(
        "--dp",
        type=int,
        metavar="N",
        help="data-parallel replicas of the pipeline (FSDP2 over them; pipeline ranks = processes / N); "
        "shortcut for --set pipeline.dp=N",
    )
    p.add_argument(
        "--resume", action="store_true", help="continue from the latest checkpoint in the output dir"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar (log lines only)")


def recipe_argv(args: argparse.Namespace) -> list[str]:
    """The recipe's command line for the options in ``args`` (what `add_recipe_arguments` parsed)."""
    argv = [] if args.config is None else ["--config", args.config]
    for item in args.overrides:
        argv += ["--set", item]
    if args.output_dir:
        argv += ["--output-dir", args.output_dir]
    if args.dp is not None:
        argv += ["--dp", str(args.dp)]
    argv += ["--resume"] * bool(args.resume) + ["--no-progress"] * bool(args.no_progress)
    return argv


def config_from_args(args: argparse.Namespace) -> RecipeConfig:
    """The config of ``--config`` with every ``--set`` and the shortcuts applied (raises `ConfigError`)."""
    overrides = list(args.overrides)
    if args.output_dir:
        overrides.append(f"output.dir={args.output_dir}")
    if args.resume:
        overrides.append("output.resume=true")
    if args.dp is not None:
        overrides.append(f"pipeline.dp={args.dp}")
    return load_config(args.config, overrides)


#: Errors found before training that a user fixes in the config or the data: one line, no traceback.
CONFIGURATION_ERRORS = (ConfigError, DataError, UnsupportedModelError)
#: How long a rank other than 0 waits before reporting a configuration error itself (see
#: `report_configuration_error`).
PEER_REPORT_DELAY_S = 10.0


def report_configuration_error(error: BaseException, rank: str) -> None:
    """One line on stderr, ``finetune: configuration error: ...``, printed once per job.

    Every rank checks the same config, so rank 0 prints and the others stay silent. But a launcher stops
    every rank as soon as one exits: a rank that found the error first and exited at once could get rank 0
    killed before it printed. So the other ranks wait `PEER_REPORT_DELAY_S` first; when rank 0 found the
    same error, the launcher ends them during that wait, silently. When it did not (an error only some
    ranks see, such as a missing GPU), the rank prints it after the wait, naming itself."""
    line = " ".join(str(error).split("\n"))
    if rank == "0":
        print(f"finetune: configuration error: {line}", file=sys.stderr, flush=True)
        return
    time.sleep(PEER_REPORT_DELAY_S)
    print(f"finetune: rank {rank}: configuration error: {line}", file=sys.stderr, flush=True)


def failure_hint(error: BaseException) -> str | None:
    """What to do about a failure users commonly hit, or None: the traceback alone says more.

    Why: an out-of-memory error or a timed-out collective names the allocation or the collective, not the
    config keys that would avoid it."""
    import torch

    text = str(error)
    if isinstance(error, torch.OutOfMemoryError) or "can't allocate memory" in text:
        return OUT_OF_MEMORY_HINT
    if "waiting for clients" in text:
        return MISSING_RANK_HINT
    if "timed out" in text.lower():
        return TIMEOUT_HINT
    if "connection closed by peer" in text.lower() or "connection reset by peer" in text.lower():
        return PEER_EXITED_HINT
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    rank = os.environ.get("RANK", "0")
    try:
        config = config_from_args(args)
        from pp_offload.recipe.train import run

        result = run(config, progress=not args.no_progress)
    except CONFIGURATION_ERRORS as error:
        report_configuration_error(error, rank)
        return 2
    except RunStopped as error:  # every rank stops alike: one line from rank 0, the reason's exit code
        if rank == "0":
            print(f"finetune: {error}", file=sys.stderr, flush=True)
        return error.exit_code
    except Exception as error:
        hint = failure_hint(error)
        hint = f"\nfinetune: rank {rank}: {hint}" if hint else ""
        print(f"finetune: rank {rank} failed:\n{traceback.format_exc()}{hint}", file=sys.stderr, flush=True)
        return 1
    if result.preempted:  # exit 0: torchrun must not restart a run that was asked to stop
        return 0
    if rank == "0":
        where = f"; exported to {result.export_dir}" if result.export_dir else ""
        losses = result.losses
        if losses:
            held_out = ""
            if result.evals:
                last = result.evals[-1]
                held_out = f"; validation loss {last['loss']:.4f} (perplexity {last['perplexity']:.1f})"
            print(
                f"finetune: done, loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps"
                f"{f' ({len(result.skipped_steps)} skipped as non-finite)' if result.skipped_steps else ''}"
                f"{held_out}{where}"
            )
    return 0
