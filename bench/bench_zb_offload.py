"""Offload on zero-bubble schedules: I->W drop-and-reload vs offload-aware orders (planner model).

Zero-bubble orders hold a chunk's saved tensors from its I until its W. Two remedies under budget offload
(layer by layer, `pp_offload.order.offload`), measured side by side on the same orders, costs and bytes:

(a) ``budget:no-IW-drop``: budget offload, chunks stay on the device from I to W;
(b) ``budget``: today's default, which also tries dropping a chunk again after I and reloading it before
    W (a second host-to-device copy) and keeps that where it peaks lower;
(c) ``budget:close-w``: (b) plus offload-aware orders (`pp_offload.order.zb_offload`): W moved right after
    I, rank by rank, scored by the same budget planner within the same step-time limit, measured against
    the order as given;
(d) V-Half with budget offload, for reference (a non-zero-bubble V order: its W follows its I).

Each at the default limit (within 3% of the schedule's step without offload) and within 10%
(``budget:auto:0.1``, ``...:close-w``). Schedules: V-ZB (ours), torch's ZBV and InterleavedZeroBubble
(the zero-bubble schedules the planner evaluates). Llama-3-8B (32 layers, h 4096), pp 4, m 16, bf16, seq
4096 and 16384, H100 and A100 presets. Every figure is the planner's (`pp_offload.plan.evaluate`): orders
as torch executes them, per-stage pass times and bytes, offload placed by `plan_offload` and replayed by
`pp_offload.sim.simulate`. Columns: step time, its change against the same schedule without offload, the
largest per-rank activation peak (GiB) and every rank's, GiB copied device->host and host->device per step
(the drop-and-reload copies twice back), chunks dropped after I, W passes moved next to I.

    python bench/bench_zb_offload.py            # ~5 min on 2 cores
    python bench/bench_zb_offload.py --quick    # H100, seq 4096 only (~1-2 min)
    python bench/bench_zb_offload.py --from-json bench/results/zb_offload.json

Writes ``zb_offload.json`` and ``zb_offload.png`` to ``bench/results`` (or ``--out DIR``).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pp_offload.plan.shapes import SHAPES

RESULTS = Path(__file__).resolve().parent / "results"
GIB = float(1 << 30)
LLAMA_8B = SHAPES["llama-3-8b"]
ZERO_BUBBLE = ("ScheduleVZB", "ScheduleZBVZeroBubble", "ScheduleInterleavedZeroBubble")
SHORT = {
    "ScheduleVZB": "V-ZB",
    "ScheduleZBVZeroBubble": "ZBV",
    "ScheduleInterleavedZeroBubble": "InterleavedZB",
    "ScheduleVHalf": "V-Half",
}
# (label, policy) per step-time limit: (a) no drop, (b) drop considered (today's default), (c) close-w
VARIANTS = {
    0.03: (
        ("a no-IW-drop", {"mode": "budget", "drop_after_i": False}),
        ("b IW-drop", "budget"),
        ("c close-w", "budget:close-w"),
    ),
    0.10: (
        ("a no-IW-drop", {"mode": "budget", "drop_after_i": False, "max_slowdown": 0.1}),
        ("b IW-drop", "budget:auto:0.1"),
        ("c close-w", "budget:auto:0.1:close-w"),
    ),
}
REFERENCE = {0.03: "budget", 0.10: "budget:auto:0.1"}
MACHINES = ("H100", "A100")
SEQS = (4096, 16384)


def _setup(schedule: str, machine: str, seq: int) -> tuple[Any, Any]:
    from pp_offload.plan.evaluate import build_orders, simulation_sizes
    from pp_offload.plan.handoff import planner_setup

    setup = planner_setup(
        LLAMA_8B, schedule=schedule, pp=4, seq_len=seq, microbatch_size=1, num_microbatches=16,
        machine=machine,
    )  # fmt: skip
    orders = build_orders(setup, simulation_sizes(4, 16, schedule), search="auto", virtual_stages=2)
    if orders.error:
        raise RuntimeError(f"{schedule}: {orders.error}")
    (order,) = orders.orders.values()  # m = 16 at pp 4: one exact order, no extrapolation
    return setup, order


def _row(setup: Any, order: Any, label: str, policy: Any) -> dict[str, Any]:
    """One policy on one order: what the planner predicts, and what the plan copies."""
    from pp_offload.plan.evaluate import activation_peaks, offload_plan
    from pp_offload.sim import simulate

    start = time.perf_counter()
    if policy == "none":
        sim, layered, d2h, h2d, dropped, pulled = simulate(order, setup.costs), {}, 0, 0, 0, 0
    else:
        plan = offload_plan(setup, order, policy)
        sim, layered = plan.sim, plan.layered
        nbytes = {key: c.moved * setup.stage_layer_bytes(key[0]) for key, c in layered.items()}
        d2h = sum(nbytes.values())
        again = plan.dropped_after_i()  # second OFFLOADs: dropped after I
        dropped = len(again)
        h2d = d2h + sum(nbytes[k] for k in again)  # each dropped chunk's layers come back twice
        pulled = sum(len(v) for v in plan.pulled.values())
    peaks = activation_peaks(sim, setup, layered=layered)
    return {
        "variant": label,
        "policy": policy if isinstance(policy, str) else json.dumps(policy, sort_keys=True),
        "step_s": sim.makespan,
        "activation_gib": max(peaks) / GIB,
        "activation_per_rank_gib": [p / GIB for p in peaks],
        "d2h_gib": d2h / GIB,
        "h2d_gib": h2d / GIB,
        "dropped_after_i": dropped,
        "pulled_w": pulled,
        "plan_seconds": time.perf_counter() - start,
    }


def _group(machine: str, seq: int, schedule: str) -> list[dict[str, Any]]:
    setup, order = _setup(schedule, machine, seq)
    rows = [_row(setup, order, "none", "none")]
    for limit, variants in VARIANTS.items():
        if schedule == "ScheduleVHalf":
            variants = (("d V-Half", REFERENCE[limit]),)
        for label, policy in variants:
            rows.append({**_row(setup, order, label, policy), "limit": limit})
    for row in rows:
        row.update(machine=machine, seq=seq, schedule=SHORT[schedule])
        row.setdefault("limit", 0.0)
        row["slowdown"] = row["step_s"] / rows[0]["step_s"] - 1.0
        row["cut"] = 1.0 - row["activation_gib"] / rows[0]["activation_gib"]
    print(f"  {machine} seq {seq} {SHORT[schedule]}: done", file=sys.stderr)
    return rows


def run(quick: bool, jobs: int) -> list[dict[str, Any]]:
    tasks = [
        (machine, seq, schedule)
        for machine in (("H100",) if quick else MACHINES)
        for seq in ((4096,) if quick else SEQS)
        for schedule in (*ZERO_BUBBLE, "ScheduleVHalf")
    ]
    if jobs <= 1:
        return [r for task in tasks for r in _group(*task)]
    with ProcessPoolExecutor(jobs) as pool:
        return [r for rows in pool.map(_group, *zip(*tasks, strict=True)) for r in rows]


def verdicts(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per machine, seq, zero-bubble schedule and limit: (c) against the better of (a) and (b), by peak
    (step time breaks ties), and against V-Half's budget row of the same limit."""
    out = []
    keys = sorted({(r["machine"], r["seq"], r["schedule"]) for r in rows if r["schedule"] != "V-Half"})
    for machine, seq, schedule in keys:
        for limit in VARIANTS:
            mine = {
                r["variant"]: r
                for r in rows
                if (r["machine"], r["seq"], r["schedule"], r["limit"]) == (machine, seq, schedule, limit)
            }
            ref = next(
                r
                for r in rows
                if (r["machine"], r["seq"], r["schedule"], r["limit"]) == (machine, seq, "V-Half", limit)
            )
            today = min(
                (mine["a no-IW-drop"], mine["b IW-drop"]), key=lambda r: (r["activation_gib"], r["step_s"])
            )
            close = mine["c close-w"]
            gain = 1.0 - close["activation_gib"] / today["activation_gib"]
            out.append(
                {
                    "machine": machine,
                    "seq": seq,
                    "schedule": schedule,
                    "limit": limit,
                    "today": today["variant"],
                    "today_gib": today["activation_gib"],
                    "today_slowdown": today["slowdown"],
                    "close_w_gib": close["activation_gib"],
                    "close_w_slowdown": close["slowdown"],
                    "peak_gain": gain,
                    "winner": "c close-w" if gain > 1e-3 else "tie" if gain > -1e-3 else today["variant"],
                    "v_half_gib": ref["activation_gib"],
                    "v_half_step_s": ref["step_s"],
                    "close_w_step_s": close["step_s"],
                }
            )
    return out


def report(rows: list[dict[str, Any]]) -> str:
    lines = []
    head = (
        f"{'variant':<14}{'limit':>6}{'step s':>9}{'slower':>8}{'act GiB':>9}{'cut':>7}  {'per rank GiB':<24}"
        f"{'D2H GiB':>8}{'H2D GiB':>8}{'dropI':>6}{'pullW':>6}"
    )
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["machine"], r["seq"], r["schedule"]), []).append(r)
    for (machine, seq, schedule), mine in groups.items():
        lines += [f"\nLlama-3-8B, {machine}, pp 4, m 16, seq {seq}, {schedule}", head, "-" * len(head)]
        for r in mine:
            per_rank = " ".join(f"{g:.1f}" for g in r["activation_per_rank_gib"])
            limit = f"{r['limit']:.0%}" if r["limit"] else "-"
            lines.append(
                f"{r['variant']:<14}{limit:>6}{r['step_s']:>9.3f}{100 * r['slowdown']:>+7.1f}%"
                f"{r['activation_gib']:>9.1f}{100 * r['cut']:>6.1f}%  {per_rank:<24}{r['d2h_gib']:>8.1f}"
                f"{r['h2d_gib']:>8.1f}{r['dropped_after_i']:>6}{r['pulled_w']:>6}"
            )
    lines.append("\nWhich wins: (c) close-w against the better of (a) no-IW-drop and (b) IW-drop, same limit")
    head = (
        f"{'machine':<7}{'seq':>6}  {'schedule':<14}{'limit':>6}  {'today (a/b)':<22}{'close-w (c)':<20}"
        f"{'peak gain':>10}  {'winner':<14}{'V-Half (d)':>18}"
    )
    lines += [head, "-" * len(head)]
    for v in verdicts(rows):
        lines.append(
            f"{v['machine']:<7}{v['seq']:>6}  {v['schedule']:<14}{v['limit']:>6.0%}  "
            f"{v['today_gib']:>6.1f} GiB {100 * v['today_slowdown']:>+5.1f}% {v['today'][:1]:<3}"
            f"{v['close_w_gib']:>6.1f} GiB {100 * v['close_w_slowdown']:>+5.1f}%   "
            f"{100 * v['peak_gain']:>8.1f}%  {v['winner']:<14}{v['v_half_gib']:>7.1f} GiB "
            f"{v['v_half_step_s']:.3f}s"
        )
    lines.append(
        "\ncolumns: slower/cut against the same schedule without offload; D2H/H2D = GiB copied each way per "
        "step (all ranks); dropI = chunks dropped after I and reloaded before W; pullW = W passes moved "
        "right after their I; peak gain = 1 - close-w peak / today's peak; V-Half (d) = V-Half with budget "
        "offload at the same limit (its own step time)"
    )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["machine"], r["seq"]) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 5), squeeze=False)
    markers = {"none": "o", "a no-IW-drop": "v", "b IW-drop": "^", "c close-w": "*", "d V-Half": "s"}
    for ax, (machine, seq) in zip(axes[0], panels, strict=True):
        for schedule in SHORT.values():
            mine = [r for r in rows if (r["machine"], r["seq"], r["schedule"]) == (machine, seq, schedule)]
            if not mine:
                continue
            colour = None
            for variant, marker in markers.items():
                pts = [r for r in mine if r["variant"] == variant]
                if not pts:
                    continue
                drawn = ax.scatter(
                    [r["step_s"] for r in pts],
                    [r["activation_gib"] for r in pts],
                    marker=marker,
                    color=colour,
                    s=60 if marker == "*" else 30,
                    label=f"{schedule} {variant}",
                )
                colour = drawn.get_facecolor()[0]
        ax.set_xlabel("predicted step time (s)")
        ax.set_ylabel("activation peak per rank (GiB)")
        ax.set_title(f"Llama-3-8B, {machine}, pp 4, m 16, seq {seq}")
        ax.legend(fontsize=6)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--from-json", type=Path, help="print and plot a committed run instead")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--jobs", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--quick", action="store_true", help="H100, seq 4096 only")
    args = parser.parse_args(argv)
    if args.from_json:
        data = json.loads(args.from_json.read_text())
    else:
        start = time.perf_counter()
        rows = run(args.quick, args.jobs)
        data = {
            "bench": "zb_offload",
            "quick": args.quick,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "python": platform.python_version(),
            "seconds": time.perf_counter() - start,
            "results": rows,
            "verdicts": verdicts(rows),
        }
    print(report(data["results"]))
    args.out.mkdir(parents=True, exist_ok=True)
    name = "zb_offload_quick" if data.get("quick") else "zb_offload"
    if not args.from_json:
        (args.out / f"{name}.json").write_text(json.dumps(data, indent=1))
    plot(data["results"], args.out / f"{name}.png")
    print(f"\nwrote {args.out / (name + '.json')} and {args.out / (name + '.png')}")


if __name__ == "__main__":
    main()
