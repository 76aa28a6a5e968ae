"""Peak activation memory and simulated bubble of V-shape orders vs torch's schedules (benchmark (a)).

Every order, ours or torch's, is replayed by the same simulator (`pp_offload.sim.simulate`), so the
numbers compare schedules, not implementations. Memory is in chunk units (one V stage of one microbatch),
the peak is the largest over ranks and is also shown as a fraction of 1F1B's ``2 * min(d, m)``.

Three parts:

1. a table over d in {2, 4, 8, 16} and m in {2d, 4d, 8d}, for unit costs and F:I:W = 3:4:2: V-Min,
   V-Half, V-ZB, the adaptive scheduler at memory limits 0.4 / 0.5 / 0.75 (an infeasible limit shows as
   ``infeasible (min X)``), and torch's 1F1B, Interleaved1F1B, ZBVZeroBubble and DualPipeV;
2. a memory-bound sweep over every d in 2..32 and m in {1, 2, d, 2d-1, 2d, 3d, 4d}: V-Min <=
   2*floor((d+4)/3), V-Half <= 2*floor((d+2)/2), V-ZB <= 2d chunk units per rank;
3. the papers' reference bubbles (target / measured / verdict);
4. the adaptive sweep (`adaptive_sweep.py`): every integer memory limit from d to 2d, d in {4, 8, 16},
   m in {2d, 4d}, costs 1:1:1 and 3:4:2, against the reference adaptive scheduler's values where known
   (``--adaptive-only`` runs just this part and writes ``adaptive.json`` / ``adaptive.png``;
   ``--construction-only`` re-measures only its construction-time table, on a quiet machine).

    python bench/bench_orders.py              # everything (several minutes)
    python bench/bench_orders.py --quick      # d in {2, 4}, m in {2d, 4d}, small sweep: a smoke test

Writes ``orders.json`` (every number, the costs, torch version, timestamp) and ``orders.png`` to
``bench/results`` (or ``--out DIR``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tqdm import tqdm

RESULTS = Path(__file__).resolve().parent / "results"

COSTS = {"unit": {"F": 1.0, "I": 1.0, "W": 1.0}, "3:4:2": {"F": 3.0, "I": 4.0, "W": 2.0}}
ADAPTIVE_LIMITS = (0.4, 0.5, 0.75)
OURS = ("V-Min", "V-Half", "V-ZB") + tuple(f"adaptive@{x:g}" for x in ADAPTIVE_LIMITS)
# 1F1B is our own textbook order (pp_offload.order.baselines): torch 2.13's Schedule1F1B.pipeline_order
# is misnumbered on the last rank (it starts at F1 and invents F{m}), so replaying it would measure a
# schedule that is not 1F1B. The other three are torch's own orders, from its schedule visualizer.
TORCH = ("1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV")
SCHEDULES = OURS + TORCH
MEMORY_CURVE_SCHEDULES = ("V-Min", "V-Half", "V-ZB", "1F1B")

# The papers' reference bubbles (replayed with their own orders): (label, d, m, costs, schedule, target).
TARGETS = (
    ("V-Min", 8, 32, "unit", "V-Min", 0.123),
    ("V-Half", 8, 32, "unit", "V-Half", 0.081),
    ("V-ZB", 8, 32, "unit", "V-ZB", 0.035),
    ("V-Min", 4, 8, "unit", "V-Min", 0.186),
    ("V-Half", 4, 8, "unit", "V-Half", 0.094),
    ("V-ZB", 4, 8, "unit", "V-ZB", 0.059),
    ("adaptive limit 10/16", 8, 32, "3:4:2", "adaptive@0.625", 0.123),
    ("adaptive limit 1.0", 8, 32, "3:4:2", "adaptive@1", 0.046),
)


@dataclass
class Entry:
    """One schedule on one configuration."""

    costs: str
    d: int
    m: int
    schedule: str
    feasible: bool = True
    peak: float | None = None
    peak_per_rank: list[float] = field(default_factory=list)
    fraction: float | None = None  # peak / 1F1B's 2 * min(d, m)
    bubble: float | None = None
    makespan: float | None = None
    gen_seconds: float = 0.0
    min_limit: float | None = None  # infeasible adaptive: the smallest feasible memory_limit
    error: str | None = None
    curve_rank0: list[tuple[float, float]] | None = None


# --- one configuration (runs in a worker process) ---------------------------------------------------


def _order(schedule: str, d: int, m: int, costs: dict[str, float]):
    from pp_offload.order import adaptive_v_order, v_half_order, v_min_order, v_zb_order
    from pp_offload.order.baselines import one_f_one_b_order
    from pp_offload.runtime import compat

    if schedule == "V-Min":
        return v_min_order(d, m, costs)
    if schedule == "V-Half":
        return v_half_order(d, m, costs)
    if schedule == "V-ZB":
        return v_zb_order(d, m, costs)
    if schedule.startswith("adaptive@"):
        return adaptive_v_order(d, m, float(schedule.split("@")[1]), costs)
    if schedule == "1F1B":
        return one_f_one_b_order(d, m)  # not torch's Schedule1F1B: see TORCH above
    return dict(enumerate(compat.schedule_ops(schedule, d, m, 2)))


def _min_limit(message: str, d: int, m: int) -> float:
    """The smallest feasible memory_limit named by the generator's ValueError."""
    found = re.search(r"memory_limit >= ([0-9]*\.?[0-9]+)", message)
    if found:
        return float(found.group(1))
    from pp_offload.order.vshape import one_f_one_b_peak, smallest_feasible_peak

    return smallest_feasible_peak(d, m) / one_f_one_b_peak(d, m)


def run_entry(costs_name: str, d: int, m: int, schedule: str, want_curve: bool) -> Entry:
    import pp_offload.order.baselines  # noqa: F401  (imports, torch's included, are not generation time)
    import pp_offload.runtime.compat  # noqa: F401
    from pp_offload.order.vshape import one_f_one_b_peak
    from pp_offload.sim import simulate

    costs = COSTS[costs_name]
    entry = Entry(costs_name, d, m, schedule)
    start = time.perf_counter()
    try:
        order = _order(schedule, d, m, costs)
        entry.gen_seconds = time.perf_counter() - start
        result = simulate(order, costs)
    except Exception as e:  # reported in the table and the JSON; one bad order must not stop the bench
        entry.gen_seconds = time.perf_counter() - start
        entry.feasible, entry.error = False, f"{type(e).__name__}: {e}"
        if schedule.startswith("adaptive@") and isinstance(e, ValueError) and "memory_limit" in str(e):
            entry.min_limit = _min_limit(str(e), d, m)
        return entry
    entry.peak = result.peak
    entry.peak_per_rank = [result.peak_memory[r] for r in sorted(result.peak_memory)]
    entry.fraction = result.peak / one_f_one_b_peak(d, m)
    entry.bubble, entry.makespan = result.bubble, result.makespan
    if want_curve:
        entry.curve_rank0 = list(result.memory_curve[0])
    return entry


def sweep_entry(d: int, m: int) -> list[dict[str, Any]]:
    """Memory bounds of V-Min / V-Half / V-ZB at one (d, m), unit costs."""
    from pp_offload.order import v_half_order, v_min_order, v_zb_order
    from pp_offload.order.vshape import v_half_cap, v_min_cap
    from pp_offload.sim import simulate

    rows = []
    for name, gen, bound in (
        ("V-Min", v_min_order, v_min_cap(d)),
        ("V-Half", v_half_order, v_half_cap(d)),
        ("V-ZB", v_zb_order, 2 * d),
    ):
        start = time.perf_counter()
        row: dict[str, Any] = {"d": d, "m": m, "schedule": name, "bound": bound}
        try:
            peak = simulate(gen(d, m)).peak
            row.update(peak=peak, ok=peak <= bound + 1e-9)
        except Exception as e:  # a generator failing is a FAIL of the sweep, not a crash of the bench
            row.update(peak=None, ok=False, error=f"{type(e).__name__}: {e}")
        row["gen_seconds"] = time.perf_counter() - start
        rows.append(row)
    return rows


# --- driver -------------------------------------------------------------------------------------------


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="d in {2, 4}, m in {2d, 4d}, sweep d <= 5")
    p.add_argument("--out", type=Path, default=RESULTS, help="directory for orders.json and orders.png")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes")
    p.add_argument("--sweep-max-d", type=int, default=None, help="largest d of the bound sweep (32)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument(
        "--adaptive-only",
        action="store_true",
        help="run only the adaptive sweep (adaptive.json / adaptive.png)",
    )
    p.add_argument("--adaptive-d", default="4,8,16", help="comma-separated d of the adaptive sweep (4,8,16)")
    p.add_argument(
        "--no-adaptive", action="store_true", help="skip part 4 (run it alone with --adaptive-only)"
    )
    p.add_argument(
        "--construction-max-d", type=int, default=32, help="largest d of the construction-time table (32)"
    )
    p.add_argument(
        "--construction-only",
        action="store_true",
        help="re-measure only the construction-time table into the existing adaptive.json (timings want a "
        "quiet machine; the sweep's bubbles do not)",
    )
    return p.parse_args(argv)


def run_adaptive_sweep(args: argparse.Namespace) -> dict[str, Any]:
    """Part 4: the adaptive sweep (see adaptive_sweep.py); writes adaptive.json and adaptive.png."""
    import adaptive_sweep

    if args.construction_only:
        return _rerun_construction(args)
    ds = [int(x) for x in args.adaptive_d.split(",") if x]
    tasks = [(d, f * d, c, d * d * f * d) for d in ds for f in (2, 4) for c in adaptive_sweep.COSTS]
    t0 = time.perf_counter()
    rows = [
        row for rows in _run_pool(tasks, adaptive_sweep.sweep_config, args.jobs, "adaptive") for row in rows
    ]
    summary = adaptive_sweep.print_sweep(rows)
    construction = _construction(args)
    payload = {
        "benchmark": "adaptive sweep: bubble vs memory limit, ours against the reference",
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "bubble": "1 - busiest rank's compute / makespan, percent",
        "memory_unit": "chunk units per rank; limit = memory_limit * 1F1B's 2 * min(d, m)",
        "reference_sources": adaptive_sweep.__doc__,
        "costs": adaptive_sweep.COSTS,
        "rows": rows,
        "summary": summary,
        "construction": construction,
        "runtime_seconds": time.perf_counter() - t0,
        "jobs": args.jobs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "adaptive.json").write_text(json.dumps(payload, indent=1))
    if not args.no_plot:
        adaptive_sweep.plot_sweep(rows, args.out / "adaptive.png")
    print(
        f"wrote {args.out / 'adaptive.json'}" + ("" if args.no_plot else f" and {args.out / 'adaptive.png'}")
    )
    return payload


def _construction(args: argparse.Namespace) -> list[dict[str, Any]]:
    import adaptive_sweep

    sizes = [(d, m) for d, m in adaptive_sweep.CONSTRUCTION if d <= args.construction_max_d]
    tasks = [(d, m, c, d * d * m) for d, m in sizes for c in adaptive_sweep.COSTS]
    rows = _run_pool(tasks, adaptive_sweep.construction_time, args.jobs, "construction")
    adaptive_sweep.print_construction(rows)
    return rows


def _rerun_construction(args: argparse.Namespace) -> dict[str, Any]:
    """The construction table alone, written into the adaptive.json a full run left (its sweep kept)."""
    path = args.out / "adaptive.json"
    if not path.exists():
        raise SystemExit(f"--construction-only updates {path}, which is missing: run --adaptive-only first")
    payload = json.loads(path.read_text())
    payload["construction"] = _construction(args)
    payload["construction_timestamp"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    payload["construction_jobs"] = args.jobs
    path.write_text(json.dumps(payload, indent=1))
    print(f"updated the construction table of {path}")
    return payload


def _grid(quick: bool) -> list[tuple[int, int]]:
    ranks, factors = ((2, 4), (2, 4)) if quick else ((2, 4, 8, 16), (2, 4, 8))
    return [(d, f * d) for d in ranks for f in factors]


def _sweep_sizes(max_d: int) -> list[tuple[int, int]]:
    return [(d, m) for d in range(2, max_d + 1) for m in sorted({1, 2, d, 2 * d - 1, 2 * d, 3 * d, 4 * d})]


def _curve_config(grid: list[tuple[int, int]]) -> tuple[int, int]:
    return (8, 32) if (8, 32) in grid else max(grid)


def _scatter_configs(grid: list[tuple[int, int]]) -> list[tuple[int, int]]:
    wanted = [c for c in ((8, 32), (16, 64)) if c in grid]
    return wanted or sorted(grid)[-2:]


def _run_pool(tasks: list[tuple], fn, jobs: int, desc: str) -> list:
    """Run ``fn(*task)`` for every task, largest first, with a progress bar; results in task order."""
    results: list = [None] * len(tasks)
    order = sorted(range(len(tasks)), key=lambda i: -tasks[i][-1])  # last element: a size hint
    if jobs <= 1:
        for i in tqdm(order, desc=desc, unit="cfg"):
            results[i] = fn(*tasks[i][:-1])
        return results
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(fn, *tasks[i][:-1]): i for i in order}
        for future in tqdm(as_completed(futures), total=len(futures), desc=desc, unit="cfg"):
            results[futures[future]] = future.result()
    return results


def _cell(entry: Entry) -> str:
    if entry.min_limit is not None:
        return f"infeasible (min {entry.min_limit:.3f})"
    if not entry.feasible:
        return f"ERROR {entry.error.split(':')[0]}"
    return f"{entry.peak:4g} ({entry.fraction:4.2f}) {100 * entry.bubble:5.1f}%"


def print_table(entries: list[Entry], grid: list[tuple[int, int]]) -> None:
    """Per cost model and d: rows are schedules, columns are m; a cell is 'peak (x 1F1B) bubble'."""
    index = {(e.costs, e.d, e.m, e.schedule): e for e in entries}
    lines = []
    for costs_name in COSTS:
        for d in sorted({d for d, _ in grid}):
            ms = [m for dd, m in grid if dd == d]
            lines.append("")
            lines.append(
                f"costs {costs_name} (F:I:W = {_ratio(costs_name)}), d = {d}; "
                f"cell: peak chunk units (fraction of 1F1B's {2 * d}) bubble"
            )
            header = f"{'schedule':<16}" + "".join(f"{'m = ' + str(m):>26}" for m in ms)
            lines.append(header)
            lines.append("-" * len(header))
            for schedule in SCHEDULES:
                cells = [_cell(index[(costs_name, d, m, schedule)]) for m in ms]
                lines.append(f"{schedule:<16}" + "".join(f"{c:>26}" for c in cells))
    errors = [e for e in entries if not e.feasible and e.min_limit is None]
    for e in errors:
        lines.append(f"ERROR {e.schedule} d={e.d} m={e.m} costs {e.costs}: {e.error}")
    print("\n".join(lines))


def _ratio(costs_name: str) -> str:
    c = COSTS[costs_name]
    return f"{c['F']:g}:{c['I']:g}:{c['W']:g}"


def print_sweep(rows: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    counts = {name: {"PASS": 0, "FAIL": 0} for name in ("V-Min", "V-Half", "V-ZB")}
    for row in rows:
        counts[row["schedule"]]["PASS" if row["ok"] else "FAIL"] += 1
    ds = sorted({r["d"] for r in rows})
    lines = [
        "",
        f"memory-bound sweep: d = {ds[0]}..{ds[-1]}, m in {{1, 2, d, 2d-1, 2d, 3d, 4d}}, unit costs",
    ]
    bounds = {"V-Min": "2*floor((d+4)/3)", "V-Half": "2*floor((d+2)/2)", "V-ZB": "2d"}
    for name, c in counts.items():
        lines.append(f"  {name:<7} peak <= {bounds[name]:<17} PASS {c['PASS']:4d}   FAIL {c['FAIL']:4d}")
    for row in rows:
        if not row["ok"]:
            what = row.get("error") or f"peak {row['peak']:g} > bound {row['bound']}"
            lines.append(f"  FAIL {row['schedule']} d={row['d']} m={row['m']}: {what}")
    print("\n".join(lines))
    return counts


def print_targets(entries: list[Entry], extra: list[Entry]) -> list[dict[str, Any]]:
    index = {(e.costs, e.d, e.m, e.schedule): e for e in entries + extra}
    lines = [
        "",
        "papers' reference bubbles (measured must be <= target, compared at 0.1% resolution)",
        f"{'schedule':<22}{'d':>3}{'m':>4}{'costs':>7}{'target':>9}{'measured':>10}{'peak':>7}  verdict",
    ]
    rows = []
    for label, d, m, costs_name, schedule, target in TARGETS:
        e = index.get((costs_name, d, m, schedule))
        if e is None:
            measured, verdict, peak = None, "not run", None
        elif e.min_limit is not None:
            measured, verdict, peak = None, f"FAIL (infeasible, min {e.min_limit:.3f})", None
        elif not e.feasible:
            measured, verdict, peak = None, f"FAIL ({e.error})", None
        else:
            measured, peak = e.bubble, e.peak
            verdict = "PASS" if round(100 * measured, 1) <= round(100 * target, 1) + 1e-9 else "FAIL"
        rows.append(
            {
                "label": label,
                "d": d,
                "m": m,
                "costs": costs_name,
                "schedule": schedule,
                "target": target,
                "measured": measured,
                "peak": peak,
                "verdict": verdict,
            }
        )
        shown = "-" if measured is None else f"{100 * measured:.1f}%"
        peak_s = "-" if peak is None else f"{peak:g}"
        lines.append(
            f"{label:<22}{d:>3}{m:>4}{costs_name:>7}{100 * target:>8.1f}%{shown:>10}{peak_s:>7}  {verdict}"
        )
    print("\n".join(lines))
    return rows


def plot(entries: list[Entry], grid: list[tuple[int, int]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    markers = dict(zip(SCHEDULES, "ov^sDP*XhH", strict=True))
    index = {(e.costs, e.d, e.m, e.schedule): e for e in entries}
    scatter = _scatter_configs(grid)
    cols = max(2, len(scatter))
    fig, axes = plt.subplots(len(COSTS) + 1, cols, figsize=(6.5 * cols, 4.5 * (len(COSTS) + 1)))
    for row, costs_name in enumerate(COSTS):
        for col in range(cols):
            ax = axes[row][col]
            if col >= len(scatter):
                ax.axis("off")
                continue
            d, m = scatter[col]
            for schedule in SCHEDULES:
                e = index[(costs_name, d, m, schedule)]
                if not e.feasible:
                    continue
                # adaptive points often coincide with V-Min / V-Half: draw them hollow and larger
                hollow = schedule.startswith("adaptive@")
                ax.scatter(
                    e.fraction,
                    100 * e.bubble,
                    marker=markers[schedule],
                    s=160 if hollow else 50,
                    facecolors="none" if hollow else None,
                    edgecolors=f"C{SCHEDULES.index(schedule)}" if hollow else None,
                    color=None if hollow else f"C{SCHEDULES.index(schedule)}",
                    label=schedule,
                )
            ax.set_title(f"d={d}, m={m}, F:I:W = {_ratio(costs_name)}")
            ax.set_xlabel("peak activation memory / 1F1B's")
            ax.set_ylabel("simulated bubble (%)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    d, m = _curve_config(grid)
    for col, costs_name in enumerate(list(COSTS)[:cols]):
        ax = axes[len(COSTS)][col]
        for schedule in MEMORY_CURVE_SCHEDULES:
            curve = index[(costs_name, d, m, schedule)].curve_rank0
            if curve:
                ts, levels = zip(*curve, strict=True)
                ax.step(ts, levels, where="post", label=schedule)
        ax.set_title(f"rank 0 activation memory over time, d={d}, m={m}, F:I:W = {_ratio(costs_name)}")
        ax.set_xlabel("time (cost units)")
        ax.set_ylabel("live chunk units")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    # The benchmark measures the search: no disk cache (worker processes inherit this).
    os.environ["PP_OFFLOAD_ORDER_CACHE"] = "off"
    if args.adaptive_only or args.construction_only:
        run_adaptive_sweep(args)
        return 0
    import torch

    started = time.perf_counter()
    grid = _grid(args.quick)
    curve_config = _curve_config(grid)
    tasks = [
        (costs_name, d, m, schedule, (d, m) == curve_config and schedule in MEMORY_CURVE_SCHEDULES, d * d * m)
        for costs_name in COSTS
        for d, m in grid
        for schedule in SCHEDULES
    ]
    # The adaptive reference points of the paper (limits 10/16 and 1.0 at d=8, m=32, costs 3:4:2).
    extra_tasks = [
        (c, d, m, s, False, d * d * m)
        for _, d, m, c, s, _ in TARGETS
        if (d, m) in grid and s not in SCHEDULES
    ]
    t0 = time.perf_counter()
    entries = _run_pool(tasks + extra_tasks, run_entry, args.jobs, "orders")
    entries, extra = entries[: len(tasks)], entries[len(tasks) :]
    table_seconds = time.perf_counter() - t0
    print_table(entries, grid)
    target_rows = print_targets(entries, extra)

    args.out.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": "orders: peak activation memory and simulated bubble",
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "torch_version": torch.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "quick": args.quick,
        "costs": COSTS,
        "memory_unit": "chunk (one V stage of one microbatch); 1F1B's peak is 2 * min(d, m)",
        "bubble": "1 - busiest rank's compute / makespan",
        "notes": [
            "1F1B is pp_offload.order.baselines.one_f_one_b_order: torch 2.13's Schedule1F1B "
            "pipeline_order is misnumbered on the last rank (starts at F1, invents F{m}).",
            "Interleaved1F1B, ZBVZeroBubble, DualPipeV: torch's orders from its schedule visualizer.",
        ],
        "grid": grid,
        "results": [asdict(e) for e in entries],
        "extra_results": [asdict(e) for e in extra],
        "targets": target_rows,
        "sweep": None,  # filled in when the sweep ends: a long sweep cut short still leaves the table
        "runtime_seconds": {"table": table_seconds},
        "jobs": args.jobs,
    }
    _write(payload, args.out)
    if not args.no_plot:
        plot(entries, grid, args.out / "orders.png")

    max_d = args.sweep_max_d or (5 if args.quick else 32)
    sweep_tasks = [(d, m, d * d * m) for d, m in _sweep_sizes(max_d)]
    t0 = time.perf_counter()
    sweep_results = _run_pool(sweep_tasks, sweep_entry, args.jobs, "bound sweep")
    sweep_rows = [row for rows in sweep_results for row in rows]
    sweep_seconds = time.perf_counter() - t0
    counts = print_sweep(sweep_rows)

    slowest = sorted(entries + extra, key=lambda e: -e.gen_seconds)[:5]
    slow_sweep = sorted(sweep_rows, key=lambda r: -r["gen_seconds"])[:5]
    total = time.perf_counter() - started
    print(
        f"\nruntime: table {table_seconds:.1f} s, sweep {sweep_seconds:.1f} s, total {total:.1f} s "
        f"({args.jobs} worker processes)\nslowest order generations (table): "
        + ", ".join(f"{e.schedule} d={e.d} m={e.m} {e.costs} {e.gen_seconds:.1f}s" for e in slowest)
        + "\nslowest order generations (sweep): "
        + ", ".join(f"{r['schedule']} d={r['d']} m={r['m']} {r['gen_seconds']:.1f}s" for r in slow_sweep)
    )
    payload["sweep"] = {"rows": sweep_rows, "counts": counts, "max_d": max_d}
    if not args.quick and not args.no_adaptive:
        payload["adaptive_sweep"] = run_adaptive_sweep(args)["summary"]
    payload["runtime_seconds"] = {"table": table_seconds, "sweep": sweep_seconds, "total": total}
    _write(payload, args.out)
    print(f"wrote {args.out / 'orders.json'}" + ("" if args.no_plot else f" and {args.out / 'orders.png'}"))
    return 0


def _write(payload: dict[str, Any], out: Path) -> None:
    (out / "orders.json").write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    sys.exit(main())
