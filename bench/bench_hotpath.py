"""The training step's hot path on CPU: what recompute really costs per schedule, against what the planner
predicts, and what a step does (host-synchronizing ops, runs of each checkpointed layer).

Why: the first GPU run measured recompute at 2-3x the planner's price. Two causes reproduced on CPU: a host
synchronization in every stage forward (transformers' packed-sequence check on device position ids) and a
checkpointed layer recomputed once per parameter group in W (11 runs per microbatch for a Llama layer). Both
are fixed (`pp_offload.models.masks`, `pp_offload.runtime.compat.share_weight_pass_recomputation`); this
bench shows the effect with real compute.

Setup: 2 gloo ranks, one thread each, a Llama of 8 layers, hidden 256, intermediate 688, seq 256, fp32,
microbatches of one row whose documents are packed (position ids restart), ``--microbatches`` of them (8).
Every schedule x cell (`MODES`: recompute none, full, selective, mlp with deferred W, the default; the
same under torch's retained-graph split, ``(torch split)``; and decoder layers compiled in place,
``(compiled)``) is built fresh and timed side by side: per schedule, one warm-up round (compiling
included), then 5 (``--quick``: 3) rounds of one step of each cell in turn (so a change in the machine's
load hits every cell of a schedule alike, not the cells timed last), each the slowest rank's time; the
fastest is reported (on a shared machine the fastest step is the one least disturbed by other work), and
the ratio to the same schedule without recompute (deferred W, eager). Each step is also timed in CPU time
(``time.process_time`` of each rank, the slowest rank's), which other processes on the machine inflate far
less than the wall clock (it leaves out the pipeline's waits). A second table sets the cells side by side
per schedule and recompute plan: deferred W over torch's split, compiled over eager, wall and CPU time.

Counted on one more step of each cell (not timed): host-synchronizing ops in ``schedule.step``
(`pp_offload.runtime.step_counts.SyncCounter`) and runs of each checkpointed module per microbatch
(forward + recomputations; the rule is `pp_offload.recompute_plan.recomputations`).

Predicted: the ``schedule: auto`` planner on a probe of this very model (`pp_offload.plan.auto.measure_step`
without recompute, timing besides one of its decoder layers on its real microbatch plain and under each
recompute mode: `pp_offload.plan.recompute_calibration`; then `RecomputeOption.apply` charges each
recomputed layer the measured extra forward, and each I, W or full backward pass the measured cost of one
recomputation, as many times as `pp_offload.recompute_plan.recomputations` counts). This is what the recipe
does. Its predicted step of each schedule and mode, over the same schedule without recompute, is the
predicted ratio (``probe x``). ``H100 x``: the same probe priced by the planner's HBM-traffic model
instead (shares of the probe's per-layer forward on the H100 preset: what ``schedule: auto`` charged
before it measured recompute, and what ``pp-offload plan`` still charges without a probe).

    python bench/bench_hotpath.py            # ~3 min on 2 cores
    python bench/bench_hotpath.py --quick    # 4 layers, seq 128, 3 timed steps

Writes ``hotpath.json`` and ``hotpath.png`` to ``bench/results`` (or ``--out DIR``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from small_llama import llama_config

RESULTS = Path(__file__).resolve().parent / "results"
SCHEDULES = ("ScheduleVHalf", "ScheduleVZB", "ScheduleZBVZeroBubble", "ScheduleInterleaved1F1B")
MODES = (
    "none",
    "full",
    "selective",
    "mlp",
    "none (torch split)",
    "full (torch split)",
    "selective (torch split)",
    "none (compiled)",
    "full (compiled)",
)
"""Recompute mode per cell; ``(torch split)``: torch's retained-graph I/W split instead of deferred W (the
default: `pp_offload.runtime.deferred_w`); ``(compiled)``: each decoder layer compiled in place (inductor,
`pp_offload.runtime.compile.compile_layers`), deferred W."""


def _config(quick: bool) -> dict[str, Any]:
    return {
        "layers": 4 if quick else 8,
        "hidden": 256,
        "intermediate": 688,
        "heads": 4,
        "vocab": 1024,
        "seq": 128 if quick else 256,
        "steps": 3 if quick else 5,
    }


def _model(cfg: dict[str, Any]) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(llama_config(cfg), dtype=torch.float32).train()


def _batch(cfg: dict[str, Any], m: int) -> dict[str, Any]:
    import torch

    from pp_offload.models.masks import packed_rows

    gen = torch.Generator().manual_seed(1)
    seq = cfg["seq"]
    ids = torch.randint(0, cfg["vocab"], (m, seq + 1), generator=gen)
    positions = torch.empty(m, seq, dtype=torch.int64)
    for r in range(m):
        pos: list[int] = []
        while len(pos) < seq:
            pos.extend(range(int(torch.randint(seq // 4, seq, (1,), generator=gen))))
        positions[r] = torch.tensor(pos[:seq])
    return {
        "input_ids": ids[:, :-1].contiguous(),
        "labels": ids[:, 1:].contiguous(),
        "position_ids": positions,
        "packed_rows": packed_rows(positions),
    }


def _pipeline(
    name: str,
    rank: int,
    cfg: dict[str, Any],
    m: int,
    recompute: str | None,
    offload: Any = None,
    *,
    variant: str = "",
):
    import torch
    from torch.distributed.pipelining import PipelineStage

    from pp_offload.models import TokenCrossEntropy, split_model
    from pp_offload.parallel import activation_checkpointing
    from pp_offload.runtime.catalog import build_schedule, schedule_info, stage_indices
    from pp_offload.runtime.compile import compile_layers

    info = schedule_info(name)
    ids = stage_indices(rank, 2, info.placement)
    split = split_model(_model(cfg), num_stages=4, stage_indices=ids, verify=False)
    if recompute is not None:
        activation_checkpointing(split, mode=recompute)
    if variant == "compiled":
        compile_layers(split.stages.values())
    stages = [PipelineStage(split.stages[s], s, 4, torch.device("cpu")) for s in ids]
    loss_fn = TokenCrossEntropy()
    loss_fn.num_target_tokens = m * cfg["seq"]
    kwargs: dict[str, Any] = {"loss_fn": loss_fn, "scale_grads": False}
    if offload is not None:
        kwargs["offload"] = offload
    schedule = build_schedule(info, stages, m, deferred_w=variant != "torch split", **kwargs)
    return split, schedule, ids


def _stepper(schedule: Any, ids: list[int], batch: dict[str, Any], split: Any):
    def step() -> None:
        split.module.zero_grad(set_to_none=True)
        args = (batch["input_ids"],) if 0 in ids else ()
        target = {"target": batch["labels"], "losses": []} if 3 in ids else {}
        schedule.step(*args, position_ids=batch["position_ids"], packed_rows=batch["packed_rows"], **target)

    return step


def _slowest(*seconds: float) -> list[float]:
    """Each of ``seconds`` as the slowest rank's (max over the ranks)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _predict(rank: int, cfg: dict[str, Any], m: int) -> tuple[dict[str, dict[tuple[str, str], float]], Any]:
    """The planner's predicted step (s) of each schedule and recompute mode, from a probe of this model
    that also measures recompute (``probe``, what ``schedule: auto`` does), and from the same probe priced
    by the traffic model's H100 shares (``H100``); and the probe's recompute calibration."""
    from dataclasses import replace

    from pp_offload.plan.auto import PROBE_OFFLOAD, PROBE_SCHEDULE, choose, measure_step, recompute_options
    from pp_offload.plan.recompute_calibration import CALIBRATED_MODES

    modes = tuple(mode for mode in MODES if mode != "none" and " " not in mode)
    batch = _batch(cfg, m)
    split, probe, ids = _pipeline(PROBE_SCHEDULE, rank, cfg, m, None, offload=PROBE_OFFLOAD)
    step = _stepper(probe, ids, batch, split)
    measured = measure_step(probe, step, steps=2, recompute_modes=CALIBRATED_MODES)
    options = recompute_options(
        llama_config(cfg), seq_len=cfg["seq"], microbatch_size=1, machine="H100", dtype="fp32", modes=modes
    )
    out = {}
    for key, meas in (("probe", measured), ("H100", replace(measured, recompute_costs=None))):
        decision = choose(
            meas, num_microbatches=m, schedules=list(SCHEDULES), offload=["none"], recompute=options
        )
        out[key] = {(c.schedule, c.recompute): c.predicted_step_s for c in decision.candidates}
    return out, measured


def _worker(rank: int, world_size: int, cfg: dict[str, Any], m: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from pp_offload.runtime.step_counts import SyncCounter, count_layer_runs

    torch.set_num_threads(1)
    predicted, probe = _predict(rank, cfg, m)
    batch = _batch(cfg, m)
    rows = []
    for name in SCHEDULES:
        cells = {}
        for mode in MODES:
            plan, _, variant = mode.partition(" ")
            recompute = None if plan == "none" else plan
            split, schedule, ids = _pipeline(name, rank, cfg, m, recompute, variant=variant.strip("()"))
            cells[mode] = (split, _stepper(schedule, ids, batch, split))
        times: dict[str, list[float]] = {mode: [] for mode in MODES}
        cpu: dict[str, list[float]] = {mode: [] for mode in MODES}
        for timed in range(cfg["steps"] + 1):  # the first round warms up (buffers, compiling, first step)
            for mode in MODES:  # modes alternate: drift hits each alike
                dist.barrier()
                began, began_cpu = time.perf_counter(), time.process_time()
                cells[mode][1]()
                seconds, cpu_seconds = _slowest(time.perf_counter() - began, time.process_time() - began_cpu)
                if timed:
                    times[mode].append(seconds)
                    cpu[mode].append(cpu_seconds)
        for mode in MODES:
            split, step = cells[mode]
            runs = count_layer_runs(split.stages.values())
            with SyncCounter() as syncs:
                step()
            per_layer = max(runs.values()) / m if runs else 0.0
            total_syncs = torch.tensor([syncs.total], dtype=torch.int64)
            dist.all_reduce(total_syncs, op=dist.ReduceOp.MAX)
            worst_runs = torch.tensor([per_layer], dtype=torch.float64)
            dist.all_reduce(worst_runs, op=dist.ReduceOp.MAX)
            rows.append(
                {
                    "schedule": name,
                    "mode": mode,
                    "step_s": min(times[mode]),
                    "cpu_s": min(cpu[mode]),
                    "syncs_per_rank": int(total_syncs),
                    "runs_per_microbatch": float(worst_runs),
                    **{
                        f"predicted_step_s_{key}": found.get(
                            (name, "none" if mode == "none" else mode.split()[0])
                        )
                        for key, found in predicted.items()
                    },
                }
            )
    calibration = probe.recompute_costs
    return {
        "rows": rows,
        "probe": probe.table(),
        "recompute_costs": calibration.to_dict() if calibration is not None else None,
    }


def _table(rows: list[dict[str, Any]]) -> str:
    """Measured and predicted ratios to the same schedule without recompute; ``off``: predicted/measured."""
    base = {r["schedule"]: r for r in rows if r["mode"] == "none"}
    lines = [
        f"{'schedule':24} {'recompute':24} {'step s':>7} {'x none':>7} {'probe x':>7} {'off':>5} "
        f"{'H100 x':>6} {'off':>5} {'runs/mb':>7} {'syncs':>5}",
    ]
    for r in rows:
        b = base[r["schedule"]]
        r["ratio"] = r["step_s"] / b["step_s"]
        cells = []
        for key in ("probe", "H100"):
            p, q = r.get(f"predicted_step_s_{key}"), b.get(f"predicted_step_s_{key}")
            pred = p / q if p and q and " (" not in r["mode"] else None
            r[f"predicted_ratio_{key}"] = pred
            width = 7 if key == "probe" else 6
            cells.append(
                f"{pred:{width}.2f} {(pred / r['ratio'] - 1) * 100:+4.0f}%"
                if pred
                else f"{'-':>{width}} {'-':>5}"
            )
        lines.append(
            f"{r['schedule']:24} {r['mode']:24} {r['step_s']:7.3f} {r['ratio']:7.2f} {cells[0]} {cells[1]} "
            f"{r['runs_per_microbatch']:7.1f} {r['syncs_per_rank']:5d}"
        )
    return "\n".join(lines)


def _side_by_side(rows: list[dict[str, Any]]) -> str:
    """Per schedule and recompute plan: deferred W against torch's retained-graph split, and compiled
    layers against eager (both deferred W), as ratios of the slowest rank's step; ``x none``: deferred W,
    eager, over the same without recompute (the issue's recompute targets). Each ratio twice: wall clock,
    and the ranks' CPU time (``cpu``), which leaves out the time other processes held a rank's core, the
    figure to trust on a loaded machine (it misses the pipeline's waits). Stored in the rows too."""
    cell = {(r["schedule"], r["mode"]): r for r in rows}
    lines = [
        f"{'schedule':24} {'recompute':10} {'step s':>7} {'x none':>6} {'cpu':>5} {'torch split s':>13} "
        f"{'deferred/torch':>14} {'cpu':>5} {'compiled s':>10} {'compiled/eager':>14} {'cpu':>5}"
    ]

    def ratio(a: dict[str, Any], b: dict[str, Any], width: int) -> str:
        return f"{a['step_s'] / b['step_s']:{width}.2f} {a['cpu_s'] / b['cpu_s']:5.2f}"

    for schedule in SCHEDULES:
        base = cell[(schedule, "none")]
        for plan in (m for m in MODES if " " not in m):
            r = cell[(schedule, plan)]
            text = f"{schedule:24} {plan:10} {r['step_s']:7.3f} {ratio(r, base, 6)}"
            for variant, width in (("torch split", 13), ("compiled", 10)):
                other = cell.get((schedule, f"{plan} ({variant})"))
                if other is None:
                    text += f" {'-':>{width}} {'-':>14} {'-':>5}"
                    continue
                # deferred W over torch's split; compiled over eager
                num, den = (r, other) if variant == "torch split" else (other, r)
                r[f"over_{variant.replace(' ', '_')}"] = num["step_s"] / den["step_s"]
                r[f"over_{variant.replace(' ', '_')}_cpu"] = num["cpu_s"] / den["cpu_s"]
                text += f" {other['step_s']:{width}.3f} {ratio(num, den, 14)}"
            lines.append(text)
    return "\n".join(lines)


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in MODES if m != "none"]
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        xs = [j + i * width for j in range(len(SCHEDULES))]
        measured = [
            next(r["ratio"] for r in rows if r["schedule"] == s and r["mode"] == mode) for s in SCHEDULES
        ]
        ax.bar(xs, measured, width, label=f"{mode} (measured)")
        predicted = [
            next(r["predicted_ratio_probe"] for r in rows if r["schedule"] == s and r["mode"] == mode)
            for s in SCHEDULES
        ]
        ax.scatter(
            [x for x, p in zip(xs, predicted, strict=True) if p],
            [p for p in predicted if p],
            color="black",
            marker="_",
            s=200,
            zorder=3,
        )
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(SCHEDULES))], SCHEDULES, fontsize=8)
    ax.set_ylabel("step time / deferred W without recompute")
    ax.set_title(
        "Recompute cost on CPU (2 gloo ranks); black ticks: planner (recompute measured by the probe)"
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 layers, seq 128, 3 timed steps")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.microbatches < 2:
        parser.error(f"--microbatches must be >= 2 (2 pipeline ranks), got {args.microbatches}")
    import torch

    from pp_offload.local_ranks import run_on_ranks

    cfg = _config(args.quick)
    began, load_before = time.perf_counter(), os.getloadavg()
    results = run_on_ranks(_worker, 2, cfg, args.microbatches, timeout=1800, op_timeout=600)
    rows = results[0]["rows"]
    table = _table(rows)
    print(results[0]["probe"])
    print(table)
    print()
    print(_side_by_side(rows))
    args.out.mkdir(parents=True, exist_ok=True)
    name = "hotpath_quick" if args.quick else "hotpath"
    meta = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "config": cfg,
        "microbatches": args.microbatches,
        "seconds": round(time.perf_counter() - began, 1),
        "load_average": {"before": load_before, "after": os.getloadavg()},  # 1, 5, 15 min; 2 cores here
        "recompute_costs": results[0]["recompute_costs"],
    }
    (args.out / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    _plot(rows, args.out / f"{name}.png")
    print(f"wrote {args.out / (name + '.json')} and {name}.png")


if __name__ == "__main__":
    main()
