"""Command line of the fine-tuning recipe (``recipes/finetune.py``, ``python -m pp_offload.recipe``).

Launch one process per pipeline rank with torchrun or accelerate::

    torchrun --nproc-per-node 2 recipes/finetune.py --config recipes/configs/tiny_llama.yaml
    torchrun --nproc-per-node 4 recipes/finetune.py --config recipes/configs/tiny_llama.yaml --dp 2
    accelerate launch --config_file recipes/accelerate_cpu.yaml recipes/finetune.py --config ...

With one process (plain ``python``) the same config trains the unsplit model: the reference a pipelined run
reproduces.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Sequence

from pp_offload.recipe.config import ConfigError, load_config

__all__ = ["main", "parser"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="finetune",
        description="Pipeline-parallel fine-tuning of a Hugging Face causal LM with pp-offload's schedules.",
        epilog="Example: torchrun --nproc-per-node 2 recipes/finetune.py "
        "--config recipes/configs/tiny_llama.yaml --set train.steps=20 --set pipeline.schedule=ScheduleVMin",
    )
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
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    overrides = list(args.overrides)
    if args.output_dir:
        overrides.append(f"output.dir={args.output_dir}")
    if args.resume:
        overrides.append("output.resume=true")
    if args.dp is not None:
        overrides.append(f"pipeline.dp={args.dp}")
    rank = os.environ.get("RANK", "0")
    try:
        config = load_config(args.config, overrides)
        from pp_offload.recipe.train import run

        result = run(config, progress=not args.no_progress)
    except ConfigError as error:
        if rank == "0":
            print(f"finetune: configuration error: {error}", file=sys.stderr)
        return 2
    except Exception:
        print(f"finetune: rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        return 1
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
                f"{held_out}{where}"
            )
    return 0
