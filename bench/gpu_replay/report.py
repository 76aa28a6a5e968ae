"""The replay's results (`bench/bench_gpu_replay.py`): tables against the planner and the simulator, the
plot, the JSON written after every configuration, the commit measured, and re-predicting a committed
measurement."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .predict import planner_prediction
from .rank import GIB, TINY_SHAPE, Config


def plot(records: list[dict[str, Any]], path: Path, meta: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with_copies = [r for r in records if r.get("copies", {}).get("lanes", {}).get("D2H")]
    rows = len(with_copies) + 1
    fig, axes = plt.subplots(rows, 1, figsize=(12, 2.2 * rows), squeeze=False)
    ax = axes[0][0]
    for r in records:
        tl = r.get("memory_timeline") or []
        if tl:
            ax.plot([b / GIB for _, b in tl], label=Config(**r["config"]).label, lw=1)
    ax.set_ylabel("allocated GiB")
    ax.set_xlabel("action of one step")
    if ax.get_lines():
        ax.legend(fontsize=6, ncol=2)
    else:
        ax.text(0.5, 0.5, "no CUDA memory timeline (CPU run)", ha="center", transform=ax.transAxes)
    ax.set_title(f"{meta['device']}, torch {meta['torch']}: memory after every action (rank {meta['rank']})")
    colours = {"compute": "tab:blue", "D2H": "tab:orange", "H2D": "tab:green"}
    for ax, r in zip([a[0] for a in axes[1:]], with_copies, strict=True):
        lanes = r["copies"]["lanes"]
        for y, lane in enumerate(("compute", "D2H", "H2D")):
            ax.broken_barh(lanes[lane], (y - 0.4, 0.8), color=colours[lane])
        ax.set_yticks(range(3), ["compute", "D2H", "H2D"])
        c = r["copies"]
        ax.set_title(
            f"{Config(**r['config']).label}: D2H {c['d2h_overlapped']:.0%} / H2D "
            f"{c['h2d_overlapped']:.0%} of copy time under compute",
            fontsize=8,
        )
        ax.set_xlabel("ms")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _pct(x: float | None) -> str:
    return "-" if x is None or x != x else f"{x:+.1%}"


def tables(records: list[dict[str, Any]]) -> str:
    """Memory against the planner, and time (paced: the rank waits for its peers as simulated) against the
    simulator, each offload/recompute row against its schedule's plain row."""
    base = {
        r["config"]["schedule"]: r
        for r in records
        if r["config"]["offload"] == "none" and r["config"]["recompute"] == "none"
    }
    mem = [
        "| schedule / offload / recompute | activations GiB measured | planner | off by | "
        "whole GiB measured | planner | off by |",
        "|" + "---|" * 7,
    ]
    tim = [
        "| schedule / offload / recompute | alone ms | paced ms | simulated ms | paced overhead | "
        "predicted overhead | D2H under compute | H2D under compute |",
        "|" + "---|" * 8,
    ]
    for r in records:
        c, p = r["config"], r["predicted"]
        label = Config(**c).label
        act_pred = p["activation_bytes"] + p["transient_bytes"]
        whole_pred = act_pred + p["params_bytes"] + p["grads_bytes"] + p["recv_buffer_bytes"]
        act, peak, state = r["above_held_bytes"], r["peak_bytes"], r.get("state_bytes")
        whole = None if peak is None or state is None else peak - r["held_bytes"] + state
        mem.append(
            f"| {label} | {'-' if act is None else f'{act / GIB:.2f}'} | {act_pred / GIB:.2f} | "
            f"{_pct(None if not act else act_pred / act - 1)} | "
            f"{'-' if whole is None else f'{whole / GIB:.2f}'} | {whole_pred / GIB:.2f} | "
            f"{_pct(None if not whole else whole_pred / whole - 1)} |"
        )
        b = base.get(c["schedule"])
        sim_off = r.get("simulated_offload")
        sim_ms = (sim_off or {}).get("makespan_s", r["simulated_makespan_s"])
        measured_over = r["paced_step_s"] / b["paced_step_s"] - 1 if b else None
        predicted_over = sim_ms / b["simulated_makespan_s"] - 1 if b else None
        copies = r.get("copies") or {}
        tim.append(
            f"| {label} | {r['step_s'] * 1e3:.0f} | {r['paced_step_s'] * 1e3:.0f} | {sim_ms * 1e3:.0f} | "
            f"{_pct(measured_over)} | {_pct(predicted_over)} | "
            f"{copies.get('d2h_overlapped', float('nan')):.0%} | "
            f"{copies.get('h2d_overlapped', float('nan')):.0%} |"
        )
    return "\n".join(mem) + "\n\n" + "\n".join(tim)


def compiled_table(eager: list[dict[str, Any]], compiled: list[dict[str, Any]]) -> str:
    """Each compiled row beside the eager row of the same configuration, rank and model: paced step times
    and their ratio, activation bytes above the held state, the first step's compile time and the graphs
    compiled after it (recompilations: 0 expected); and each row's paced step over eager V-Half's
    without offload, so our V schedules and torch's read off one column, eager and compiled."""
    by_config = {tuple(r["config"].values()): r for r in eager if "paced_step_s" in r}
    reference = by_config.get(("ScheduleVHalf", "none", "none"))
    lines = [
        "| schedule / offload / recompute | eager paced ms | compiled paced ms | compiled / eager | "
        "eager x V-Half | compiled x V-Half | activations GiB eager | compiled | compile s | recompiled |",
        "|" + "---|" * 10,
    ]

    def gib(r: dict[str, Any] | None) -> str:
        return "-" if r is None or r.get("above_held_bytes") is None else f"{r['above_held_bytes'] / GIB:.2f}"

    def over(r: dict[str, Any] | None) -> str:
        if r is None or reference is None:
            return "-"
        return f"{r['paced_step_s'] / reference['paced_step_s']:.2f}"

    for r in compiled:
        e = by_config.get(tuple(r["config"].values()))
        ratio = "-" if e is None else f"{r['paced_step_s'] / e['paced_step_s']:.2f}"
        eager_ms = "-" if e is None else f"{e['paced_step_s'] * 1e3:.0f}"
        comp = r.get("compile", {})
        lines.append(
            f"| {Config(**r['config']).label} | {eager_ms} | "
            f"{r['paced_step_s'] * 1e3:.0f} | {ratio} | {over(e)} | {over(r)} | {gib(e)} | {gib(r)} | "
            f"{comp.get('first_step_s', float('nan')):.0f} | {comp.get('graphs_after_first_step', '-')} |"
        )
    return "\n".join(lines)


def replan(path: Path) -> int:
    """The planner's predictions again, for the measurements in ``path`` (same shape, split, machine preset,
    calibrated mfu and measured host bandwidth): how a change of the planner's model moves its error."""
    from pp_offload.plan.shapes import shape as known_shape

    data = json.loads(path.read_text())
    meta = data["meta"]
    shape = dict(TINY_SHAPE) if meta["model"] == "tiny" else known_shape(meta["model"])
    bw = meta["host_bandwidth_Bps"]
    mean_bw = (bw["d2h"] + bw["h2d"]) / 2
    records = []
    for record in data["records"]:
        if "error" in record or "skipped" in record or "started" in record:
            continue
        record = dict(record)
        record["predicted"] = planner_prediction(
            shape,
            Config(**record["config"]),
            pp=meta["pp"],
            seq=meta["seq"],
            microbatches=meta["microbatches"],
            machine=meta["machine_preset"],
            host_bandwidth=None if mean_bw != mean_bw else mean_bw,
            rank=meta["rank"],
            mfu=meta["calibrated_mfu"],
        )
        records.append(record)
    print(
        f"{meta['device']}, torch {meta['torch']}, {meta['model']}, seq {meta['seq']}: measured then; "
        "planned now"
    )
    print(tables(records))
    return 0


def git_commit() -> str:
    """The commit measured: ``git rev-parse HEAD`` (``+dirty`` with uncommitted changes), else the
    ``PP_OFFLOAD_COMMIT`` environment variable (a device machine may get the working tree without .git)."""
    import subprocess

    root = Path(__file__).resolve().parents[2]  # the repository (bench/gpu_replay/report.py)
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root, capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()  # fmt: skip
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("PP_OFFLOAD_COMMIT") or "unknown (no git; set PP_OFFLOAD_COMMIT)"


def write_results(out: Path, name: str, meta: dict[str, Any], records: list[dict[str, Any]]) -> Path:
    """The results so far, replaced atomically: written after every configuration, so a run killed by its
    time limit still leaves every finished configuration on disk."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    tmp.replace(path)
    return path
