"""Simulated activation offload (PipeOffload) on V-shape orders and torch's Interleaved1F1B.

Every order is planned by `pp_offload.order.offload.plan_offload` and replayed by `pp_offload.sim.simulate`
with copy lanes. Memory is the *device-resident* activation memory in chunk units (one V stage of one
microbatch); time in units of one chunk's F. Costs: F = I = W = 1, ``transfer`` = one chunk's one-way copy.

Three parts:

(a) full offload, transfer = 0.5 F, every d in 4..32 (``--quick``: 4, 8, 16): V-Half (``v_half_order``,
    m = 2d, and 4d for d in {4, 8, 16}), the paper's uncompacted V-Half building block (m = 2d, 4d) and
    torch's Interleaved1F1B (m = 2d, 4d). Targets: per-rank device peak <= 4 chunk units, makespan
    <= +2 % vs the same order without offload.
(b) selective offload: peak and makespan as the offloaded share of each rank's chunks goes 0, 1/8, ..., 1
    for V-Min, V-Half, V-ZB, Interleaved1F1B at (d=8, m=32) and (d=16, m=64; not with ``--quick``), with
    the default choice rule (lower the peak first) and the papers' plain longest-lifespan rule. Target:
    half the chunks cut the peak by more than half (better than linear) on at least one schedule.
(c) limits, d=8, m=32: transfer in {0.5, 1, 1.5, 3} x F with duplex and shared copy lanes, for full, half
    and auto. The paper's k = (D2H + H2D) / (F + I + W) = 2 * transfer / 3 here: transfer 1.5 is k = 1,
    3 is k = 2 (the issue's "transfer = 0.5 F, k about 1" counts differently; both are printed).

    python bench/bench_offload.py            # everything (~5 min on 2 cores: V-Half orders up to d=32)
    python bench/bench_offload.py --quick    # a smoke test (~45 s)
    python bench/bench_offload.py --from-json bench/results/offload.json   # re-print and redraw a run

Writes ``offload.json`` (every number) and ``offload.png`` (memory/time vs offloaded share; a rank's memory
over time with and without offload; full-offload peak vs d) to ``bench/results`` (or ``--out DIR``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tqdm import tqdm

RESULTS = Path(__file__).resolve().parent / "results"
TRANSFER = 0.5
FRACTIONS = tuple(i / 8 for i in range(9))
CURVE_SCHEDULES = ("V-Min", "V-Half", "V-ZB", "Interleaved1F1B")
LIMIT_SCHEDULES = ("V-Half", "Interleaved1F1B")
LIMIT_TRANSFERS = (0.5, 1.0, 1.5, 3.0)
LIMIT_POLICIES = ("full", "selective:0.5", "auto")
PEAK_TARGET = 4.0
MAKESPAN_TARGET = 0.02
MEMORY_PLOT = ("Interleaved1F1B", 8, 32, 0)  # schedule, d, m, rank whose memory over time is drawn


# --- one order (runs in a worker process) -------------------------------------------------------------


def _order(schedule: str, d: int, m: int):
    from pp_offload.order import v_half_order, v_min_order, v_zb_order
    from pp_offload.order.blocks import v_block
    from pp_offload.runtime import compat

    if schedule == "V-Min":
        return v_min_order(d, m)
    if schedule == "V-Half":
        return v_half_order(d, m)
    if schedule == "V-ZB":
        return v_zb_order(d, m)
    if schedule == "V-Half block":
        # the paper's V-Half building block (offsets 2/1, x = 3 for even d) repeated, not compacted
        x = 3 if d % 2 == 0 else 0
        return v_block(d, down=[2] * (d - 1), backward_delay=1 + x, turn_f=1, turn_b=2).repeat(m)
    return dict(enumerate(compat.schedule_ops(schedule, d, m, 2)))


def _measure(order, costs, policy, base) -> dict[str, Any]:
    from pp_offload.order.offload import plan_offload

    start = time.perf_counter()
    plan = plan_offload(order, costs, policy)
    sim = plan.sim
    return {
        "peak": sim.peak,
        "peak_per_rank": [sim.peak_memory[r] for r in sorted(sim.peak_memory)],
        "makespan": sim.makespan,
        "overhead": sim.makespan / base.makespan - 1.0,
        "reload_wait": sim.total_reload_wait,
        "offloaded": sum(len(c) for c in plan.offloaded.values()),
        "chunks": sum(1 for acts in plan.order.values() for a in acts if a.computation_type == "F"),
        "fraction": plan.policy.fraction,
        "k": plan.policy.k,
        "plan_seconds": time.perf_counter() - start,
        "_plan": plan,
    }


def _public(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if not k.startswith("_")}


def run_config(schedule: str, d: int, m: int, parts: tuple[str, ...]) -> dict[str, Any]:
    """Every part that needs this (schedule, d, m): one order generation, many plans."""
    from pp_offload.order import Costs
    from pp_offload.order.offload import OffloadPolicy
    from pp_offload.sim import simulate

    out: dict[str, Any] = {"schedule": schedule, "d": d, "m": m, "parts": list(parts)}
    start = time.perf_counter()
    try:
        order = _order(schedule, d, m)
    except Exception as e:  # reported in the tables; one generator failing must not stop the bench
        out["error"] = f"{type(e).__name__}: {e}"
        return out
    out["gen_seconds"] = time.perf_counter() - start
    costs = Costs(transfer=TRANSFER)
    base = simulate(order, costs)
    out["base"] = {
        "peak": base.peak,
        "peak_per_rank": [base.peak_memory[r] for r in sorted(base.peak_memory)],
        "makespan": base.makespan,
        "bubble": base.bubble,
    }
    if "full" in parts:
        full = _measure(order, costs, "full", base)
        jit = _measure(order, costs, {"mode": "full", "reload_margin": 0.0}, base)
        out["full"] = _public(full)
        out["full_margin0"] = _public(jit)
        if (schedule, d, m) == MEMORY_PLOT[:3]:
            rank = MEMORY_PLOT[3]
            half = _measure(order, costs, "selective:0.5", base)
            out["memory_curves"] = {
                "rank": rank,
                "none": base.memory_curve[rank],
                "full": full["_plan"].sim.memory_curve[rank],
                "half": half["_plan"].sim.memory_curve[rank],
            }
    if "curve" in parts:
        out["curve"] = {
            choose: [
                {
                    "share": f,
                    **_public(
                        _measure(order, costs, OffloadPolicy("selective", fraction=f, choose=choose), base)
                    ),
                }
                for f in FRACTIONS
            ]
            for choose in ("peak", "lifespan")
        }
    if "limits" in parts:
        rows = []
        for transfer in LIMIT_TRANSFERS:
            c = Costs(transfer=transfer)
            b = simulate(order, c)
            for lanes in ("duplex", "shared"):
                for policy in LIMIT_POLICIES:
                    mode, _, frac = policy.partition(":")
                    spec = {"mode": mode, "lanes": lanes, **({"fraction": float(frac)} if frac else {})}
                    row = _public(_measure(order, c, spec, b))
                    rows.append({"transfer": transfer, "lanes": lanes, "policy": policy, **row})
        out["limits"] = rows
    return out


# --- tables --------------------------------------------------------------------------------------------


def _pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def print_full(rows: list[dict[str, Any]]) -> dict[str, Any]:
    print(
        "\n(a) full offload, unit costs, transfer = 0.5 F, duplex lanes: device-resident peak per rank "
        "(chunk units, max over ranks) and makespan vs the same order without offload"
    )
    head = (
        f"{'schedule':16}{'d':>4}{'m':>5}{'peak none':>11}{'peak full':>11}{'margin 0':>10}"
        f"{'makespan':>10}{'full':>9}{'wait':>7}{'peak<=4':>9}{'time<=2%':>10}"
    )
    print(head)
    print("-" * len(head))
    verdict: dict[str, Any] = {}
    for r in sorted(rows, key=lambda r: (r["schedule"], r["d"], r["m"])):
        if "error" in r:
            print(f"{r['schedule']:16}{r['d']:>4}{r['m']:>5}  error: {r['error']}")
            verdict.setdefault(r["schedule"], {"peak_ok": False, "time_ok": False, "worst_peak": None})
            continue
        f, f0 = r["full"], r["full_margin0"]
        peak_ok = f["peak"] <= PEAK_TARGET + 1e-9
        time_ok = f["overhead"] <= MAKESPAN_TARGET + 1e-12
        v = verdict.setdefault(
            r["schedule"],
            {
                "peak_ok": True,
                "time_ok": True,
                "worst_peak": 0.0,
                "worst_overhead": 0.0,
                "worst_peak_margin0": 0.0,
            },
        )
        v["peak_ok"] &= peak_ok
        v["time_ok"] &= time_ok
        v["worst_peak"] = max(v["worst_peak"], f["peak"])
        v["worst_peak_margin0"] = max(v["worst_peak_margin0"], f0["peak"])
        v["worst_overhead"] = max(v["worst_overhead"], f["overhead"])
        print(
            f"{r['schedule']:16}{r['d']:>4}{r['m']:>5}{r['base']['peak']:>11.0f}{f['peak']:>11.0f}"
            f"{f0['peak']:>10.0f}{r['base']['makespan']:>10.0f}{_pct(f['overhead']):>9}"
            f"{f['reload_wait']:>7.1f}{'ok' if peak_ok else 'MISS':>9}{'ok' if time_ok else 'MISS':>10}"
        )
    print(
        "margin 0: reloads end just in time (reload_margin=0) instead of one backward early (the paper's "
        "rule, the default)"
    )
    for name, v in verdict.items():
        print(
            f"  {name}: peak <= 4 for every d: {'MET' if v['peak_ok'] else 'NOT MET'} (worst "
            f"{v['worst_peak']}, {v.get('worst_peak_margin0')} with margin 0); makespan <= +2%: "
            f"{'MET' if v['time_ok'] else 'NOT MET'} (worst {_pct(v.get('worst_overhead', 0.0))})"
        )
    return verdict


def print_curves(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    print(
        "\n(b) selective offload, transfer = 0.5 F: device peak / makespan change as the offloaded share "
        "of each rank's chunks grows (choose='peak', the default)"
    )
    shares = "".join(f"{f:>9.3g}" for f in FRACTIONS)
    verdicts = []
    for r in sorted(rows, key=lambda r: (r["d"], CURVE_SCHEDULES.index(r["schedule"]))):
        if "error" in r:
            print(f"{r['schedule']} d={r['d']} m={r['m']}: error: {r['error']}")
            continue
        print(
            f"\n{r['schedule']}  d={r['d']} m={r['m']}  (no offload: peak {r['base']['peak']:.0f}, "
            f"makespan {r['base']['makespan']:.0f})"
        )
        print(f"{'share':22}{shares}")
        for choose in ("peak", "lifespan"):
            pts = r["curve"][choose]
            print(f"{'peak (' + choose + ')':22}" + "".join(f"{p['peak']:>9.0f}" for p in pts))
        pts = r["curve"]["peak"]
        print(f"{'makespan (peak)':22}" + "".join(f"{_pct(p['overhead']):>9}" for p in pts))
        base = r["base"]["peak"]
        half = next(p for p in pts if p["share"] == 0.5)["peak"]
        half_l = next(p for p in r["curve"]["lifespan"] if p["share"] == 0.5)["peak"]
        better = half < base / 2 - 1e-9
        verdicts.append(
            {
                "schedule": r["schedule"],
                "d": r["d"],
                "m": r["m"],
                "peak_none": base,
                "peak_half": half,
                "peak_half_lifespan_rule": half_l,
                "cut": 1 - half / base,
                "better_than_linear": better,
            }
        )
        print(
            f"half offloaded: peak {base:.0f} -> {half:.0f} (cut {1 - half / base:.0%}; lifespan rule "
            f"{half_l:.0f}): {'better than linear' if better else 'not better than linear'}"
        )
    any_better = [v for v in verdicts if v["better_than_linear"]]
    print(
        "\n  target 'half the chunks cut the peak by more than half on at least one schedule': "
        + (
            "MET ("
            + ", ".join(
                f"{v['schedule']} d={v['d']}: {v['peak_none']:.0f} -> {v['peak_half']:.0f}"
                for v in any_better
            )
            + ")"
            if any_better
            else "NOT MET"
        )
    )
    return verdicts


def print_limits(rows: list[dict[str, Any]]) -> None:
    print(
        "\n(c) limits, d=8, m=32: slower copies (k = 2 * transfer / 3, the paper's ratio) and one shared "
        "copy lane; peak / makespan change / total reload wait"
    )
    for r in rows:
        if "error" in r:
            print(f"{r['schedule']}: error: {r['error']}")
            continue
        print(f"\n{r['schedule']}  (no offload: peak {r['base']['peak']:.0f})")
        head = f"{'transfer':>9}{'k':>6}{'lanes':>8}" + "".join(f"{p:>30}" for p in LIMIT_POLICIES)
        print(head)
        print("-" * len(head))
        by = {(x["transfer"], x["lanes"], x["policy"]): x for x in r["limits"]}
        for transfer in LIMIT_TRANSFERS:
            for lanes in ("duplex", "shared"):
                cells = []
                for policy in LIMIT_POLICIES:
                    x = by[(transfer, lanes, policy)]
                    extra = f" f={x['fraction']:.2f}" if policy == "auto" else ""
                    cells.append(f"{x['peak']:.0f} {_pct(x['overhead'])} w{x['reload_wait']:.0f}{extra}")
                print(f"{transfer:>9}{2 * transfer / 3:>6.2f}{lanes:>8}" + "".join(f"{c:>30}" for c in cells))


# --- plot ------------------------------------------------------------------------------------------------


def plot(full_rows, curve_rows, limit_rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    ax_peak, ax_time, ax_mem, ax_d = axes[0, 0], axes[0, 1], axes[1, 0], axes[1, 1]
    colors = {name: f"C{i}" for i, name in enumerate(CURVE_SCHEDULES)}
    for r in sorted(curve_rows, key=lambda r: (r["schedule"], r["d"])):
        if "error" in r:
            continue
        pts = r["curve"]["peak"]
        ax_peak.plot(
            [p["share"] for p in pts],
            [p["peak"] / r["base"]["peak"] for p in pts],
            "-o" if r["d"] == 8 else "--s",
            ms=3,
            color=colors[r["schedule"]],
            label=f"{r['schedule']} d={r['d']} m={r['m']}",
        )
    ax_peak.plot([0, 1], [1, 0], ":", color="grey", label="linear")
    ax_peak.set(
        xlabel="offloaded share of each rank's chunks",
        ylabel="device peak / peak without offload",
        title="(b) selective offload, transfer = 0.5 F (makespan +0.0% at every share)",
    )
    ax_peak.legend(fontsize=7)
    for i, r in enumerate(sorted(limit_rows, key=lambda r: r["schedule"])):
        if "error" in r:
            continue
        for policy, marker in zip(LIMIT_POLICIES, "os^", strict=True):
            for lanes, style in (("duplex", "-"), ("shared", "--")):
                pts = [x for x in r["limits"] if x["policy"] == policy and x["lanes"] == lanes]
                ax_time.plot(
                    [2 * x["transfer"] / 3 for x in pts],
                    [100 * x["overhead"] for x in pts],
                    style,
                    marker=marker,
                    ms=4,
                    color=f"C{i}",
                    label=f"{r['schedule']} {policy} {lanes}",
                )
    ax_time.set(
        xlabel="k = (D2H + H2D) / (F + I + W) of one chunk",
        ylabel="makespan change (%)",
        yscale="symlog",
        title="(c) limits, d=8, m=32: slower copies, shared lane",
    )
    ax_time.legend(fontsize=6, ncol=2)
    for r in full_rows:
        curves = r.get("memory_curves")
        if not curves:
            continue
        for key, style in (("none", "-"), ("half", "--"), ("full", "-")):
            xs, ys = [t for t, _ in curves[key]], [v for _, v in curves[key]]
            ax_mem.step(xs, ys, style, where="post", label=f"{key} offload")
        ax_mem.set(
            xlabel="time (F = 1)",
            ylabel="device-resident activations (chunks)",
            title=f"{r['schedule']} d={r['d']} m={r['m']}, rank {curves['rank']}: memory over time",
        )
        ax_mem.legend(fontsize=8)
    groups: dict[tuple[str, int], list] = {}
    for r in full_rows:
        if "full" in r and r["m"] == 2 * r["d"]:
            groups.setdefault((r["schedule"], r["m"] // r["d"]), []).append(r)
    for (name, _), rs in sorted(groups.items()):
        rs.sort(key=lambda r: r["d"])
        ax_d.plot([r["d"] for r in rs], [r["full"]["peak"] for r in rs], "-o", ms=3, label=f"{name} full")
        ax_d.plot([r["d"] for r in rs], [r["base"]["peak"] for r in rs], ":", label=f"{name} none")
    ax_d.axhline(PEAK_TARGET, color="red", lw=0.8, label="target 4")
    ax_d.set(
        xlabel="pipeline ranks d (m = 2d)",
        ylabel="device peak (chunks)",
        yscale="log",
        title="(a) full offload, transfer = 0.5 F",
    )
    ax_d.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- driver ----------------------------------------------------------------------------------------------


def _tasks(quick: bool) -> list[tuple[str, int, int, tuple[str, ...]]]:
    parts: dict[tuple[str, int, int], set[str]] = {}
    ds = (4, 8, 16) if quick else tuple(range(4, 33))
    for d in ds:
        parts.setdefault(("V-Half", d, 2 * d), set()).add("full")
        if d in (4, 8, 16):  # m = 4d too where it's affordable (V-Half's search grows like d^2 m)
            parts.setdefault(("V-Half", d, 4 * d), set()).add("full")
        for f in (2, 4):
            parts.setdefault(("V-Half block", d, f * d), set()).add("full")
            parts.setdefault(("Interleaved1F1B", d, f * d), set()).add("full")
    for d, m in ((8, 32),) if quick else ((8, 32), (16, 64)):
        for name in CURVE_SCHEDULES:
            parts.setdefault((name, d, m), set()).add("curve")
    parts.setdefault(MEMORY_PLOT[:3], set()).add("full")
    for name in LIMIT_SCHEDULES:
        parts.setdefault((name, 8, 32), set()).add("limits")
    return [(s, d, m, tuple(sorted(p))) for (s, d, m), p in parts.items()]


def _cost(task) -> float:
    schedule, d, m, parts = task
    return (d * d * m if schedule.startswith("V-") and schedule != "V-Half block" else d * m) * len(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="d in {4, 8, 16} for (a), only d=8 for (b)")
    p.add_argument("--out", type=Path, default=RESULTS, help="directory for offload.json and offload.png")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--from-json", type=Path, help="re-print the tables and redraw the plot of a saved run")
    args = p.parse_args(argv)

    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        results = saved["results"]
        print_full([r for r in results if "full" in r["parts"]])
        print_curves([r for r in results if "curve" in r["parts"]])
        limit_rows = sorted((r for r in results if "limits" in r["parts"]), key=lambda r: r["schedule"])
        print_limits(limit_rows)
        if not args.no_plot:
            png = args.from_json.with_suffix(".png")
            plot(
                [r for r in results if "full" in r["parts"]],
                [r for r in results if "curve" in r["parts"]],
                limit_rows,
                png,
            )
            print(f"wrote {png}")
        return 0

    import torch

    started = time.perf_counter()
    tasks = sorted(_tasks(args.quick), key=_cost, reverse=True)
    results: list[dict[str, Any]] = []
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = [pool.submit(run_config, *t) for t in tasks]
        for fut in tqdm(as_completed(futures), total=len(futures), desc="offload plans", unit="order"):
            results.append(fut.result())
    full_rows = [r for r in results if "full" in r["parts"]]
    curve_rows = [r for r in results if "curve" in r["parts"]]
    limit_rows = [r for r in results if "limits" in r["parts"]]

    verdict_a = print_full(full_rows)
    verdict_b = print_curves(curve_rows)
    print_limits(sorted(limit_rows, key=lambda r: r["schedule"]))
    total = time.perf_counter() - started
    print(f"\nruntime {total:.0f} s ({args.jobs} worker processes)")

    args.out.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": "offload: device-resident activation peak and makespan with OFFLOAD/RELOAD (simulated)",
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "torch_version": torch.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "quick": args.quick,
        "costs": {"F": 1.0, "I": 1.0, "W": 1.0, "transfer": TRANSFER},
        "memory_unit": "chunk (one V stage of one microbatch), device-resident",
        "targets": {"peak_chunks": PEAK_TARGET, "makespan_overhead": MAKESPAN_TARGET},
        "verdicts": {"full": verdict_a, "selective_half": verdict_b},
        "results": sorted(results, key=lambda r: (r["schedule"], r["d"], r["m"])),
        "runtime_seconds": total,
    }
    (args.out / "offload.json").write_text(json.dumps(payload, indent=1))
    if not args.no_plot:
        plot(full_rows, curve_rows, limit_rows, args.out / "offload.png")
    print(f"wrote {args.out / 'offload.json'}" + ("" if args.no_plot else f" and {args.out / 'offload.png'}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
