"""Command line: ``python -m pp_offload <command>`` or ``pp-offload <command>``.

Commands:
  demo    train a small model with six pipeline schedules on CPU and compare them (`pp_offload.demo`)
  plan    choose a schedule and an offload policy for a model on a machine (`pp_offload.plan`)
  families  which Hugging Face causal LMs split exactly (`pp_offload.families_cli`)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pp_offload import __version__


def _parser() -> argparse.ArgumentParser:
    from pp_offload import demo

    parser = argparse.ArgumentParser(
        prog="pp-offload",
        description="Memory-efficient pipeline parallelism on torch.distributed.pipelining.",
    )
    parser.add_argument("--version", action="version", version=f"pp-offload {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo_parser = commands.add_parser(
        "demo",
        help="train a small model with six pipeline schedules on CPU and compare them (~1 minute)",
        description=demo.DESCRIPTION,
        epilog=demo.EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_arguments(demo_parser)
    demo_parser.set_defaults(run=demo.run_from_args)
    from pp_offload.plan import cli as plan_cli

    plan_parser = commands.add_parser(
        "plan",
        help="choose a pipeline schedule and offload policy for a model on a machine (simulated)",
        description=plan_cli.DESCRIPTION,
        epilog=plan_cli.EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    plan_cli.add_arguments(plan_parser)
    plan_parser.set_defaults(run=plan_cli.run_from_args)
    from pp_offload import families_cli

    families_parser = commands.add_parser(
        "families",
        help="which Hugging Face causal LMs split exactly (a live sweep of the installed transformers)",
        description=families_cli.DESCRIPTION,
        epilog=families_cli.EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    families_cli.add_arguments(families_parser)
    families_parser.set_defaults(run=families_cli.run_from_args)
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
