"""PipeOffload at real model sizes: what each offload policy buys on Llama-3 configs (planner model).

Every figure is the planner's (`pp_offload.plan.evaluate`): orders as the schedule classes build them,
offload placed by `pp_offload.order.offload.plan_offload`, replayed by `pp_offload.sim.simulate` with the
per-stage pass times (matmul FLOPs / (peak x MFU)), per-stage saved bytes (`pp_offload.plan.memory`) and
the machine's host link. Activation peak = the largest per-rank peak of saved activations (GiB), step =
the pipeline makespan (dp = 1).

Two parts:

(a) Llama-3-8B (32 layers, h 4096, MLP 14336, vocab 128256, 8 KV heads), H100 preset (21 GB/s host link),
    pp 4, m 16, seq 4096 and 16384 (``--quick``: 4096 only), for V-Half, V-ZB and Interleaved1F1B: no
    offload, the whole-chunk policies (selective:0.5, full) and the budgeted layer-by-layer ones (budget =
    as many layers as hide within 3% step time, budget:auto:0.1 within 10%, fixed shares of each
    chunk's layers, and budget:no-IW-drop = budget without leaving the device between I and W).
    Targets: peak cut >= 30% at <= +3% step time and >= 50% at <= +10%.
(b) Llama-3-70B (80 layers, h 8192, MLP 28672), seq 8192, H100, pp 4, 8, 16 (``--quick``: 4, 8), m = 2 pp:
    V-Half and Interleaved1F1B without offload and with the best policy within +10% step time. Target: that
    peak stays flat from pp 4 to pp 16. And (a)'s 8B rows on the GH200 preset (NVLink-C2C, 450 GB/s), where
    offload should be nearly free.

Physical bound, printed beside every row that misses a target: cutting a rank's peak by a share X needs
at least X of the bytes its chunks save to be off the device while they wait (every chunk passes through
the peak in a steady pipeline), i.e. X x (bytes the rank's chunks save in a step) copied out *and* back,
while one direction of the host link carries at most step time x bandwidth. ``need/cap`` > 1 means the
target is out of reach at that step time, whatever the schedule.

    python bench/bench_offload_scale.py            # both parts (~4 min on 2 busy cores)
    python bench/bench_offload_scale.py --quick    # seq 4096 and pp 4, 8 only (~1.5 min)
    python bench/bench_offload_scale.py --from-json bench/results/offload_scale.json

Writes ``offload_scale.json`` and ``offload_scale.png`` to ``bench/results`` (or ``--out DIR``).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
GIB = float(1 << 30)
LLAMA_8B = {
    "model_type": "llama",
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
}
LLAMA_70B = {
    **LLAMA_8B,
    "num_hidden_layers": 80,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_attention_heads": 64,
}
SCHEDULES = ("ScheduleVHalf", "ScheduleVZB", "ScheduleInterleaved1F1B")
SHORT = {"ScheduleVHalf": "V-Half", "ScheduleVZB": "V-ZB", "ScheduleInterleaved1F1B": "Interleaved1F1B"}
OLD = ("selective:0.5", "full")
NEW = ("budget", "budget:auto:0.1", "budget:0.25", "budget:0.5", "budget:1", "budget:no-IW-drop")
# zero-bubble orders keep a chunk from I to W: the same budget without dropping it in between, to measure
# what the I-to-W drop buys
VARIANTS = {"budget:no-IW-drop": {"mode": "budget", "drop_after_i": False}}
TARGETS = ((0.03, 0.30), (0.10, 0.50))  # (max slowdown, min peak cut)


def evaluate(config: dict, *, machine: str, seq: int, pp: int, m: int, schedule: str, policies) -> list[dict]:
    """One schedule under every policy: step time, activation peak, bytes moved, the link bound."""
    from pp_offload.plan.evaluate import (
        build_orders,
        combine,
        evaluate_orders,
        setup_schedule,
        simulation_sizes,
    )
    from pp_offload.plan.machines import resolve_machine
    from pp_offload.plan.memory import precision
    from pp_offload.plan.model import model_spec

    mach = resolve_machine(machine)
    setup = setup_schedule(
        schedule,
        spec=model_spec(config),
        machine=mach,
        precision=precision("bf16"),
        seq_len=seq,
        microbatch_size=1,
        num_microbatches=m,
        pp=pp,
        dp=1,
        dp_shard=False,
        virtual_stages=2,
        reserve=0,
    )
    sizes = simulation_sizes(pp, m)
    orders = build_orders(setup, sizes, search="auto", virtual_stages=2)
    if orders.error:
        raise RuntimeError(f"{schedule} pp {pp}: {orders.error}")
    # bytes one rank's chunks save over the step (the largest rank)
    rank_saved = max(
        m * sum(setup.stages[s].activation.saved for s in setup.layout.stages_of(r)) for r in range(pp)
    )
    rows = []
    for policy in ("none", *policies):
        start = time.perf_counter()
        summary = combine(evaluate_orders(setup, orders, VARIANTS.get(policy, policy)), m)
        rows.append(
            {
                "schedule": SHORT.get(schedule, schedule),
                "policy": policy,
                "step_s": summary["makespan"],
                "activation_gib": max(summary["activation"]) / GIB,
                "moved_share": summary["moved_share"],
                "chunks_share": summary["offloaded_share"],
                "rank_saved_gib": rank_saved / GIB,
                "plan_seconds": time.perf_counter() - start,
            }
        )
    base = rows[0]
    for row in rows:
        row["slowdown"] = row["step_s"] / base["step_s"] - 1.0
        row["cut"] = 1.0 - row["activation_gib"] / base["activation_gib"]
        cap = row["step_s"] * mach.host_bandwidth / GIB  # GiB one direction of the link carries in the step
        row["link_capacity_gib"] = cap
        row["need_ratio"] = {f"{cut:.0%}": cut * row["rank_saved_gib"] / cap for _, cut in TARGETS}
    return rows


def best_within(rows: list[dict], slowdown: float) -> dict:
    """The row with the largest peak cut among those within ``slowdown``."""
    ok = [r for r in rows if r["slowdown"] <= slowdown + 1e-9]
    return max(ok, key=lambda r: (r["cut"], -r["step_s"]))


def run(quick: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"part_a": [], "part_b": [], "part_gh200": []}
    seqs = (4096,) if quick else (4096, 16384)
    for seq in seqs:
        for schedule in SCHEDULES:
            rows = evaluate(
                LLAMA_8B, machine="H100", seq=seq, pp=4, m=16, schedule=schedule, policies=OLD + NEW
            )
            for row in rows:
                row["seq"] = seq
            out["part_a"] += rows
            print(f"  8B seq {seq} {SHORT[schedule]}: done", file=sys.stderr)
    for schedule in SCHEDULES:
        rows = evaluate(
            LLAMA_8B, machine="GH200", seq=4096, pp=4, m=16, schedule=schedule, policies=OLD + NEW
        )
        for row in rows:
            row["seq"] = 4096
        out["part_gh200"] += rows
    for pp in (4, 8) if quick else (4, 8, 16):
        for schedule in ("ScheduleVHalf", "ScheduleInterleaved1F1B"):
            rows = evaluate(
                LLAMA_70B, machine="H100", seq=8192, pp=pp, m=2 * pp, schedule=schedule, policies=NEW
            )
            for row in rows:
                row["pp"] = pp
            out["part_b"] += rows
            print(f"  70B pp {pp} {SHORT[schedule]}: done", file=sys.stderr)
    return out


def _row_text(r: dict) -> str:
    need = " ".join(f"{k}:{v:.2f}" for k, v in r["need_ratio"].items())
    return (
        f"{r['policy']:<17}{r['activation_gib']:>8.1f}{100 * r['cut']:>7.1f}%{1e3 * r['step_s']:>9.0f}"
        f"{100 * r['slowdown']:>+8.1f}%{100 * r['moved_share']:>8.1f}%{r['link_capacity_gib']:>9.1f}"
        f"{r['rank_saved_gib']:>10.1f}  {need}"
    )


def report(out: dict[str, Any]) -> str:
    lines = []
    head = (
        f"{'policy':<17}{'act GiB':>8}{'cut':>8}{'step ms':>9}{'slower':>9}{'moved':>9}{'cap GiB':>9}"
        f"{'saved GiB':>10}  need/cap for a 30% / 50% cut"
    )
    for part, title in (("part_a", "H100"), ("part_gh200", "GH200")):
        groups: dict[tuple, list[dict]] = {}
        for r in out[part]:
            groups.setdefault((r["seq"], r["schedule"]), []).append(r)
        for (seq, schedule), rows in groups.items():
            lines.append(f"\nLlama-3-8B, {title}, pp 4, m 16, seq {seq}, {schedule}")
            lines += [head, "-" * len(head)]
            lines += [_row_text(r) for r in rows]
            for slowdown, cut in TARGETS:
                best = best_within(rows, slowdown)
                verdict = "MET" if best["cut"] >= cut else "missed"
                need = best["need_ratio"][f"{cut:.0%}"]
                bound = (
                    f"; bound: a {cut:.0%} cut moves {cut * best['rank_saved_gib']:.1f} GiB each way, the "
                    f"link carries {best['link_capacity_gib']:.1f} GiB per direction in the step "
                    f"(need/cap {need:.2f})"
                    if verdict == "missed"
                    else ""
                )
                lines.append(
                    f"target cut >= {cut:.0%} at <= +{slowdown:.0%}: best {best['policy']} cuts "
                    f"{100 * best['cut']:.1f}% at {100 * best['slowdown']:+.1f}% -> {verdict}{bound}"
                )
    lines.append(
        "\nLlama-3-70B, H100, seq 8192, m = 2 pp: activation peak per rank (GiB), none vs best within +10%"
    )
    head = (
        f"{'schedule':<17}{'pp':>4}{'none':>8}{'best':>8}{'policy':>18}{'slower':>9}{'cut':>8}"
        f"{'need/cap 50%':>14}"
    )
    lines += [head, "-" * len(head)]
    groups = {}
    for r in out["part_b"]:
        groups.setdefault((r["schedule"], r["pp"]), []).append(r)
    for (schedule, pp), rows in groups.items():
        best = best_within(rows, 0.10)
        lines.append(
            f"{schedule:<17}{pp:>4}{rows[0]['activation_gib']:>8.1f}{best['activation_gib']:>8.1f}"
            f"{best['policy']:>18}{100 * best['slowdown']:>+8.1f}%{100 * best['cut']:>7.1f}%"
            f"{best['need_ratio']['50%']:>14.2f}"
        )
    lines.append(
        "\ncolumns: cut = 1 - peak / peak without offload; slower = step time vs without offload; moved = "
        "share of the step's saved bytes copied out (and back); cap = GiB one direction of the host link "
        "carries in the step; saved = GiB the busiest rank's chunks save in the step; need/cap = (cut x "
        "saved) / cap"
    )
    return "\n".join(lines)


def plot(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seqs = sorted({r["seq"] for r in out["part_a"]})
    fig, axes = plt.subplots(1, len(seqs) + 1, figsize=(6 * (len(seqs) + 1), 5))
    markers = {"none": "o", "selective:0.5": "s", "full": "X"}
    for ax, seq in zip(axes, seqs, strict=False):
        for schedule in SHORT.values():
            rows = [r for r in out["part_a"] if r["seq"] == seq and r["schedule"] == schedule]
            if not rows:
                continue
            line = ax.plot(
                [
                    100 * r["slowdown"]
                    for r in rows
                    if r["policy"].startswith("budget") or r["policy"] == "none"
                ],
                [
                    r["activation_gib"]
                    for r in rows
                    if r["policy"].startswith("budget") or r["policy"] == "none"
                ],
                ".",
                label=f"{schedule} none / budget",
            )[0]
            for r in rows:
                if r["policy"] in markers:
                    ax.scatter(
                        100 * r["slowdown"],
                        r["activation_gib"],
                        marker=markers[r["policy"]],
                        color=line.get_color(),
                        s=40,
                    )
        ax.set_xlim(-2, 50)  # policies costing more than +50% are off the chart (see the table)
        ax.axvline(3, color="grey", ls=":")
        ax.axvline(10, color="grey", ls="--")
        ax.set_xlabel("step time vs no offload (%)")
        ax.set_ylabel("activation peak per rank (GiB)")
        ax.set_title(f"Llama-3-8B, H100, pp 4, m 16, seq {seq}\n(squares: selective:0.5, crosses: full)")
        ax.legend(fontsize=8)
    ax = axes[-1]
    for schedule in ("V-Half", "Interleaved1F1B"):
        pps = sorted({r["pp"] for r in out["part_b"] if r["schedule"] == schedule})
        none = [
            next(r for r in out["part_b"] if r["schedule"] == schedule and r["pp"] == p)["activation_gib"]
            for p in pps
        ]
        best = [
            best_within([r for r in out["part_b"] if r["schedule"] == schedule and r["pp"] == p], 0.10)[
                "activation_gib"
            ]
            for p in pps
        ]
        line = ax.plot(pps, none, "o-", label=f"{schedule} none")[0]
        ax.plot(pps, best, "s--", color=line.get_color(), label=f"{schedule} best within +10%")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("pp")
    ax.set_ylabel("activation peak per rank (GiB)")
    ax.set_title("Llama-3-70B, H100, seq 8192, m = 2 pp")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--from-json", type=Path)
    args = parser.parse_args(argv)
    if args.from_json:
        data = json.loads(args.from_json.read_text())
        out = data["results"]
    else:
        start = time.perf_counter()
        out = run(args.quick)
        data = {
            "bench": "offload_scale",
            "quick": args.quick,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "python": platform.python_version(),
            "seconds": time.perf_counter() - start,
            "results": out,
        }
    print(report(out))
    args.out.mkdir(parents=True, exist_ok=True)
    name = "offload_scale_quick" if data.get("quick") else "offload_scale"
    if not args.from_json:
        (args.out / f"{name}.json").write_text(json.dumps(data, indent=1))
    plot(out, args.out / f"{name}.png")
    print(f"\nwrote {args.out / (name + '.json')} and {args.out / (name + '.png')}")


if __name__ == "__main__":
    main()
