"""``pp-offload plan``: which pipeline schedule and offload policy for this model on this machine.

Evaluates every schedule (ours and torch's) with every offload policy and recompute plan through the
simulator and prints the answer: the recommendation with its figures, up to five alternatives (near ties
named), why, and the recipe YAML that applies it; ``--all`` prints the whole ranked table (predicted step
time, bubble, activation and whole memory of the fullest rank, fits or not), ``--plot`` draws the
candidates and the memory per rank, ``--json`` writes every number.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pp_offload.plan.auto import DEFAULT_RECOMPUTE
from pp_offload.plan.machines import MACHINES
from pp_offload.plan.orders import SCHEDULES
from pp_offload.plan.shapes import SHAPES

__all__ = ["DESCRIPTION", "EPILOG", "add_arguments", "main", "run_from_args"]

DESCRIPTION = textwrap.fill(
    "Choose a pipeline schedule and an offload policy for a model on a machine. "
    + " ".join(__doc__.split("\n\n")[1].split()),
    width=100,
)
EPILOG = (
    """\
Units: --flops in TFLOP/s (peak dense, per GPU), --host-bandwidth and --p2p-bandwidth in GB/s (one direction),
--gpu-memory in GiB. Machine presets (peak bf16 TFLOP/s, host link GB/s, GiB): """
    + ", ".join(
        f"{m.name} ({m.flops / 1e12:g}, {m.host_bandwidth / 1e9:g}, {m.memory_gib:g})"
        for m in MACHINES.values()
    )
    + """.

examples:
  pp-offload plan --model meta-llama/Llama-3.1-8B --seq-len 4096 --microbatches 64 --pp 8 --machine H100
  pp-offload plan --model ./my_model/config.json --seq-len 2048 --microbatch-size 2 \\
      --microbatches 32 --pp 4 --gpu-memory 40 --machine A100 --plot plan.png --json plan.json
"""
)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The planner's flags, on ``parser`` (its own or a subcommand's)."""
    p = parser
    p.add_argument(
        "--model",
        required=True,
        metavar="PATH_OR_ID",
        help="HF model config: a model directory, a config .json file, a hub id, or a shape known offline: "
        + ", ".join(SHAPES),
    )
    p.add_argument("--seq-len", type=_positive_int, required=True, metavar="S", help="tokens per sample")
    p.add_argument(
        "--microbatch-size",
        type=_positive_int,
        default=1,
        metavar="B",
        help="samples per microbatch (default: 1)",
    )
    p.add_argument(
        "--microbatches",
        type=_positive_int,
        required=True,
        metavar="M",
        help="microbatches per step and pipeline",
    )
    p.add_argument("--pp", type=_positive_int, required=True, metavar="D", help="pipeline ranks (>= 2)")
    p.add_argument(
        "--dp", type=_positive_int, default=1, metavar="N", help="data-parallel replicas (default: 1)"
    )
    p.add_argument(
        "--dp-shard",
        action="store_true",
        help="optimizer state and master weights sharded over --dp (ZeRO-1/2, FSDP2 under PP)",
    )
    p.add_argument(
        "--lora-rank",
        type=_positive_int,
        default=0,
        metavar="R",
        help="plan LoRA fine-tuning: adapters of rank R on every layer projection, base frozen",
    )
    p.add_argument(
        "--gpu-memory",
        type=_positive_float,
        default=None,
        metavar="GIB",
        help="usable device memory per GPU (default: the machine's)",
    )
    p.add_argument("--machine", default="H100", choices=sorted(MACHINES), help="GPU preset (default: H100)")
    p.add_argument(
        "--flops",
        type=_positive_float,
        default=None,
        metavar="TFLOPS",
        help="peak dense TFLOP/s per GPU, replacing the preset's",
    )
    p.add_argument(
        "--host-bandwidth",
        type=_positive_float,
        default=None,
        metavar="GBPS",
        help="device<->host GB/s per direction, replacing the preset's",
    )
    p.add_argument(
        "--p2p-bandwidth",
        type=_positive_float,
        default=None,
        metavar="GBPS",
        help="GB/s between pipeline neighbours, replacing the preset's",
    )
    p.add_argument(
        "--mfu", type=_positive_float, default=None, help="share of peak FLOP/s achieved (default 0.5)"
    )
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"), help="training dtype")
    p.add_argument(
        "--schedules",
        nargs="+",
        default=None,
        metavar="NAME",
        help=f"schedules to evaluate (default: all: {' '.join(SCHEDULES)})",
    )
    p.add_argument(
        "--offload",
        nargs="+",
        default=None,
        metavar="POLICY",
        help="offload policies (default: none selective:0.25 selective:0.5 full budget budget:auto:0.1)",
    )
    p.add_argument(
        "--recompute",
        nargs="+",
        default=None,
        metavar="PLAN",
        help="activation recompute of the decoder layers to try: none, mlp (the MLP's activation and "
        "product only), selective, full, a mode on the first share of each stage's layers, e.g. "
        "selective:0.75, and another on the rest, selective:0.75,mlp; +once: recomputed once per "
        "microbatch, selective+once (default: none and the plans schedule: auto weighs, "
        + " ".join(DEFAULT_RECOMPUTE)
        + ")",
    )
    p.add_argument(
        "--split",
        default="deferred",
        choices=("deferred", "torch"),
        help="how split-backward schedules split backward: deferred (weight gradients deferred to W, the "
        "runtime's default: each linear's input and output gradient held from I to W, a checkpointed "
        "layer run twice) or torch (torch's retained-graph split, the recipe's pipeline.deferred_w: false: "
        "the saved tensors held from I to W, a checkpointed layer run 3 times, eager only); default: "
        "deferred. The pick's figures under the other split are printed beside it when it recomputes",
    )
    p.add_argument(
        "--within",
        type=float,
        default=None,
        metavar="SLOWDOWN",
        help="instead of the fastest that fits: per schedule, the lowest activation peak within this "
        "step-time slowdown (0.1 = +10%%) over the recompute plans (every share the stages express) alone "
        "and with budget offload in what they leave, in whole-layer and in sub-layer units (column units; "
        "pp_offload.plan.within; ignores --offload, "
        "--recompute and the memory limit)",
    )
    p.add_argument(
        "--search",
        default="auto",
        choices=("auto", "full", "fast"),
        help="how our V orders are searched (auto: full up to pp=8, fast above)",
    )
    p.add_argument(
        "--virtual-stages",
        type=_positive_int,
        default=2,
        metavar="V",
        help="stages per rank of torch's interleaved schedules (default: 2)",
    )
    p.add_argument(
        "--reserve",
        type=float,
        default=2.0,
        metavar="GIB",
        help="memory per GPU set aside for the CUDA context, NCCL and fragmentation (default: 2)",
    )
    p.add_argument(
        "--all-offload",
        action="store_true",
        help="also replay offload for schedules that fit without it (slower; shows what it saves)",
    )
    p.add_argument(
        "--all",
        action="store_true",
        help="print every candidate in a ranked table instead of the recommendation and a few alternatives",
    )
    p.add_argument("--jobs", type=_positive_int, default=None, help="worker processes (default: one per CPU)")
    p.add_argument("--plot", type=Path, default=None, metavar="PNG", help="draw the candidates to this file")
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="write every number to this file")
    p.add_argument(
        "--quiet", action="store_true", help="no progress bar (there is none when stderr is not a terminal)"
    )


def run_from_args(args: argparse.Namespace) -> int:
    from pp_offload.plan.planner import PlanError, plan

    if args.within is not None:
        return _within_from_args(args)
    kwargs = {
        "seq_len": args.seq_len,
        "microbatch_size": args.microbatch_size,
        "num_microbatches": args.microbatches,
        "pp": args.pp,
        "dp": args.dp,
        "dp_shard": args.dp_shard,
        "lora_rank": args.lora_rank,
        "gpu_memory_gib": args.gpu_memory,
        "machine": args.machine,
        "dtype": args.dtype,
        "schedules": args.schedules,
        "offload": args.offload,
        "recompute": args.recompute,
        "flops": args.flops * 1e12 if args.flops else None,
        "host_bandwidth": args.host_bandwidth * 1e9 if args.host_bandwidth else None,
        "mfu": args.mfu,
        "virtual_stages": args.virtual_stages,
        "search": args.search,
        "reserve_gib": args.reserve,
        "evaluate_dominated": args.all_offload,
        "jobs": args.jobs,
        "progress": not args.quiet,
        "deferred_w": args.split == "deferred",
    }
    status = 0
    try:
        result = _plan_with_p2p(plan, args, kwargs)
    except PlanError as e:
        result = e.result
        if result is not None and any(c.evaluated for c in result.candidates):
            print(_report(result, args, reason=False))  # the reason follows as the error
        print(
            "\n".join(textwrap.wrap(f"pp-offload plan: error: {e}", width=100, subsequent_indent="  ")),
            file=sys.stderr,
        )
        if result is None:
            return 1
        status = 1
    except (ValueError, TypeError) as e:
        print(f"pp-offload plan: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("pp-offload plan: interrupted", file=sys.stderr)
        return 130
    else:
        print(_report(result, args))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result.to_dict(), indent=1))
        print(f"wrote {args.json}")
    if args.plot is not None:
        print(f"wrote {result.plot(args.plot)}")
    return status


def _report(result: Any, args: argparse.Namespace, *, reason: bool = True) -> str:
    """The whole table with ``--all``, else the answer (`pp_offload.plan.report.format_summary`)."""
    from pp_offload.plan.report import format_summary

    return result.table() if args.all else format_summary(result, model=args.model, reason=reason)


def _within_from_args(args: argparse.Namespace) -> int:
    """``--within``: `lowest_peak_within` for each schedule of ``--schedules`` (default: V-Half)."""
    from pp_offload.plan.machines import resolve_machine
    from pp_offload.plan.orders import canonical_schedule
    from pp_offload.plan.within import lowest_peak_within

    try:
        machine = resolve_machine(
            args.machine,
            flops=args.flops * 1e12 if args.flops else None,
            host_bandwidth=args.host_bandwidth * 1e9 if args.host_bandwidth else None,
            mfu=args.mfu,
            p2p_bandwidth=args.p2p_bandwidth * 1e9 if args.p2p_bandwidth else None,
        )
        setting = {
            "pp": args.pp,
            "seq_len": args.seq_len,
            "microbatch_size": args.microbatch_size,
            "num_microbatches": args.microbatches,
            "machine": machine,
            "dtype": args.dtype,
            "dp": args.dp,
            "dp_shard": args.dp_shard,
            "lora_rank": args.lora_rank,
            "deferred_w": args.split == "deferred",
        }
        names = [canonical_schedule(s) for s in args.schedules or ["ScheduleVHalf"]]
        found = {
            n: lowest_peak_within(args.model, schedule=n, slowdown=args.within, **setting) for n in names
        }
    except (ValueError, TypeError, RuntimeError) as e:
        print(f"pp-offload plan: error: {e}", file=sys.stderr)
        return 2
    print("\n\n".join(result.table(name) for name, result in found.items()))
    if args.json is not None:
        rows = {name: [dataclasses.asdict(r) for r in result.rows] for name, result in found.items()}
        best = {name: dataclasses.asdict(result.best) for name, result in found.items()}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"within": args.within, "best": best, "rows": rows}, indent=1))
        print(f"wrote {args.json}")
    return 0


def _plan_with_p2p(plan, args: argparse.Namespace, kwargs: dict):
    if args.p2p_bandwidth is None:
        return plan(args.model, **kwargs)
    from pp_offload.plan.machines import resolve_machine

    machine = resolve_machine(args.machine, p2p_bandwidth=args.p2p_bandwidth * 1e9)
    return plan(args.model, **{**kwargs, "machine": machine})


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pp-offload plan",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
