"""Realized step time of pipeline schedules vs the simulator's prediction, on CPU with gloo.

Every rank is a real process; stage compute is emulated by sleeping (`pp_offload.emulate`): F, I and W
cost fixed wall time whatever the number of cores, so the gap between realized and predicted step time is
what the runtime adds (communication, torch's per-action Python work, waiting) and nothing else.

For each pipeline size d (processes), microbatch count m and F:I:W cost ratio, every schedule runs a few
warm-up steps and then timed steps (median). The prediction replays the schedule object's own
``pipeline_order`` through `pp_offload.sim.simulate`, so torch's schedules and ours take the same path.
Two predictions are printed: ``pred`` reads the order literally; ``pred*`` reads it as torch executes it,
where stage 0 skips I and runs its whole backward at W (`pp_offload.sim.as_executed_by_torch`).

    python bench/bench_realized.py                       # d = 2 and 4, m = 2d and 4d, costs 1:1:1 and 3:4:2
    python bench/bench_realized.py --ranks 2 --costs 3:4:2 --schedules ScheduleVHalf ScheduleZBVZeroBubble

Writes bench/results/realized.json and bench/results/realized.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"

# name -> (module, placement, extra constructor kwargs); placement as in pp_offload.emulate.stage_indices
SCHEDULES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "ScheduleVMin": ("pp_offload", "v", {}),
    "ScheduleVHalf": ("pp_offload", "v", {}),
    "ScheduleVZB": ("pp_offload", "v", {}),
    "ScheduleVAdaptive": ("pp_offload", "v", {"memory_limit": 0.5}),
    "ScheduleZBVZeroBubble": ("torch.distributed.pipelining", "v", {}),
    "ScheduleDualPipeV": ("torch.distributed.pipelining", "v", {}),
    "ScheduleInterleaved1F1B": ("torch.distributed.pipelining", "loop", {}),
    "Schedule1F1B": ("torch.distributed.pipelining", "single", {}),
}
OURS = {"ScheduleVMin", "ScheduleVHalf", "ScheduleVZB", "ScheduleVAdaptive"}


@dataclass(frozen=True)
class Config:
    schedule: str
    ranks: int
    microbatches: int
    ratio: str  # "F:I:W"

    def pass_ms(self, chunk_ms: float) -> tuple[float, float, float]:
        """F, I, W of one chunk in ms: the ratio scaled so that F + I + W = chunk_ms."""
        f, i, w = (float(v) for v in self.ratio.split(":"))
        unit = chunk_ms / (f + i + w)
        return f * unit, i * unit, w * unit


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="pipeline sizes d (processes)")
    p.add_argument("--mb-factors", type=int, nargs="+", default=[2, 4], help="microbatches m = factor * d")
    p.add_argument("--costs", nargs="+", default=["1:1:1", "3:4:2"], help="F:I:W ratios")
    p.add_argument(
        "--chunk-ms", type=float, default=18.0, help="F + I + W of one chunk and microbatch, in ms"
    )
    p.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES))
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5, help="timed steps per configuration (median reported)")
    p.add_argument(
        "--comm", choices=["measure", "zero"], default="measure", help="comm cost fed to the simulator"
    )
    p.add_argument("--hidden", type=int, default=16)
    p.add_argument("--microbatch-size", type=int, default=2)
    p.add_argument(
        "--timeout", type=float, default=120.0, help="seconds for gloo ops and for any one configuration"
    )
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


# --------------------------------------------------------------------------------------------------------
# Worker side


def _worker(rank: int, world: int, configs: list[Config], args: argparse.Namespace) -> None:
    """One rank (run by `pp_offload.local_ranks.run_on_ranks`, in a gloo group): every configuration in turn;
    rank 0 sends each one's record to the parent as it finishes."""
    import torch.distributed as dist

    from pp_offload.local_ranks import send

    shape = (args.microbatch_size, args.hidden)
    comm_s = 0.0
    if args.comm == "measure" and world > 1:
        from pp_offload.emulate import measure_p2p_latency

        comm_s = measure_p2p_latency(shape=shape)
    if rank == 0:
        send("ready")  # the first configuration's time starts now
    for config in configs:
        record = _run_config(rank, world, config, args, comm_s)
        if rank == 0:
            send("result", record)
    dist.barrier()


def _run_config(
    rank: int, world: int, config: Config, args: argparse.Namespace, comm_s: float
) -> dict[str, Any]:
    import importlib

    import torch
    import torch.distributed as dist

    from pp_offload.emulate import PassCosts, build_stages, time_schedule
    from pp_offload.order import Costs
    from pp_offload.sim import as_executed_by_torch, simulate

    wall_start = time.perf_counter()
    module, placement, extra = SCHEDULES[config.schedule]
    cls = getattr(importlib.import_module(module), config.schedule)
    f_ms, i_ms, w_ms = config.pass_ms(args.chunk_ms)
    costs = PassCosts(F=f_ms / 1e3, I=i_ms / 1e3, W=w_ms / 1e3)
    stages = build_stages(
        rank,
        world,
        costs=costs,
        hidden=args.hidden,
        microbatch_size=args.microbatch_size,
        placement=placement,
    )
    kwargs = dict(extra)
    if config.schedule in OURS:
        kwargs["costs"] = Costs(F=f_ms, I=i_ms, W=w_ms, comm=comm_s * 1e3)
    stage_arg = stages[0] if placement == "single" else stages
    schedule = cls(stage_arg, config.microbatches, loss_fn=torch.nn.functional.mse_loss, **kwargs)

    batch = config.microbatches * args.microbatch_size

    def make_inputs() -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(1234)
        return torch.randn(batch, args.hidden, generator=gen), torch.randn(batch, args.hidden, generator=gen)

    setup_s = time.perf_counter() - wall_start
    timing = time_schedule(schedule, stages, make_inputs=make_inputs, warmup=args.warmup, steps=args.steps)
    dist.barrier()
    run_s = time.perf_counter() - wall_start - setup_s
    if rank != 0:
        return {}

    order = _executed_order(schedule)
    sim_costs = Costs(F=f_ms, I=i_ms, W=w_ms, comm=comm_s * 1e3)
    predicted = simulate(order, sim_costs)
    predicted_torch0 = simulate(as_executed_by_torch(order), sim_costs)
    predicted_nocomm = simulate(order, Costs(F=f_ms, I=i_ms, W=w_ms))
    realized_ms = timing.makespan * 1e3
    return {
        "schedule": config.schedule,
        "ours": config.schedule in OURS,
        "ranks": world,
        "microbatches": config.microbatches,
        "ratio": config.ratio,
        "pass_ms": {"F": f_ms, "I": i_ms, "W": w_ms},
        "comm_ms": comm_s * 1e3,
        "predicted_ms": predicted.makespan,
        "predicted_torch_stage0_ms": predicted_torch0.makespan,
        "predicted_no_comm_ms": predicted_nocomm.makespan,
        "predicted_bubble": predicted.bubble,
        "predicted_peak_memory": max(predicted.peak_memory.values()),
        "realized_ms": realized_ms,
        "realized_steps_ms": [t * 1e3 for t in timing.makespans],
        "ratio_realized_predicted": realized_ms / predicted.makespan,
        "ratio_realized_predicted_torch_stage0": realized_ms / predicted_torch0.makespan,
        "realized_bubble": timing.bubble,
        "realized_action_bubble": timing.action_bubble,
        "loss": statistics.median(timing.losses),
        "setup_s": setup_s,
        "run_s": run_s,
    }


def _executed_order(schedule: Any) -> dict[int, list[Any]]:
    """The compute order the schedule really runs, from ``schedule.pipeline_order``.

    Multi-stage schedules execute their ``pipeline_order``. Single-stage ones (``Schedule1F1B``) run their
    own loop, F and B of microbatches 0, 1, 2, ... in turn, and only *describe* it with
    ``pipeline_order``, which in torch 2.13 numbers the microbatches of ranks >= 1 from 1 (``1F1, 1B0, ...,
    1F{m}``): the sequence of kinds is right, the numbering is not. Renumber each kind in order of
    appearance, which is what the loop does (a no-op on a correct order).
    """
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    order = schedule.pipeline_order
    if not isinstance(schedule, PipelineScheduleSingle):
        return order
    fixed: dict[int, list[Any]] = {}
    for rank, actions in order.items():
        seen: dict[Any, int] = {}
        fixed[rank] = []
        for a in actions:
            if a is None or a.microbatch_index is None:
                fixed[rank].append(a)
                continue
            fixed[rank].append(a._replace(microbatch_index=seen.get(a.computation_type, 0)))
            seen[a.computation_type] = seen.get(a.computation_type, 0) + 1
    return fixed


# --------------------------------------------------------------------------------------------------------
# Driver side


def _run_group(world: int, configs: list[Config], args: argparse.Namespace, on_result: Any) -> None:
    """Run ``world`` ranks that run ``configs`` in order; a failing rank stops all with its traceback
    (`pp_offload.local_ranks.RankError`), and so does any configuration, or the start, that takes longer than
    ``--timeout`` (`pp_offload.local_ranks.RankTimeout`, with every rank's stack)."""
    from pp_offload.local_ranks import run_on_ranks

    def on_message(rank: int, kind: str, record: Any) -> None:
        if kind == "result":
            on_result(record)

    run_on_ranks(
        _worker,
        world,
        configs,
        args,
        timeout=(len(configs) + 2) * args.timeout,  # a backstop: idle_timeout catches a stuck one first
        idle_timeout=args.timeout,
        op_timeout=args.timeout,
        on_message=on_message,
    )


def _configs(args: argparse.Namespace) -> list[Config]:
    return [
        Config(schedule, d, factor * d, ratio)
        for d in args.ranks
        for factor in args.mb_factors
        for ratio in args.costs
        for schedule in args.schedules
    ]


def _table(records: list[dict[str, Any]]) -> str:
    head = (
        f"{'schedule':<24}{'d':>3}{'m':>4}  {'F:I:W':<7}{'pred ms':>9}{'pred* ms':>10}{'real ms':>9}"
        f"{'real/pred':>10}{'real/pred*':>11}{'bubble sim':>11}{'real':>7}{'actions':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in records:
        act = r["realized_action_bubble"]
        lines.append(
            f"{r['schedule']:<24}{r['ranks']:>3}{r['microbatches']:>4}  {r['ratio']:<7}"
            f"{r['predicted_ms']:>9.1f}{r['predicted_torch_stage0_ms']:>10.1f}{r['realized_ms']:>9.1f}"
            f"{r['ratio_realized_predicted']:>10.3f}{r['ratio_realized_predicted_torch_stage0']:>11.3f}"
            f"{r['predicted_bubble']:>11.3f}{r['realized_bubble']:>7.3f}"
            f"{'-' if act is None else format(act, '.3f'):>8}"
        )
    return "\n".join(lines)


def _check_losses(records: list[dict[str, Any]]) -> list[str]:
    """All schedules compute the same function on the same batch: their losses must agree."""
    problems = []
    groups: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["ranks"], r["microbatches"]), []).append(r)
    for (d, m), rs in groups.items():
        ref = rs[0]["loss"]
        for r in rs:
            if abs(r["loss"] - ref) > 1e-4 * max(1.0, abs(ref)):
                problems.append(
                    f"d={d} m={m}: {r['schedule']} loss {r['loss']:.6f} != {rs[0]['schedule']} {ref:.6f}"
                )
    return problems


def _plot(records: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["schedule"] for r in records))
    colours = {n: plt.cm.tab10(i % 10) for i, n in enumerate(names)}
    markers = {2: "o", 4: "s", 8: "^"}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 6))
    for r in records:
        ax1.scatter(
            r["predicted_torch_stage0_ms"],
            r["realized_ms"],
            color=colours[r["schedule"]],
            marker=markers.get(r["ranks"], "D"),
            edgecolors="black" if r["ours"] else "none",
            s=40,
        )
    hi = max(max(r["realized_ms"], r["predicted_torch_stage0_ms"]) for r in records) * 1.05
    ax1.plot([0, hi], [0, hi], color="grey", linestyle="--", linewidth=1, label="realized = predicted")
    for n in names:
        ax1.scatter([], [], color=colours[n], label=n)
    for d, mk in markers.items():
        if any(r["ranks"] == d for r in records):
            ax1.scatter([], [], color="white", edgecolors="black", marker=mk, label=f"d={d}")
    ax1.set_xlabel("predicted step time, ms (simulator, torch's stage-0 backward)")
    ax1.set_ylabel("realized step time, ms (median)")
    ax1.set_title("Realized vs predicted (black edge: pp_offload schedules)")
    ax1.legend(fontsize=7)

    for i, n in enumerate(names):
        ratios = [r["ratio_realized_predicted_torch_stage0"] for r in records if r["schedule"] == n]
        ax2.bar(i, statistics.mean(ratios), color=colours[n], alpha=0.7)
        ax2.scatter([i] * len(ratios), ratios, color="black", s=10, zorder=3)
    ax2.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    lowest = min(r["ratio_realized_predicted_torch_stage0"] for r in records)
    ax2.set_ylim(bottom=min(0.9, lowest - 0.05))
    ax2.set_xticks(range(len(names)))
    ax2.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    ax2.set_ylabel("realized / predicted (mean; dots: each d, m, costs)")
    ax2.set_title("Runtime overhead over the simulator")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    configs = _configs(args)
    records: list[dict[str, Any]] = []
    from tqdm import tqdm

    bar = tqdm(total=len(configs), desc="configs", unit="cfg", disable=args.no_progress, file=sys.stderr)

    def on_result(record: dict[str, Any]) -> None:
        records.append(record)
        bar.set_postfix_str(
            f"{record['schedule']} d={record['ranks']} m={record['microbatches']} {record['ratio']}"
        )
        bar.update(1)

    start = time.monotonic()
    load_start = os.getloadavg()
    try:
        for d in args.ranks:
            _run_group(d, [c for c in configs if c.ranks == d], args, on_result)
    except Exception:
        bar.close()
        traceback.print_exc()
        return 1
    bar.close()

    print(_table(records))
    print(
        "pred: simulator on the schedule's pipeline_order; pred*: the same with torch's stage-0 backward "
        "(I skipped, B at W); bubble real: 1 - busiest rank's emulated compute / realized step; actions: "
        "the same from recorded compute actions (torch's overhead inside actions counted as compute)."
    )
    problems = _check_losses(records)
    for p in problems:
        print("LOSS MISMATCH:", p)

    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "chunk_ms": args.chunk_ms,
        "warmup": args.warmup,
        "steps": args.steps,
        "comm": args.comm,
        "hidden": args.hidden,
        "microbatch_size": args.microbatch_size,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "torch": __import__("torch").__version__,
        "wall_s": time.monotonic() - start,
        # other processes on the box delay wake-ups and the runtime's own Python work: judge noise by these
        "loadavg_1_5_15_start": load_start,
        "loadavg_1_5_15_end": os.getloadavg(),
        "losses_agree": not problems,
    }
    (args.out / "realized.json").write_text(json.dumps({"meta": meta, "results": records}, indent=1))
    _plot(records, args.out / "realized.png")
    print(f"wrote {args.out / 'realized.json'} and {args.out / 'realized.png'} ({meta['wall_s']:.0f} s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
