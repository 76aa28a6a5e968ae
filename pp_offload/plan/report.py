"""The planner's output: a ranked text table and a picture (``--plot``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pp_offload.plan.planner import Candidate, PlanResult

__all__ = ["format_table", "plot_plan"]

GIB = 1 << 30


def _reference(result: PlanResult) -> Candidate | None:
    """1F1B without offload, the memory every schedule is compared with, when it was evaluated."""
    for c in result.candidates:
        if c.schedule == "Schedule1F1B" and c.offload == "none" and c.recompute == "none" and c.evaluated:
            return c
    return None


def format_table(result: PlanResult) -> str:
    s, m = result.settings, result.machine
    lines = [
        f"pp-offload plan: {s['model']}",
        f"seq {s['seq_len']} x microbatch {s['microbatch_size']}, {s['num_microbatches']} microbatches, "
        f"pp {s['pp']}, dp {s['dp']}{' (sharded optimizer)' if s['dp_shard'] else ''}, {s['dtype']}; "
        f"{m.name}: {m.flops / 1e12:g} TFLOP/s x MFU {m.mfu:g}, host link {m.host_bandwidth / 1e9:g} GB/s, "
        f"{s['gpu_memory_gib']:g} GiB per GPU",
        "",
    ]
    ref = _reference(result)
    head = (
        f"{'#':>3}  {'schedule':<31}{'offload':<16}{'recompute':<10}{'step ms':>9}{'bubble':>8}"
        f"{'act units':>11}{'act GiB':>9}{'x 1F1B':>8}{'peak GiB (rank)':>17}  fits"
    )
    lines += [head, "-" * len(head)]
    idle: dict[str, list[str]] = {}
    skipped: list[Candidate] = []
    k = 0
    for c in result.candidates:
        if c.skipped is not None:
            skipped.append(c)
            continue
        if c.error is not None:
            lines.append(f"{'-':>3}  {c.name:<31}{c.offload:<16}{c.recompute:<10}  not evaluated: {c.error}")
            continue
        if c.useless is not None:
            if c.useless.startswith("moves nothing"):
                idle.setdefault("it moves nothing (no window hides a copy)", []).append(_short(c))
            else:
                cost = c.useless.split(" step time")[0]
                idle.setdefault("it costs step time without lowering the activation peak", []).append(
                    f"{_short(c)} ({cost})"
                )
            continue
        ratio = f"{c.activation_peak / ref.activation_peak:.2f}" if ref and ref.activation_peak else "-"
        fits = "yes" if c.fits else f"no (+{c.over_bytes / GIB:.1f})"
        k += 1
        mark = "*" if c is result.recommended else " "
        lines.append(
            f"{k:>3}{mark} {c.name:<31}{c.offload:<16}{c.recompute:<10}{1e3 * c.step_time:>9.4g}"
            f"{100 * c.bubble:>7.1f}%{c.peak_unit:>11g}{c.activation_peak / GIB:>9.2f}{ratio:>8}"
            f"{c.peak_bytes / GIB:>11.1f} ({c.peak_rank:>2})  {fits}"
        )
    by_reason: dict[str, list[str]] = {}
    for c in skipped:
        name = c.name if c.recompute == "none" else f"{c.name} ({c.recompute} recompute)"
        names = by_reason.setdefault(c.skipped, [])
        if name not in names:
            names.append(name)
    for reason, names in by_reason.items():
        lines.append(f"offload / recompute not replayed ({reason}): " + ", ".join(names))
    for reason, labels in idle.items():
        lines.append(f"offload / recompute never recommended, {reason}: " + "; ".join(labels))
    lines.append("")
    if result.recommended is not None:
        lines.append(f"recommended: {result.recommended.label}")
        lines.append(f"why: {result.reason}")
    else:
        lines.append(f"no recommendation: {result.reason}")
    lines.append(
        "columns: step ms = pipeline + dp gradient sync; bubble = 1 - busiest rank's compute / step; "
        "recompute = activation checkpointing of the decoder layers (selective: the elementwise ops, full: "
        "whole layers); act units = peak activation chunks per rank (1F1B: 2*min(pp, m)); act GiB = peak "
        "activation bytes, x 1F1B relative to 1F1B without offload; peak = whole memory of the fullest rank"
    )
    lines.append("assumptions: " + "; ".join(result.assumptions))
    return "\n".join(lines)


def _short(c: Candidate) -> str:
    return f"{c.name} {c.offload}" + (f" {c.recompute} recompute" if c.recompute != "none" else "")


def plot_plan(result: PlanResult, path: str | os.PathLike[str]) -> Path:
    """Two panels: every candidate's step time against its peak memory (GPU memory as a line, the
    recommendation starred), and the memory of every rank, by part, for the recommended candidate (or the
    closest to fitting), with the per-rank totals of the next few candidates as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ok = [c for c in result.candidates if c.evaluated]
    limit = result.settings["gpu_memory_gib"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, 6.2))
    schedules = list(dict.fromkeys(c.name for c in ok))
    policies = list(dict.fromkeys(c.offload for c in ok))
    colours = plt.get_cmap("tab20")
    markers = ["o", "s", "^", "D", "v", "P", "X"]
    for c in ok:
        ax1.scatter(
            c.step_time,
            c.peak_bytes / GIB,
            color=colours(schedules.index(c.name) % 20),
            marker=markers[policies.index(c.offload) % len(markers)],
            s=60,
            edgecolors="black" if c.fits else "none",
            zorder=3,
        )
    if result.recommended is not None:
        r = result.recommended
        ax1.scatter(
            r.step_time, r.peak_bytes / GIB, marker="*", s=400, color="gold", edgecolors="black", zorder=4
        )
        ax1.annotate(
            f"recommended: {r.label}",
            (r.step_time, r.peak_bytes / GIB),
            xytext=(8, 8),
            textcoords="offset points",
            fontsize=8,
        )
    ax1.axhline(limit, color="red", linestyle="--", linewidth=1)
    ax1.text(ax1.get_xlim()[0], limit, f" {limit:g} GiB per GPU", color="red", va="bottom", fontsize=8)
    for i, name in enumerate(schedules):
        ax1.scatter([], [], color=colours(i % 20), marker="o", label=name)
    for i, pol in enumerate(policies):
        ax1.scatter(
            [],
            [],
            facecolor="white",
            edgecolors="black",
            marker=markers[i % len(markers)],
            label=f"offload {pol}",
        )
    ax1.legend(fontsize=7, loc="upper right", ncol=2)
    ax1.set_xlabel("predicted step time (s)")
    ax1.set_ylabel("peak memory of the fullest rank (GiB)")
    ax1.set_title("candidates (black edge: fits)")
    ax1.grid(alpha=0.3)

    focus = result.recommended or (min(ok, key=lambda c: c.peak_bytes) if ok else None)
    if focus is not None:
        ranks = list(range(len(focus.memory)))
        bottom = [0.0] * len(ranks)
        groups = (
            ("parameters + grads + optimizer", ("params", "grads", "optimizer"), "#3b75af"),
            ("receive buffers", ("recv_buffers",), "#9a9a9a"),
            ("activations (peak)", ("activations",), "#ef8636"),
            ("transient + reserve", ("transient", "reserve"), "#d9d9d9"),
        )
        for label, keys, colour in groups:
            values = [sum(focus.breakdown[r][k] for k in keys) / GIB for r in ranks]
            ax2.bar(ranks, values, bottom=bottom, color=colour, label=label, width=0.8)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        others: list[Candidate] = []  # the next candidates whose memory differs from those already drawn
        for c in ok:
            if len(others) == 3:
                break
            if c is not focus and all(c.memory != o.memory for o in [focus, *others]):
                others.append(c)
        for c in others:
            ax2.plot(ranks, [x / GIB for x in c.memory], marker=".", linewidth=1, label=f"total: {c.label}")
        ax2.axhline(limit, color="red", linestyle="--", linewidth=1)
        ax2.set_xlabel("pipeline rank")
        ax2.set_ylabel("GiB")
        ax2.set_title(f"memory per rank: {focus.label}")
        ax2.xaxis.get_major_locator().set_params(integer=True)
        ax2.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2)
        ax2.grid(alpha=0.3, axis="y")
    s = result.settings
    fig.suptitle(
        f"{result.model.name}: seq {s['seq_len']}, microbatch {s['microbatch_size']}, "
        f"m={s['num_microbatches']}, pp={s['pp']}, dp={s['dp']}, {s['dtype']}, {result.machine.name}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
