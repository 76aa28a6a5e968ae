"""``pp-offload demo``: train one small model with six pipeline schedules on CPU and compare them.

Why: the quickest way to see what the V schedules buy, on any machine, with nothing to download. Each
schedule trains the same model from the same initial weights on the same synthetic batches, in ``--ranks``
real processes joined by gloo, so the demo shows at once that

- every schedule computes exactly what one process computes (its losses match a single-process reference
  run within fp32 tolerance),
- the V schedules trade bubble for activation memory as advertised (simulated peak memory in chunk units
  and as a fraction of 1F1B's, simulated bubble), and
- what the runtime really did (median step time, realized bubble from `ActionTimer`), pictured next to the
  prediction in ``<out>/timeline_<schedule>.png``; all numbers go to ``<out>/summary.json``.

The model is a stack of pre-norm residual MLP blocks (the feed-forward half of a transformer block),
``2 * ranks`` stages, fp32, learning a fixed random teacher ``y = tanh(x A)`` with Adam. Schedules: ours
(V-Min, V-Half, V-ZB, V-Adaptive under 0.75 of 1F1B's memory) in V placement (rank r holds stages r and
2d-1-r) and torch's ``ScheduleZBVZeroBubble`` (V) and ``ScheduleInterleaved1F1B`` (loop: stage s on rank
s % d).

Compute here is real (tiny) CPU work, so timings include torch's per-action overhead and depend on the
machine; `pp_offload.emulate` and ``bench/bench_realized.py`` measure schedules without that noise.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["DemoConfig", "DemoError", "add_arguments", "main", "run_demo"]

_REL_TOL = 1e-4  # fp32: pipelined and single-process runs sum microbatch gradients in different orders
_ABS_TOL = 1e-6


@dataclass(frozen=True)
class _Spec:
    """A schedule of the demo: class ``name`` (`pp_offload.runtime.catalog`), its stage placement and extra
    arguments."""

    label: str
    name: str
    placement: str  # "v" or "loop", as in pp_offload.emulate.stage_indices
    kwargs: dict[str, Any] = field(default_factory=dict)


SCHEDULES: tuple[_Spec, ...] = (
    _Spec("ScheduleVMin", "ScheduleVMin", "v"),
    _Spec("ScheduleVHalf", "ScheduleVHalf", "v"),
    _Spec("ScheduleVZB", "ScheduleVZB", "v"),
    _Spec("ScheduleVAdaptive(0.75)", "ScheduleVAdaptive", "v", {"memory_limit": 0.75}),
    _Spec("ScheduleZBVZeroBubble", "ScheduleZBVZeroBubble", "v"),
    _Spec("ScheduleInterleaved1F1B", "ScheduleInterleaved1F1B", "loop"),
)
_LOSS_CURVE_OF = "ScheduleVHalf"  # whose per-step losses are printed


class DemoError(RuntimeError):
    """The demo could not run or a rank failed; the message says why (a rank's traceback included)."""


@dataclass(frozen=True)
class DemoConfig:
    """Everything that decides what the demo computes (all ranks receive a copy)."""

    ranks: int = 2
    steps: int = 5
    microbatches: int | None = None  # None: 4 * ranks, a full steady phase
    out: Path = Path("runs/demo")
    hidden: int = 192
    microbatch_size: int = 32
    blocks_per_stage: int = 2
    lr: float = 2e-3
    seed: int = 0
    timeout: float = 300.0
    plots: bool = True
    fail_rank: int | None = None  # testing only: this rank raises in its first step

    @property
    def num_microbatches(self) -> int:
        return self.microbatches if self.microbatches is not None else 4 * self.ranks

    @property
    def num_stages(self) -> int:
        return 2 * self.ranks


# --------------------------------------------------------------------------------------------------------
# The model and the data: built identically in every process from the seed


def _block(hidden: int) -> Any:
    from torch import nn

    class ResidualMLP(nn.Module):
        """Pre-norm residual feed-forward block: ``x + W2 gelu(W1 norm(x))``."""

        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(hidden)
            self.up = nn.Linear(hidden, 4 * hidden)
            self.down = nn.Linear(4 * hidden, hidden)

        def forward(self, x):
            return x + self.down(nn.functional.gelu(self.up(self.norm(x))))

    return ResidualMLP()


def build_model(config: DemoConfig) -> Any:
    """``nn.Sequential`` of ``2 * ranks`` stages, each ``blocks_per_stage`` residual MLP blocks."""
    import torch
    from torch import nn

    torch.manual_seed(config.seed)
    return nn.Sequential(
        *[
            nn.Sequential(*[_block(config.hidden) for _ in range(config.blocks_per_stage)])
            for _ in range(config.num_stages)
        ]
    )


def make_batch(config: DemoConfig, step: int) -> tuple[Any, Any]:
    """Step ``step``'s whole batch ``(x, y)``: fresh Gaussian inputs, targets from a fixed random teacher."""
    import torch

    teacher = torch.Generator().manual_seed(10_000 + config.seed)
    a = torch.randn(config.hidden, config.hidden, generator=teacher) / config.hidden**0.5
    gen = torch.Generator().manual_seed(20_000 + 1_000 * config.seed + step)
    x = torch.randn(config.num_microbatches * config.microbatch_size, config.hidden, generator=gen)
    return x, torch.tanh(x @ a)


def _loss(output: Any, target: Any, *, num_microbatches: int) -> Any:
    """Mean squared error of one microbatch, divided by the microbatch count: summed over microbatches
    it is the batch's loss, so ``scale_grads=False`` gives the batch gradient (the pattern that stays
    right with tied weights)."""
    import torch.nn.functional as F

    return F.mse_loss(output, target) / num_microbatches


def reference_losses(config: DemoConfig) -> list[float]:
    """The per-step losses of one process training the whole model on the same microbatches."""
    import torch

    model = build_model(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    m = config.num_microbatches
    out = []
    for step in range(config.steps):
        x, y = make_batch(config, step)
        loss = sum(
            _loss(model(xc), yc, num_microbatches=m)
            for xc, yc in zip(x.tensor_split(m), y.tensor_split(m), strict=True)
        )
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        out.append(loss.item())
    return out


# --------------------------------------------------------------------------------------------------------
# Rank side


def _rank_main(rank: int, world_size: int, config: DemoConfig, specs: list[_Spec]) -> list[dict[str, Any]]:
    """One pipeline rank (run by `pp_offload.local_ranks.run_on_ranks`, in a gloo group): train with every
    schedule; rank 0 streams progress to the parent and returns what it measured (others: [])."""
    import torch.distributed as dist

    from pp_offload.local_ranks import send

    records = []
    for spec in specs:
        if rank == 0:
            send("start", spec.label)
        record = _train(rank, config, spec)
        if rank == 0:
            send("done", spec.label)
            records.append(record)
    dist.barrier()
    return records


def _train(rank: int, config: DemoConfig, spec: _Spec) -> dict[str, Any]:
    """Train ``config.steps`` steps with one schedule; rank 0 returns everything measured (others: {})."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    from pp_offload.emulate import stage_indices
    from pp_offload.runtime.catalog import build_schedule, schedule_info
    from pp_offload.runtime.timing import ActionTimer, realized_bubble

    d, m = config.ranks, config.num_microbatches
    model = build_model(config)
    indices = stage_indices(rank, d, spec.placement)
    stages = [PipelineStage(model[s], s, config.num_stages, torch.device("cpu")) for s in indices]
    loss_fn = functools.partial(_loss, num_microbatches=m)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            schedule = build_schedule(
                schedule_info(spec.name), stages, m, loss_fn=loss_fn, scale_grads=False, **spec.kwargs
            )
    except ValueError as e:
        # e.g. m not a multiple of d for Interleaved1F1B, or no V order under the memory limit. It fails
        # alike on every rank (a spread order search fails everywhere together), so all ranks skip it.
        return {"label": spec.label, "skipped": str(e).splitlines()[0]}
    optimizer = torch.optim.Adam([p for s in indices for p in model[s].parameters()], lr=config.lr)
    has_first, has_last = 0 in indices, config.num_stages - 1 in indices

    timer = ActionTimer(schedule)
    steps = []
    timed_events: list[Any] = []  # every step's but the first (which also infers shapes, sets up p2p)
    for step in range(config.steps):
        if config.fail_rank == rank:
            raise RuntimeError(f"rank {rank} fails on purpose (--fail-rank {rank})")
        x, y = make_batch(config, step)
        losses: list[Any] = []
        args = (x,) if has_first else ()
        kwargs = {"target": y, "losses": losses} if has_last else {}
        timer.clear()
        dist.barrier()
        start = time.perf_counter()
        schedule.step(*args, **kwargs)
        end = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = float(torch.stack([v.detach() for v in losses]).sum()) if losses else None
        mine = (start, end, loss)
        everyone: list[Any] = [None] * d
        dist.all_gather_object(everyone, mine)
        events = timer.gather()
        if step > 0 or config.steps == 1:
            timed_events.extend(tuple(e) for e in events)
        steps.append(
            {
                "loss": next(e[2] for e in everyone if e[2] is not None),
                "ms": (max(e[1] for e in everyone) - min(e[0] for e in everyone)) * 1e3,
                "realized_bubble": realized_bubble(events),
            }
        )
    timer.detach()
    if rank != 0:
        return {}
    order = {
        r: [(a.stage_index, str(a.computation_type.value), a.microbatch_index) for a in acts if a is not None]
        for r, acts in schedule.pipeline_order.items()
    }
    return {
        "label": spec.label,
        "steps": steps,
        "order": order,
        "events": [tuple(e) for e in events],  # the last step's
        "timed_events": timed_events,
    }


# --------------------------------------------------------------------------------------------------------
# Parent side: launch, collect, compare, report


def _launch(config: DemoConfig, specs: list[_Spec], on_event: Any) -> list[dict[str, Any]]:
    """Run the ranks; a failing rank stops all of them and raises `DemoError` with its traceback."""
    from pp_offload.local_ranks import RankError, RankTimeout, format_stacks, run_on_ranks

    try:
        per_rank = run_on_ranks(
            _rank_main,
            config.ranks,
            config,
            specs,
            timeout=config.timeout,
            op_timeout=min(60.0, config.timeout),
            on_message=lambda rank, kind, payload: on_event(kind, payload),
        )
    except RankError as e:
        if e.remote_traceback is None:
            raise DemoError(f"rank {e.rank} exited with code {e.exitcode} and no report") from None
        raise DemoError(str(e)) from None
    except RankTimeout as e:
        where = f"\nwhere each rank was:\n{format_stacks(e.stacks)}" if e.stacks else ""
        raise DemoError(
            f"the demo did not finish within --timeout {config.timeout:g} s "
            f"(ranks still running: {e.unfinished}); on a slow or busy machine raise --timeout{where}"
        ) from None
    return per_rank[0]


def _analyse(
    config: DemoConfig, record: dict[str, Any], reference: list[float], costs: Any
) -> dict[str, Any]:
    """Compare one schedule's run with the reference, and with the simulator at the measured ``costs``."""
    from pp_offload.order import Action
    from pp_offload.order.vshape import one_f_one_b_peak
    from pp_offload.sim import as_executed_by_torch, simulate

    order = {int(r): [Action(*a) for a in acts] for r, acts in record["order"].items()}
    losses = [s["loss"] for s in record["steps"]]
    diffs = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, reference, strict=True)]
    match = all(
        math.isclose(a, b, rel_tol=_REL_TOL, abs_tol=_ABS_TOL) for a, b in zip(losses, reference, strict=True)
    )
    nominal = simulate(order)
    executed = as_executed_by_torch(order)  # torch runs stage 0's whole backward at its W
    predicted = simulate(executed, costs)
    timed = record["steps"][1:] or record["steps"]  # step 1 also infers shapes and sets up p2p
    ref_peak = one_f_one_b_peak(config.ranks, config.num_microbatches)
    return {
        "schedule": record["label"],
        "losses": losses,
        "final_loss": losses[-1],
        "matches_reference": match,
        "max_rel_diff_vs_reference": max(diffs),
        "peak_activation_chunks": nominal.peak,
        "peak_activation_vs_1f1b": nominal.peak / ref_peak,
        "simulated_bubble_unit_costs": nominal.bubble,
        "simulated_bubble": predicted.bubble,
        "predicted_step_ms": predicted.makespan,
        "step_ms": [s["ms"] for s in record["steps"]],
        "median_step_ms": statistics.median(s["ms"] for s in timed),
        "realized_bubble": statistics.median(s["realized_bubble"] for s in timed),
        "last_step_events": [list(e) for e in record["events"]],  # (rank, action, start s, end s)
        "_executed_order": executed,
        "_costs": costs,
    }


def _table(rows: list[dict[str, Any]], ref_peak: int) -> str:
    head = (
        f"{'schedule':<25}{'final loss':>11}{'= ref':>7}{'peak act. mem':>16}{'sim bubble':>12}"
        f"{'sim bubble*':>13}{'pred ms*':>10}{'step ms':>9}{'real bubble':>13}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        mem = f"{r['peak_activation_chunks']:g} ({r['peak_activation_vs_1f1b']:.2f}x)"
        lines.append(
            f"{r['schedule']:<25}{r['final_loss']:>11.5f}{'yes' if r['matches_reference'] else 'NO':>7}"
            f"{mem:>16}{r['simulated_bubble_unit_costs']:>12.1%}{r['simulated_bubble']:>13.1%}"
            f"{r['predicted_step_ms']:>10.1f}{r['median_step_ms']:>9.1f}{r['realized_bubble']:>13.1%}"
        )
    lines.append(
        "= ref: every step's loss equals the one-process run's within fp32 tolerance.\n"
        "peak act. mem: simulated peak activation memory of the fullest rank, in chunks (one stage's "
        f"activations for one microbatch) and as a fraction of 1F1B's {ref_peak}.\n"
        "sim bubble: the simulator with unit F/I/W costs. *: with the F/I/W costs measured in this run "
        "(medians over all schedules), on the order as torch runs it (stage 0's backward whole at W).\n"
        "step ms: median measured step, step 1 left out. real bubble: 1 - busiest rank's compute time / "
        "step time, from the actions ActionTimer recorded (median)."
    )
    return "\n".join(lines)


def run_demo(config: DemoConfig, *, stream: Any = None) -> dict[str, Any]:
    """Run the demo, print its report to ``stream`` (default stdout) and return the summary dict."""
    stream = stream or sys.stdout
    wall_start = time.perf_counter()
    import torch
    from tqdm import tqdm

    from pp_offload.order.vshape import one_f_one_b_peak
    from pp_offload.plot import measured_costs

    def say(text: str = "") -> None:
        print(text, file=stream, flush=True)

    specs = list(SCHEDULES)
    model = build_model(config)
    params = sum(p.numel() for p in model.parameters())
    cores = os.cpu_count() or 1
    say(
        f"pp-offload demo: {len(specs)} schedules x {config.steps} steps on {config.ranks} pipeline ranks "
        f"(CPU, gloo; {cores} cores)\n"
        f"model: {config.num_stages} stages x {config.blocks_per_stage} residual MLP blocks, hidden "
        f"{config.hidden}, {params / 1e6:.2f} M params, fp32; batch {config.num_microbatches} microbatches "
        f"x {config.microbatch_size} rows; Adam lr {config.lr:g}"
    )
    if config.ranks > cores:
        say(f"note: {config.ranks} ranks share {cores} cores; step times include waiting for a core")

    bar = tqdm(total=len(specs), desc="schedules", unit="schedule", file=sys.stderr, leave=True)

    def on_event(kind: str, payload: Any) -> None:
        if kind == "start":
            bar.set_postfix_str(payload)
        elif kind == "done":
            bar.update(1)

    try:
        records = _launch(config, specs, on_event)
    finally:
        bar.close()
    skipped = [f"{r['label']}: {r['skipped']}" for r in records if "skipped" in r]
    records = [r for r in records if "skipped" not in r]
    for reason in skipped:
        say(f"skipped {reason}")
    if not records:
        raise DemoError(
            f"no schedule can run {config.ranks} ranks with {config.num_microbatches} microbatches; "
            "try --microbatches with a multiple of --ranks"
        )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # like the ranks
    try:
        reference = reference_losses(config)
    finally:
        torch.set_num_threads(threads)
    # one cost model for the machine: per-pass medians over every schedule's timed steps
    costs = measured_costs(e for rec in records for e in rec["timed_events"])
    rows = [_analyse(config, rec, reference, costs) for rec in records]

    curve_row = next((r for r in rows if r["schedule"] == _LOSS_CURVE_OF), rows[0])
    say()
    say(f"loss by step, {curve_row['schedule']:<23}" + "".join(f"{v:>10.5f}" for v in curve_row["losses"]))
    say(f"loss by step, {'one-process reference':<23}" + "".join(f"{v:>10.5f}" for v in reference))
    say()
    ref_peak = one_f_one_b_peak(config.ranks, config.num_microbatches)
    say(_table(rows, ref_peak))
    same_order: dict[Any, list[str]] = {}
    for rec in records:
        key = tuple(sorted((rank, tuple(map(tuple, acts))) for rank, acts in rec["order"].items()))
        same_order.setdefault(key, []).append(rec["label"])
    for labels in same_order.values():
        if len(labels) > 1:
            say(
                f"note: {', '.join(labels)} run the same order at d={config.ranks}, "
                f"m={config.num_microbatches}"
            )
    say()

    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    plots: dict[str, str] = {}
    if config.plots:
        from pp_offload.plot import plot_side_by_side

        for row, rec in zip(rows, records, strict=True):
            path = out / f"timeline_{_slug(row['schedule'])}.png"
            plot_side_by_side(
                row["_executed_order"], rec["events"], path, row["_costs"], title=row["schedule"]
            )
            plots[row["schedule"]] = str(path)
    wall = time.perf_counter() - wall_start
    summary = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(config).items()},
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cores": cores,
        "reference_losses": reference,
        "one_f_one_b_peak_chunks": ref_peak,
        "measured_costs_ms": {"F": costs.F, "I": costs.I, "W": costs.W},
        "skipped": skipped,
        "schedules": [
            {
                **{k: v for k, v in r.items() if not k.startswith("_")},
                "timeline_png": plots.get(r["schedule"]),
            }
            for r in rows
        ],
        "all_match_reference": all(r["matches_reference"] for r in rows),
        "wall_s": wall,
    }
    with open(out / "summary.json", "w") as f:
        json.dump(summary, f, indent=2)
    written = f"{out / 'summary.json'}" + (
        f" and {len(plots)} timelines {out}/timeline_<schedule>.png" if plots else ""
    )
    say(f"wrote {written}  ({wall:.1f} s)")
    if not summary["all_match_reference"]:
        bad = [r["schedule"] for r in rows if not r["matches_reference"]]
        raise DemoError(f"losses differ from the single-process reference for {bad}")
    return summary


def _slug(label: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in label).strip("_")


# --------------------------------------------------------------------------------------------------------
# Command line


def _int_at_least(minimum: int, what: str) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum} ({what}), got {value}")
        return value

    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value:g}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's flags, on ``parser`` (its own or a subcommand's)."""
    parser.add_argument(
        "--ranks",
        type=_int_at_least(2, "V schedules need 2 stages on each of at least 2 ranks"),
        default=2,
        metavar="D",
        help="pipeline ranks, i.e. processes; the model gets 2*D stages (default: 2)",
    )
    parser.add_argument(
        "--steps",
        type=_int_at_least(1, "training steps per schedule"),
        default=5,
        metavar="N",
        help="training steps per schedule (default: 5)",
    )
    parser.add_argument(
        "--microbatches",
        type=_int_at_least(1, "microbatches per step"),
        default=None,
        metavar="M",
        help="microbatches per step (default: 4*D, i.e. 2 per stage: a full steady phase)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("runs/demo"),
        metavar="DIR",
        help="where summary.json and timeline_<schedule>.png go (default: runs/demo)",
    )
    parser.add_argument(
        "--hidden",
        type=_int_at_least(1, "model width"),
        default=DemoConfig.hidden,
        metavar="H",
        help=f"model width (default: {DemoConfig.hidden})",
    )
    parser.add_argument(
        "--timeout",
        type=_positive_float,
        default=300.0,
        metavar="S",
        help="seconds before the whole run is stopped as hung (default: 300)",
    )
    parser.add_argument("--no-plots", action="store_true", help="skip the timeline PNGs")
    parser.add_argument("--fail-rank", type=int, default=None, help=argparse.SUPPRESS)  # tests only


def config_from_args(args: argparse.Namespace) -> DemoConfig:
    return DemoConfig(
        ranks=args.ranks,
        steps=args.steps,
        microbatches=args.microbatches,
        out=args.out,
        hidden=args.hidden,
        timeout=args.timeout,
        plots=not args.no_plots,
        fail_rank=args.fail_rank,
    )


DESCRIPTION = "Train" + __doc__.split("\n\n")[0].removeprefix("``pp-offload demo``: train")
EPILOG = """\
Trains a small residual-MLP model on synthetic data with ScheduleVMin, ScheduleVHalf, ScheduleVZB,
ScheduleVAdaptive(memory_limit=0.75) and torch's ScheduleZBVZeroBubble and ScheduleInterleaved1F1B, all from
the same initial weights, checks every schedule's losses against a one-process run, and prints simulated
activation memory and bubble next to measured step time and realized bubble.

examples:
  python -m pp_offload demo                       # 2 ranks, 5 steps, ~1 minute on 2 cores
  pp-offload demo --ranks 4 --steps 3 --out runs/demo4
"""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pp-offload demo",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


def run_from_args(args: argparse.Namespace) -> int:
    try:
        run_demo(config_from_args(args))
    except DemoError as e:
        print(f"pp-offload demo: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("pp-offload demo: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
