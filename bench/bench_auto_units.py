"""``schedule: auto`` with and without sub-layer offload units: what it picks, how many candidates it
judges and how long deciding takes.

The measurement is what a probe would measure for Llama-3-8B on the H100 preset as the planner predicts
it (`pp_offload.plan.probe.predicted_measurement`: pass times from FLOPs, saved bytes per stage, a layer's
copy at the host link's rate) at pp 4, seq 4096; "without units" is the same measurement as an older
probe recorded it (no per-layer or per-unit bytes: auto cannot judge ``budget:sublayer``), "with units"
adds each layer's and sub-layer unit's bytes and the units' FLOP shares (what `measure_step` records
now). For each memory limit (a fraction of 1F1B's activation peak), `choose` runs with its defaults (every
default schedule x `DEFAULT_OFFLOAD` x `DEFAULT_RECOMPUTE`) on both; the table shows the pick, its
predicted step time and peak, the fastest fitting candidate without sub-layer units, the candidate count
and the decision's wall time (one process, one thread).

    python bench/bench_auto_units.py             # m 8 and 16, limits 0.5, 0.7 and 0.9 (~27 min, 1 core)
    python bench/bench_auto_units.py --quick     # m 8, limits 0.5 and 0.9 (~4 min)

Writes bench/results/auto_units.json and bench/results/auto_units.png (or --out DIR).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
SEQ, PP = 4096, 4
GIB = float(1 << 30)


def _run(m: int, limit: float, units: bool) -> dict[str, Any]:
    from pp_offload.plan.auto import choose, recompute_options
    from pp_offload.plan.probe import predicted_measurement
    from pp_offload.plan.shapes import SHAPES

    model = SHAPES["llama-3-8b"]
    measured = predicted_measurement(model, pp=PP, seq_len=SEQ, num_microbatches=m, units=units)
    options = recompute_options(model, seq_len=SEQ)
    start = time.perf_counter()
    decision = choose(measured, num_microbatches=m, memory_limit=limit, recompute=options)
    seconds = time.perf_counter() - start
    fitting = [c for c in decision.candidates if c.fits and c.offload != "budget:sublayer"]
    layer = min(fitting, key=lambda c: c.predicted_step_s, default=None)
    return {
        "m": m,
        "memory_limit": limit,
        "units": units,
        "candidates": len(decision.candidates),
        "decision_s": seconds,
        "pick": f"{decision.schedule} {decision.offload} recompute={decision.recompute}",
        "offload": decision.offload,
        "step_ms": decision.predicted_step_s * 1e3,
        "peak_gib": max(decision.peak_bytes) / GIB,
        "best_without_sublayer": None
        if layer is None
        else {
            "pick": f"{layer.schedule} {layer.offload} recompute={layer.recompute}",
            "step_ms": layer.predicted_step_s * 1e3,
            "peak_gib": layer.max_peak / GIB,
        },
        "notes": decision.notes,
    }


def _table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'m':>3} {'limit':>5} {'units':>5} {'cands':>5} {'decide s':>8}  {'pick':52} {'step ms':>8} "
        f"{'peak GiB':>8}  best without sub-layer units (step ms)"
    )
    lines = [head]
    for r in rows:
        other = r["best_without_sublayer"]
        best = "-" if other is None else f"{other['pick']} ({other['step_ms']:.1f})"
        lines.append(
            f"{r['m']:>3} {r['memory_limit']:>5.2f} {'yes' if r['units'] else 'no':>5} {r['candidates']:>5} "
            f"{r['decision_s']:>8.1f}  {r['pick']:52} {r['step_ms']:>8.1f} {r['peak_gib']:>8.2f}  {best}"
        )
    return "\n".join(lines)


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    labels = [f"m{r['m']} {r['memory_limit']:.1f}" for r in rows if not r["units"]]
    for units, offset, colour in ((False, -0.2, "tab:gray"), (True, 0.2, "tab:blue")):
        chosen = [r for r in rows if r["units"] == units]
        xs = [k + offset for k in range(len(chosen))]
        name = "with units" if units else "without units"
        axes[0].bar(xs, [r["step_ms"] for r in chosen], width=0.4, color=colour, label=name)
        axes[1].bar(xs, [r["decision_s"] for r in chosen], width=0.4, color=colour, label=name)
    for ax, title in zip(axes, ("predicted step of the pick (ms)", "decision time (s)"), strict=True):
        ax.set_xticks(range(len(labels)), labels)
        ax.set_title(title)
        ax.legend()
    axes[0].set_ylim(bottom=min(r["step_ms"] for r in rows) * 0.9)
    fig.suptitle(f"schedule: auto, Llama-3-8B, H100 preset, pp {PP}, seq {SEQ}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="m 8, limits 0.5 and 0.9")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    os.environ.setdefault("PP_OFFLOAD_ORDER_CACHE", "off")  # every decision searches its orders afresh
    settings = [(8, 0.5), (8, 0.9)] if args.quick else [(m, x) for m in (8, 16) for x in (0.5, 0.7, 0.9)]
    rows = [_run(m, limit, units) for m, limit in settings for units in (False, True)]
    print(_table(rows))
    args.out.mkdir(parents=True, exist_ok=True)
    report = {
        "setting": {"model": "llama-3-8b", "machine": "H100", "pp": PP, "seq_len": SEQ},
        "host": {"python": platform.python_version(), "cpus": os.cpu_count()},
        "rows": rows,
    }
    (args.out / "auto_units.json").write_text(json.dumps(report, indent=2) + "\n")
    _plot(rows, args.out / "auto_units.png")
    print(f"wrote {args.out / 'auto_units.json'} and auto_units.png")


if __name__ == "__main__":
    main()
