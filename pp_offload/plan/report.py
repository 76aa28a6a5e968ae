"""The planner's output: the answer (`format_summary`: the pick, a few alternatives, why, and the recipe
YAML that applies it), the whole ranked table (`format_table`, ``--all``) and a picture (``--plot``).

Why a summary first: the planner weighs a hundred candidates or more, and a user asks one question, what to
write in the config. The summary answers it in a screenful; the table stays one flag away.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pp_offload.plan.result import Candidate, PlanResult

__all__ = [
    "NEAR_TIE",
    "WIDTH",
    "format_summary",
    "format_table",
    "plot_plan",
    "recipe_settings",
    "recipe_yaml",
]

GIB = 1 << 30
WIDTH = 100
"""Prose lines are wrapped to this many characters."""
NEAR_TIE = 0.02
"""An alternative within this share of the pick's step time is named a near tie: the model's error is
larger than that, so it is as good a choice when it suits better (less memory, a simpler schedule)."""
_RECIPE_PRECISION = {"bf16": "bf16", "fp32": "fp32"}


def _wrap(text: str, indent: str = "  ") -> list[str]:
    """``text`` as lines of at most `WIDTH` characters, continuation lines indented."""
    return textwrap.wrap(text, width=WIDTH, subsequent_indent=indent, break_on_hyphens=False) or [""]


def _seconds(t: float) -> str:
    return f"{t:.3g} s" if t >= 1 else f"{1e3 * t:.3g} ms"


def _same_figures(a: Candidate, b: Candidate) -> bool:
    """Two schedules that give one plan (V-ZB and torch's ZBV: the same order under two names)."""
    return (
        a.offload == b.offload
        and a.recompute == b.recompute
        and a.step_time == b.step_time
        and a.memory == b.memory
        and a.activation == b.activation
    )


def _alternatives(result: PlanResult, best: Candidate | None, limit: int) -> tuple[list, list[str]]:
    """Up to ``limit`` candidates after ``best`` (fitting, not useless; when nothing fits, the closest),
    each with the names of schedules with the same figures, which are not listed again."""
    if best is not None:
        pool = [c for c in result.candidates if c.evaluated and c.fits and c.useless is None]
    else:
        pool = sorted((c for c in result.candidates if c.evaluated), key=lambda c: c.peak_bytes)
    shown: list[tuple[Candidate, list[str]]] = []
    for c in pool:
        if c is best:
            continue
        if best is not None and _same_figures(c, best):
            continue
        twin = next((entry for entry in shown if _same_figures(entry[0], c)), None)
        if twin is not None:
            twin[1].append(c.name)
            continue
        if len(shown) == limit:
            break
        shown.append((c, []))
    same_as_best = [c.name for c in pool if best is not None and c is not best and _same_figures(c, best)]
    return shown, same_as_best


def recipe_settings(result: PlanResult, candidate: Candidate | None = None) -> dict[str, dict[str, Any]]:
    """The recipe config sections (`pp_offload.recipe.config`) that run ``candidate`` (default: the pick)
    in the planned setting: schedule, pipeline and data-parallel sizes, offload, recompute, batch, sequence
    length, precision, LoRA rank."""
    c = candidate if candidate is not None else result.recommended
    if c is None:
        raise ValueError("nothing is recommended: no candidate fits")
    s = result.settings
    pipeline: dict[str, Any] = {"schedule": c.schedule, "pp": s["pp"], "dp": s["dp"]}
    pipeline["microbatches"] = s["num_microbatches"]
    if c.schedule == "ScheduleVAdaptive" and c.memory_limit is not None:
        pipeline["memory_limit"] = round(float(c.memory_limit), 4)
    placement = result.schedules.get(c.schedule, {}).get("placement")
    if placement == "loop" and s.get("virtual_stages", 2) != 2:
        pipeline["stages_per_rank"] = s["virtual_stages"]
    if c.offload != "none":
        pipeline["offload"] = c.offload
    if s.get("deferred_w") is False and _splits_backward(c.schedule):
        pipeline["deferred_w"] = False  # planned under torch's retained-graph split (--split torch)
    train: dict[str, Any] = {
        "global_batch_size": s["microbatch_size"] * s["num_microbatches"] * s["dp"],
        "activation_checkpointing": c.recompute if c.recompute != "none" else False,
    }
    if s["dtype"] in _RECIPE_PRECISION:
        train["precision"] = _RECIPE_PRECISION[s["dtype"]]
    out: dict[str, dict[str, Any]] = {
        "pipeline": pipeline,
        "train": train,
        "data": {"seq_len": s["seq_len"]},
    }
    if s.get("lora_rank"):
        out["lora"] = {"r": s["lora_rank"]}
    return out


def recipe_yaml(result: PlanResult, candidate: Candidate | None = None, *, model: str | None = None) -> str:
    """`recipe_settings` as the YAML block of a recipe config (what `pp_offload.recipe.load_config` reads);
    ``model``: the planner's ``--model`` argument, written as ``model.path`` when it names a model directory
    or a hub id (a config file or an offline shape name is left as a comment)."""
    import yaml

    from pp_offload.plan.shapes import SHAPES

    sections = recipe_settings(result, candidate)
    lines: list[str] = []
    if model is not None:
        if model.lower() in SHAPES or model.endswith(".json"):
            lines.append(f"# model: path: (your model; planned as {model})")
        else:
            lines += yaml.safe_dump({"model": {"path": model}}, sort_keys=False).splitlines()
    if result.settings["dtype"] not in _RECIPE_PRECISION:
        lines.append(
            f"# train.precision: planned in {result.settings['dtype']}, the recipe runs bf16 or fp32"
        )
    lines += yaml.safe_dump(sections, sort_keys=False, default_flow_style=False).splitlines()
    return "\n".join(lines)


def _setting_lines(result: PlanResult) -> list[str]:
    """The heading both outputs start with: the model, the run's shape and the machine, then a blank line."""
    s, m = result.settings, result.machine
    lines = _wrap(f"pp-offload plan: {s['model']}")
    lines += _wrap(
        f"seq {s['seq_len']} x microbatch {s['microbatch_size']}, {s['num_microbatches']} microbatches, "
        f"pp {s['pp']}, dp {s['dp']}{' (sharded optimizer)' if s['dp_shard'] else ''}, {s['dtype']}; "
        f"{m.name}: {m.flops / 1e12:g} TFLOP/s x MFU {m.mfu:g}, host link {m.host_bandwidth / 1e9:g} GB/s, "
        f"{s['gpu_memory_gib']:g} GiB per GPU"
        + (
            "; split-backward schedules on torch's retained-graph split"
            if s.get("deferred_w") is False
            else ""
        )
    )
    lines.append("")
    return lines


def _splits_backward(schedule: str) -> bool:
    from pp_offload.runtime.catalog import schedule_info

    return schedule_info(schedule).split_backward


def _split_line(result: PlanResult) -> str | None:
    """The pick against itself under the other backward split (`PlanResult.other_split`), in one sentence
    saying which gives the lower activation peak and at what step time; None when there is nothing to
    weigh (no recompute, no split backward)."""
    best, other = result.recommended, result.other_split
    if best is None or other is None or not best.activation_peak:
        return None
    torch_other = result.settings.get("deferred_w", True)  # the other split is torch's
    name = (
        "torch's retained-graph split (--split torch, pipeline.deferred_w: false)"
        if torch_other
        else ("deferred weight gradients (--split deferred, pipeline.deferred_w: true)")
    )
    lower = other.activation_peak < best.activation_peak
    step = (
        f"{100 * (other.step_time / best.step_time - 1):+.1f}%" if other.step_time and best.step_time else "?"
    )
    verdict = "the lower peak" if lower else "no lower peak"
    fits = "" if other.fits else f", which does not fit ({other.over_bytes / GIB:.1f} GiB over)"
    return (
        f"split: under {name} this pick's activation peak is {other.activation_peak / GIB:.1f} GiB instead "
        f"of {best.activation_peak / GIB:.1f} (device peak {other.peak_bytes / GIB:.1f} GiB instead of "
        f"{best.peak_bytes / GIB:.1f}), its step {step}{fits}: {verdict}"
    )


def format_summary(
    result: PlanResult, *, model: str | None = None, alternatives: int = 5, reason: bool = True
) -> str:
    """The answer in a screenful: the setting, the pick with its figures, up to ``alternatives`` runners-up
    (near ties, within `NEAR_TIE` of its step time, named so), one line of why, and the recipe YAML that
    applies the pick. When nothing fits: the closest candidates and, with ``reason``, what would fit (the
    command line prints that as its error instead)."""
    s = result.settings
    lines = _setting_lines(result)
    best = result.recommended
    ref = _reference(result)
    limit = s["gpu_memory_gib"]
    if best is not None:
        ratio = (
            f" ({best.activation_peak / ref.activation_peak:.2f}x 1F1B's)"
            if ref and ref.activation_peak
            else ""
        )
        lines += _wrap(f"recommended: {best.label}")
        lines += _wrap(
            f"  {_seconds(best.step_time)} per step, bubble {100 * best.bubble:.1f}%, activation peak "
            f"{best.activation_peak / GIB:.1f} GiB{ratio}, device peak {best.peak_bytes / GIB:.1f} of "
            f"{limit:g} GiB (rank {best.peak_rank})",
            indent="    ",
        )
        lines += _wrap("why: " + _why(result, best))
        weighed = _split_line(result)
        if weighed is not None:
            lines += _wrap(weighed)
    else:
        lines += _wrap(f"no recommendation: {result.reason}" if reason else "no recommendation: nothing fits")
    shown, twins = _alternatives(result, best, alternatives)
    if shown:
        lines.append("")
        if best is not None:
            lines.append(f"alternatives (near tie: within {100 * NEAR_TIE:g}% of the pick's step time):")
        else:
            lines.append("closest candidates (none fits):")
        rows = []
        for c, _ in shown:
            if best is not None:
                delta = f"{100 * (c.step_time / best.step_time - 1):+.1f}%"
                note = "near tie" if c.step_time <= best.step_time * (1 + NEAR_TIE) else ""
            else:
                delta, note = _seconds(c.step_time), f"{c.over_bytes / GIB:.1f} GiB over"
            rows.append((c.name, c.offload, c.recompute, delta, f"{c.peak_bytes / GIB:.1f}", note))
        head = ("schedule", "offload", "recompute", "vs pick" if best else "step", "device peak GiB", "")
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
        for r in [head, *rows]:
            cells = [f"{r[i]:<{widths[i]}}" for i in (0, 1, 2)] + [f"{r[i]:>{widths[i]}}" for i in (3, 4)]
            lines.append(("  " + "  ".join(cells) + "  " + r[5]).rstrip())
    same = [f"{name} = {c.name}" for c, names in shown for name in names]
    if twins and best is not None:
        same.insert(0, ", ".join(twins) + f" = {best.name}")
    if same:
        lines += _wrap("  the same plans under other names: " + "; ".join(same), indent="    ")
    if best is not None:
        lines.append("")
        lines.append("apply it: in the recipe's YAML config (or as --set section.key=value)")
        lines += recipe_yaml(result, model=model).splitlines()
    lines.append("")
    lines += _wrap(
        f"{sum(c.evaluated for c in result.candidates)} candidates evaluated; --all prints them all, --json "
        "FILE writes every number, --plot FILE draws them."
    )
    return "\n".join(lines)


def _why(result: PlanResult, best: Candidate) -> str:
    """One sentence: why the pick, against the candidates that are faster but do not fit."""
    fitting = sum(1 for c in result.candidates if c.evaluated and c.fits and c.useless is None)
    text = f"the fastest of the {fitting} candidates that fit in {result.settings['gpu_memory_gib']:g} GiB"
    faster = [c for c in result.candidates if c.evaluated and not c.fits and c.step_time < best.step_time]
    if faster:
        top = min(faster, key=lambda c: c.step_time)
        gain = 100 * (1 - top.step_time / best.step_time)
        text += (
            f"; {len(faster)} faster ones do not fit, the fastest ({top.label}, {gain:.0f}% faster) by "
            f"{top.over_bytes / GIB:.1f} GiB"
        )
    return text


def _reference(result: PlanResult) -> Candidate | None:
    """1F1B without offload, the memory every schedule is compared with, when it was evaluated."""
    for c in result.candidates:
        if c.schedule == "Schedule1F1B" and c.offload == "none" and c.recompute == "none" and c.evaluated:
            return c
    return None


def format_table(result: PlanResult) -> str:
    """Every candidate, ranked (``--all``): one table row each (rows are as wide as the table), the
    candidates not replayed and never recommended by reason, the pick and why, the columns' meaning and the
    model's assumptions, prose wrapped to `WIDTH`."""
    lines = _setting_lines(result)
    ref = _reference(result)
    head = (
        f"{'#':>3}  {'schedule':<31}{'offload':<16}{'recompute':<10}{'step ms':>9}{'bubble':>8}"
        f"{'act units':>11}{'act peak GiB':>13}{'x 1F1B':>8}{'device peak GiB (rank)':>24}  fits"
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
            f"{100 * c.bubble:>7.1f}%{round(c.peak_unit, 1):>11g}{c.activation_peak / GIB:>13.2f}{ratio:>8}"
            f"{c.peak_bytes / GIB:>18.1f} ({c.peak_rank:>2})  {fits}"
        )
    by_reason: dict[str, list[str]] = {}
    for c in skipped:
        name = c.name if c.recompute == "none" else f"{c.name} ({c.recompute} recompute)"
        names = by_reason.setdefault(c.skipped, [])
        if name not in names:
            names.append(name)
    for reason, names in by_reason.items():
        lines += _wrap(f"offload / recompute not replayed ({reason}): " + ", ".join(names))
    for reason, labels in idle.items():
        lines += _wrap(f"offload / recompute never recommended, {reason}: " + "; ".join(labels))
    lines.append("")
    if result.recommended is not None:
        lines += _wrap(f"recommended: {result.recommended.label}")
        lines += _wrap(f"why: {result.reason}")
        weighed = _split_line(result)
        if weighed is not None:
            lines += _wrap(weighed)
    else:
        lines += _wrap(f"no recommendation: {result.reason}")
    lines += _wrap(
        "columns: step ms = pipeline + dp gradient sync; bubble = 1 - busiest rank's compute / step; "
        "recompute = activation checkpointing of the decoder layers (selective: the elementwise ops, full: "
        "whole layers); act units = peak activation chunks per rank (1F1B: 2*min(pp, m)); act peak GiB = "
        "activation peak, the most saved-activation bytes on the device at once (fullest rank), x 1F1B "
        "relative to 1F1B without offload; device peak = the whole device memory of the fullest rank at its "
        "activation peak (parameters, gradients, optimizer, receive buffers, transient, reserve)"
    )
    lines += _wrap("assumptions: " + "; ".join(result.assumptions))
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
