"""Command line: ``python -m pp_offload <command>`` or ``pp-offload <command>``.

Commands:
  demo    train a small model with six pipeline schedules on CPU and compare them (`pp_offload.demo`)
  train   check a recipe config, then fine-tune with torchrun here (`pp_offload.recipe.train_command`)
  plan    choose a schedule and an offload policy for a model on a machine (`pp_offload.plan`)
  families  which Hugging Face causal LMs split exactly (`pp_offload.families_cli`)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pp_offload import __version__


def _parser() -> argparse.ArgumentParser:
    from pp_offload import demo, families_cli
    from pp_offload.plan import cli as plan_cli
    from pp_offload.recipe import train_command

    parser = argparse.ArgumentParser(
        prog="pp-offload",
        description="Memory-efficient pipeline parallelism on torch.distributed.pipelining.",
    )
    parser.add_argument("--version", action="version", version=f"pp-offload {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    # each command's module has the same face: DESCRIPTION, EPILOG, add_arguments, run_from_args
    for name, module, summary in (
        ("demo", demo, "train a small model with six pipeline schedules on CPU and compare them (~1 minute)"),
        (
            "train",
            train_command,
            "check a recipe config, then fine-tune with torchrun on this machine (one line per config error)",
        ),
        (
            "plan",
            plan_cli,
            "choose a pipeline schedule and offload policy for a model on a machine (simulated)",
        ),
        (
            "families",
            families_cli,
            "which Hugging Face causal LMs split exactly (a live sweep of the installed transformers)",
        ),
    ):
        command = commands.add_parser(
            name,
            help=summary,
            description=module.DESCRIPTION,
            epilog=module.EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(command)
        command.set_defaults(run=module.run_from_args)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
