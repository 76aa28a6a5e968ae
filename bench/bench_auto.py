"""``schedule: auto`` against every fixed choice, on real gloo pipelines of sleep-emulated stages.

For each pipeline size d (2, 4 ranks; m = 2d microbatches) and F:I:W ratio (1:1:1, 3:4:2), one launch of d
processes does, side by side:

1. probe: `pp_offload.plan.auto.PROBE_SCHEDULE` with `PROBE_OFFLOAD`, one warm-up step, then
   `measure_step` (2 steps): per-stage F/I/W, saved bytes, copy times, p2p;
2. decide: `choose` for each budget: none; ``memory_limit=0.5`` (half of 1F1B's); ``tight`` (V-Min's
   predicted peak without offload, as ``activation_budget_bytes``); ``offload-only`` (one byte below
   that, where only offload can fit);
3. run: every fixed candidate (each default schedule x offload policy, built with the measured costs;
   ScheduleVAdaptive at every memory limit some decision considered) and each decision rebuilt from its
   JSON dict (as the recipe does); all are built first, then run round-robin, one step each per round
   (``--warmup`` + ``--steps`` rounds), so load from other processes on the machine spreads over all runs;
   the median step time (barrier, then the latest end minus the earliest start over ranks).

Realized peak: the per-rank device-resident saved-activation peak derived from the executed action trace
(`pp_offload.runtime.timing.ActionTimer`) of every timed step, with each stage's bytes per microbatch as
the probe's activation store captured them: a chunk's bytes are added at the start of its F, removed at
the end of its OFFLOAD, added back at the start of its RELOAD and removed at the end of its last backward
pass (W, or B). It is the memory the schedule really held given the order and timing it executed, under
the same byte accounting as the prediction (it does not sample an allocator: on CPU there is none to ask).

Stages: `pp_offload.emulate.EmulatedStage` (sleeps F/I/W; hidden 32 so its weight stays below the store's
size floor) followed by a pad that makes autograd save ``--pad-mib`` MiB of fresh floats per microbatch,
like a layer's activations; so chunk bytes are meaningful and copies move real memory. On CPU the store's
copies are synchronous memcpy on the compute thread (not overlapped): the measured copy times are what
the decision must, and does, use.

Targets (issue 6): auto never picks a candidate whose realized peak exceeds the stated memory, and auto's
step time is within 5 % of the best fitting fixed candidate's measured step time.

    python bench/bench_auto.py            # d = 2 and 4, both ratios (~8 min on 2 cores)
    python bench/bench_auto.py --quick    # d = 2, ratio 3:4:2, fewer steps (~2 min)

Writes bench/results/auto.json and bench/results/auto.png (or --out DIR).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
HIDDEN = 32
ROWS = 8  # rows per microbatch
TIME_TARGET = 0.05


def _ms(ratio: str, chunk_ms: float) -> tuple[float, float, float]:
    f, i, w = (float(v) for v in ratio.split(":"))
    unit = chunk_ms / (f + i + w)
    return f * unit, i * unit, w * unit


# --- inside a rank ------------------------------------------------------------------------------------


def _stages(rank: int, d: int, placement: str, pass_s: tuple[float, float, float], pad_numel: int) -> list:
    import torch
    from torch import nn
    from torch.distributed.pipelining import PipelineStage

    from pp_offload.emulate import EmulatedStage, PassCosts
    from pp_offload.runtime.catalog import stage_indices

    class SavedPad(nn.Module):
        """Makes autograd save ``numel`` fresh floats per forward (for the scale's grad), like activations."""

        def __init__(self, numel: int) -> None:
            super().__init__()
            self.numel = numel
            self.scale = nn.Parameter(torch.ones(()))

        def forward(self, y: torch.Tensor) -> torch.Tensor:
            return y + (torch.ones(self.numel) * self.scale).sum() * 0.0

    stages = []
    for s in stage_indices(rank, d, placement):
        module = nn.Sequential(
            EmulatedStage(HIDDEN, PassCosts(*pass_s), first=s == 0, seed=s), SavedPad(pad_numel)
        )
        stages.append(
            PipelineStage(
                module,
                s,
                2 * d,
                torch.device("cpu"),
                input_args=torch.zeros(ROWS, HIDDEN, requires_grad=s != 0),
                output_args=torch.zeros(ROWS, HIDDEN, requires_grad=True),
            )
        )
    return stages


def _build(name: str, rank: int, d: int, m: int, offload: str, costs: dict, limit: float | None, cfg: dict):
    import importlib

    import torch

    from pp_offload.runtime.catalog import schedule_info
    from pp_offload.runtime.offload import enable_offload

    info = schedule_info(name)
    stages = _stages(rank, d, info.placement, cfg["pass_s"], cfg["pad_numel"])
    cls = getattr(importlib.import_module(info.module), name)
    kwargs: dict[str, Any] = {"loss_fn": torch.nn.functional.mse_loss, "scale_grads": False}
    off = None if offload == "none" else offload
    if info.module == "pp_offload.runtime.schedules":
        if limit is not None:
            kwargs["memory_limit"] = limit
        schedule = cls(stages, m, costs=costs, offload=off, **kwargs)
    else:
        schedule = cls(stages, m, **kwargs)
        enable_offload(schedule, off, costs=costs)
    return schedule, stages


def _stepper(schedule: Any, stages: list, rank: int, m: int):
    import torch

    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(m * ROWS, HIDDEN, generator=gen), torch.randn(m * ROWS, HIDDEN, generator=gen)
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)

    def step() -> None:
        schedule.step(*((x,) if first else ()), **({"target": y, "losses": []} if last else {}))

    return step


def _realized_peak(events: list[tuple[str, float, float]], saved: list[int]) -> int:
    """One rank's device-resident saved bytes peak from its executed actions (module docstring)."""
    from pp_offload.runtime.timing import parse_action

    deltas: list[tuple[float, int]] = []
    last_backward: dict[tuple[int, int], float] = {}
    for action, start, end in events:
        parsed = parse_action(action)
        if parsed is None or parsed[2] is None:
            continue
        s, kind, j = parsed
        if kind == "F":
            deltas.append((start, saved[s]))
        elif kind == "OFFLOAD":
            deltas.append((end, -saved[s]))
        elif kind == "RELOAD":
            deltas.append((start, saved[s]))
        elif kind in ("I", "W", "B"):
            last_backward[(s, j)] = max(end, last_backward.get((s, j), end))
    deltas += [(t, -saved[s]) for (s, _), t in last_backward.items()]
    deltas.sort(key=lambda e: (e[0], e[1]))  # frees first at equal times
    level = peak = 0
    for _, delta in deltas:
        level += delta
        peak = max(peak, level)
    return peak


def _time_step(schedule: Any, step: Any, saved: list[int]) -> tuple[float, list[int]]:
    """One timed step of every rank: (makespan, each rank's realized peak). Collective."""
    import torch
    import torch.distributed as dist

    from pp_offload.runtime.timing import ActionTimer

    timer = ActionTimer(schedule)
    dist.barrier()
    start = time.perf_counter()
    try:
        step()
    finally:
        end = time.perf_counter()
        timer.detach()
    times = torch.tensor([start, end], dtype=torch.float64)
    gathered = [torch.zeros_like(times) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, times)
    peaks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, _realized_peak([(e.action, e.start, e.end) for e in timer.events], saved))
    return max(g[1].item() for g in gathered) - min(g[0].item() for g in gathered), peaks


def _budgets(meas: Any, m: int) -> list[tuple[str, dict[str, Any]]]:
    from pp_offload.plan.auto import choose

    vmin = choose(meas, num_microbatches=m, schedules=["ScheduleVMin"], offload=["none"])
    tight = max(vmin.peak_bytes)
    return [
        ("none", {}),
        ("0.5 of 1F1B", {"memory_limit": 0.5}),
        ("tight (V-Min)", {"activation_budget_bytes": tight}),
        ("offload-only", {"activation_budget_bytes": tight - 1}),
    ]


def _worker(rank: int, d: int, cfg: dict) -> dict[str, Any]:
    import pp_offload.local_ranks as local_ranks
    from pp_offload.plan.auto import (
        DEFAULT_OFFLOAD,
        DEFAULT_SCHEDULES,
        PROBE_OFFLOAD,
        PROBE_SCHEDULE,
        AutoDecision,
        AutoError,
        choose,
        costs_for,
        measure_step,
    )

    m = cfg["m"]
    probe, stages = _build(PROBE_SCHEDULE, rank, d, m, PROBE_OFFLOAD, None, None, cfg)
    step = _stepper(probe, stages, rank, m)
    step()  # warm-up: host buffer pool, first-step allocations
    meas = measure_step(probe, step, steps=2)
    saved = [st.saved_bytes for st in meas.stages]
    decisions: list[dict[str, Any]] = []
    for label, kwargs in _budgets(meas, m):
        t0 = time.perf_counter()
        try:
            decision = choose(meas, num_microbatches=m, **kwargs)
            decisions.append({"budget": label, "kwargs": kwargs, "decision": decision.to_dict()})
        except AutoError as e:
            decisions.append({"budget": label, "kwargs": kwargs, "error": str(e)})
        decisions[-1]["choose_s"] = time.perf_counter() - t0
    runs = [(s, p, None) for s in DEFAULT_SCHEDULES if s != "ScheduleVAdaptive" for p in DEFAULT_OFFLOAD]
    adaptive = {
        (c["schedule"], c["offload"], c["memory_limit"])
        for dec in decisions
        if "decision" in dec
        for c in dec["decision"]["candidates"]
        if c["schedule"] == "ScheduleVAdaptive" and c["predicted_step_s"] is not None
    }
    runs += sorted(adaptive)
    runs += [("auto", dec["budget"], None) for dec in decisions if "decision" in dec]
    built = []
    for name, policy, limit in runs:
        if name == "auto":
            dec = next(x for x in decisions if x["budget"] == policy)["decision"]
            dec = AutoDecision.from_dict(json.loads(json.dumps(dec)))  # as the recipe receives it
            sched, stg = _build(dec.schedule, rank, d, m, dec.offload, dec.costs, dec.memory_limit, cfg)
        else:
            costs = costs_for(meas, name, num_microbatches=m)
            sched, stg = _build(name, rank, d, m, policy, costs, limit, cfg)
        built.append((sched, _stepper(sched, stg, rank, m)))
    # round-robin: every run takes one step per round, so load from outside the benchmark (other
    # processes on the machine) spreads over all runs instead of hitting whichever ran at that moment
    times: list[list[float]] = [[] for _ in runs]
    peaks: list[list[int]] = [[0] * d for _ in runs]
    rounds = cfg["warmup"] + cfg["steps"]
    for k in range(rounds):
        for i, (sched, step) in enumerate(built):
            makespan, peak = _time_step(sched, step, saved)
            if k >= cfg["warmup"]:
                times[i].append(makespan)
                peaks[i] = [max(a, b) for a, b in zip(peaks[i], peak, strict=True)]
        if rank == 0:
            local_ranks.send("progress", (k + 1, rounds))
    fixed = [
        {
            "schedule": name,
            "offload": policy,
            "memory_limit": limit,
            "step_s": statistics.median(times[i]),
            "steps_s": times[i],
            "peak_bytes": peaks[i],
        }
        for i, (name, policy, limit) in enumerate(runs)
    ]
    return {"measurement": meas.to_dict(), "decisions": decisions, "runs": fixed} if rank == 0 else {}


# --- the parent ---------------------------------------------------------------------------------------


def _predicted(setting: dict[str, Any], name: str, policy: str, limit: float | None) -> dict[str, Any] | None:
    """choose's prediction for a run (any decision that judged it: they share the measurement)."""
    for dec in setting["decisions"]:
        for c in dec.get("decision", {}).get("candidates", ()):
            if c["schedule"] == name and c["offload"] == policy and c["memory_limit"] == limit:
                return c
    return None


def check(setting: dict[str, Any]) -> list[dict[str, Any]]:
    """Per budget: auto's run against every fixed run that fits (realized peak within the budget)."""
    runs = [r for r in setting["runs"] if r["schedule"] != "auto"]
    verdicts = []
    for dec in setting["decisions"]:
        row: dict[str, Any] = {"budget": dec["budget"], "kwargs": dec["kwargs"], "choose_s": dec["choose_s"]}
        if "error" in dec:
            row.update(error=dec["error"])
            verdicts.append(row)
            continue
        d = dec["decision"]
        budget = d["budget_bytes"]
        auto = next(r for r in setting["runs"] if r["schedule"] == "auto" and r["offload"] == dec["budget"])

        def fits(run: dict[str, Any], budget: list[int] | None = budget) -> bool:
            return budget is None or all(p <= b for p, b in zip(run["peak_bytes"], budget, strict=True))

        fitting = [r for r in runs if fits(r)]
        best = min(fitting, key=lambda r: r["step_s"]) if fitting else None
        row.update(
            pick=f"{d['schedule']}" + (f"({d['memory_limit']:.2f})" if d["memory_limit"] is not None else ""),
            offload=d["offload"],
            budget_mib=None if budget is None else max(budget) / 2**20,
            predicted_ms=d["predicted_step_s"] * 1e3,
            predicted_peak_mib=max(d["peak_bytes"]) / 2**20,
            auto_ms=auto["step_s"] * 1e3,
            auto_peak_mib=max(auto["peak_bytes"]) / 2**20,
            memory_ok=fits(auto),
            best=None
            if best is None
            else f"{best['schedule']}"
            + (f"({best['memory_limit']:.2f})" if best["memory_limit"] else "")
            + f" {best['offload']}",
            best_ms=None if best is None else best["step_s"] * 1e3,
            fitting=len(fitting),
        )
        row["time_ok"] = best is None or auto["step_s"] <= best["step_s"] * (1 + TIME_TARGET)
        row["gap"] = None if best is None else auto["step_s"] / best["step_s"] - 1
        verdicts.append(row)
    return verdicts


def print_setting(setting: dict[str, Any]) -> None:
    from pp_offload.plan.auto import Measurement

    print(f"\n=== d={setting['d']} m={setting['m']} F:I:W={setting['ratio']} ===")
    print(Measurement.from_dict(setting["measurement"]).table())
    print(f"\n{'run':34}{'offload':16}{'pred ms':>9}{'real ms':>9}{'pred MiB':>10}{'real MiB':>10}")
    for r in setting["runs"]:
        if r["schedule"] == "auto":
            continue
        name = r["schedule"] + (f"({r['memory_limit']:.2f})" if r["memory_limit"] is not None else "")
        p = _predicted(setting, r["schedule"], r["offload"], r["memory_limit"])
        pred_ms = f"{p['predicted_step_s'] * 1e3:9.1f}" if p and p["predicted_step_s"] else f"{'-':>9}"
        pred_mib = f"{max(p['peak_bytes']) / 2**20:10.2f}" if p and p["peak_bytes"] else f"{'-':>10}"
        print(
            f"{name:34}{r['offload']:16}{pred_ms}{r['step_s'] * 1e3:9.1f}{pred_mib}"
            f"{max(r['peak_bytes']) / 2**20:10.2f}"
        )
    print(
        f"\n{'budget':16}{'MiB':>7}  {'auto pick':28}{'offload':15}{'pred ms':>8}{'auto ms':>8}{'peak':>7}"
        f"  {'best fitting fixed':36}{'ms':>7}{'gap':>7}  mem   time"
    )
    for v in setting["verdicts"]:
        if "error" in v:
            print(f"{v['budget']:16}  AutoError: {v['error'][:150]}...")
            continue
        budget = f"{v['budget_mib']:7.2f}" if v["budget_mib"] is not None else f"{'-':>7}"
        gap = f"{v['gap']:+7.1%}" if v["gap"] is not None else f"{'-':>7}"
        best_ms = f"{v['best_ms']:7.1f}" if v["best_ms"] is not None else f"{'-':>7}"
        print(
            f"{v['budget']:16}{budget}  {v['pick']:28}{v['offload']:15}{v['predicted_ms']:8.1f}"
            f"{v['auto_ms']:8.1f}{v['auto_peak_mib']:7.2f}  {str(v['best']):36}{best_ms}{gap}  "
            f"{'ok' if v['memory_ok'] else 'MISS':5} {'ok' if v['time_ok'] else 'MISS'}"
        )


def plot(settings: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(settings), figsize=(5.2 * len(settings), 4.4), squeeze=False)
    for ax, st in zip(axes[0], settings, strict=True):
        runs = [r for r in st["runs"] if r["schedule"] != "auto"]
        for name in sorted({r["schedule"] for r in runs}):
            pts = [r for r in runs if r["schedule"] == name]
            ax.scatter(
                [max(r["peak_bytes"]) / 2**20 for r in pts],
                [r["step_s"] * 1e3 for r in pts],
                s=18,
                label=name,
            )
        for v in st["verdicts"]:
            if "error" in v:
                continue
            ax.scatter([v["auto_peak_mib"]], [v["auto_ms"]], marker="*", s=160, color="black", zorder=5)
            ax.annotate(
                v["budget"],
                (v["auto_peak_mib"], v["auto_ms"]),
                fontsize=7,
                xytext=(4, 4),
                textcoords="offset points",
            )
            if v["budget_mib"] is not None:
                ax.axvline(v["budget_mib"], color="grey", lw=0.6, ls=":")
        ax.set(
            title=f"d={st['d']} m={st['m']} F:I:W={st['ratio']}",
            xlabel="realized peak saved MiB per rank (max)",
            ylabel="step ms (median)",
        )
    axes[0][0].legend(fontsize=6)
    fig.suptitle("auto (stars, labelled by budget) vs every fixed schedule x offload (dots); dotted: budgets")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="d = 2, ratio 3:4:2, fewer steps")
    parser.add_argument("--ranks", type=int, nargs="+", default=None)
    parser.add_argument("--ratios", nargs="+", default=None)
    parser.add_argument("--chunk-ms", type=float, default=24.0, help="F + I + W of one stage, ms")
    parser.add_argument("--pad-mib", type=float, default=2.0, help="saved MiB per stage and microbatch")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from tqdm import tqdm

    from pp_offload.local_ranks import run_on_ranks

    ranks = args.ranks or ([2] if args.quick else [2, 4])
    ratios = args.ratios or (["3:4:2"] if args.quick else ["1:1:1", "3:4:2"])
    steps = args.steps or (3 if args.quick else 5)
    settings = []
    start = time.perf_counter()
    for d in ranks:
        for ratio in ratios:
            cfg = {
                "m": 2 * d,
                "pass_s": tuple(x / 1e3 for x in _ms(ratio, args.chunk_ms)),
                "pad_numel": int(args.pad_mib * 2**20 / 4),
                "warmup": args.warmup,
                "steps": steps,
            }
            bar = tqdm(desc=f"d={d} {ratio}", unit="round", file=sys.stderr)

            def on_message(rank: int, kind: str, payload: Any, bar: Any = bar) -> None:
                bar.total = payload[1]
                bar.update(payload[0] - bar.n)

            result = run_on_ranks(_worker, d, cfg, timeout=900, idle_timeout=300, on_message=on_message)[0]
            bar.close()
            setting = {"d": d, "m": cfg["m"], "ratio": ratio, "cfg": cfg, **result}
            setting["verdicts"] = check(setting)
            settings.append(setting)
            print_setting(setting)
    verdicts = [v for s in settings for v in s["verdicts"] if "error" not in v]
    memory = all(v["memory_ok"] for v in verdicts)
    timing = all(v["time_ok"] for v in verdicts)
    print(
        f"\ntargets over {len(verdicts)} decisions: auto's realized peak within the budget: "
        f"{'MET' if memory else 'NOT MET'}; auto within {TIME_TARGET:.0%} of the best fitting fixed "
        "candidate: "
        f"{'MET' if timing else 'NOT MET'} (worst gap {max((v['gap'] or 0) for v in verdicts):+.1%}); "
        f"{time.perf_counter() - start:.0f} s"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"python": platform.python_version(), "machine": platform.machine(), "quick": args.quick}
    with open(args.out / "auto.json", "w") as f:
        json.dump({"meta": meta, "settings": settings, "memory_ok": memory, "time_ok": timing}, f, indent=1)
    plot(settings, args.out / "auto.png")
    print(f"wrote {args.out / 'auto.json'} and {args.out / 'auto.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
