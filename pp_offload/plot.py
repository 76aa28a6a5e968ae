"""Pictures of pipeline schedules: who computes what, when, and how much activation memory each rank holds.

Why: a table says a schedule's bubble is 4 % and its peak memory half of 1F1B's; a timeline shows *where*
the bubble sits and *when* the memory peaks, and the same picture drawn from a real run shows whether the
runtime did what the order promised. Three entry points, all writing a PNG:

    plot_timeline(order_or_sim, "pred.png", costs=costs, title="ScheduleVHalf")   # the simulator's view
    plot_realized(events, "real.png", title="ScheduleVHalf")                      # what ActionTimer saw
    plot_side_by_side(order, events, "both.png", costs)                           # predicted above realized

Each rank is a row of boxes, one per pass: F (forward), I (input grad), W (weight grad), B (full
backward), coloured by kind and numbered by microbatch; passes of chunk 1 (stages ``>= d``: the way back up
a V, or the second loop of an interleaved placement) are a lighter shade of the same colour. Under each row
is that rank's activation memory in chunk units (one chunk = one V stage's saved activations for one
microbatch; 1F1B peaks at ``2 * min(d, m)``). OFFLOAD / RELOAD have colours reserved for activation
offload actions.

Orders may be ours (`pp_offload.order.Action`) or torch's (``_Action``, e.g. from ``schedule.pipeline_order``
or ``get_schedule_ops``), given as a mapping rank -> actions or as a list indexed by rank.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pp_offload.order.actions import Costs
from pp_offload.sim import SimResult, simulate

__all__ = [
    "KIND_COLOURS",
    "measured_costs",
    "plot_realized",
    "plot_side_by_side",
    "plot_timeline",
]

KIND_COLOURS: dict[str, str] = {
    "F": "#3b75af",  # forward
    "I": "#ef8636",  # backward w.r.t. the stage input
    "W": "#519e3e",  # backward w.r.t. the weights
    "B": "#c53a32",  # full backward (I + W)
    "OFFLOAD": "#8d69b8",  # activations to host memory (reserved for activation offload)
    "RELOAD": "#84584e",  # activations back to the device (reserved)
}
"""Pass kind -> colour of chunk 0; chunk 1 gets the same colour blended with white (`_lighter`)."""

_KIND_LABELS = {
    "F": "F forward",
    "I": "I input grad",
    "W": "W weight grad",
    "B": "B full backward",
    "OFFLOAD": "OFFLOAD",
    "RELOAD": "RELOAD",
}
_OTHER_COLOUR = "#9a9a9a"
_WAIT_COLOUR = "#d9d9d9"
_COMM_COLOUR = "#555555"
_MEMORY_COLOUR = "#6a3d9a"
_SHARE_AXIS_RATIO = 1.5
_ACTION_RE = re.compile(r"^(\d+)([A-Z_]+?)(\d*)$")
_OVERLAP_RE = re.compile(r"^\((.*)\)OVERLAP_F_B$")


# --------------------------------------------------------------------------------------------------------
# The picture's data: per rank, boxes and a memory curve, whatever they were made from


@dataclass(frozen=True)
class _Box:
    start: float
    end: float
    kind: str  # F / I / W / B / OFFLOAD / RELOAD / "wait" / "comm" / other upper-case kinds
    stage: int | None = None
    microbatch: int | None = None


@dataclass
class _Panel:
    title: str
    unit: str  # time axis unit, e.g. "ms"
    num_ranks: int
    rows: dict[int, list[_Box]]
    curves: dict[int, list[tuple[float, float]]]
    makespan: float


def _lighter(colour: str, amount: float = 0.5) -> tuple[float, float, float]:
    from matplotlib.colors import to_rgb

    r, g, b = to_rgb(colour)
    return (r + (1 - r) * amount, g + (1 - g) * amount, b + (1 - b) * amount)


def _box_colour(kind: str, stage: int | None, num_ranks: int) -> Any:
    base = KIND_COLOURS.get(kind, _OTHER_COLOUR)
    if stage is not None and stage >= num_ranks:
        return _lighter(base)
    return base


def _as_order(order: Any) -> dict[int, list[Any]]:
    if isinstance(order, Mapping):
        return {int(rank): list(actions) for rank, actions in order.items()}
    if isinstance(order, Sequence) and not isinstance(order, (str, bytes)):
        return {rank: list(actions) for rank, actions in enumerate(order)}
    raise TypeError(
        "expected an order (mapping rank -> actions, or a list of per-rank action lists) or a SimResult, "
        f"got {type(order).__name__}"
    )


def _memory_from_passes(
    passes: Iterable[tuple[int, str, float, float]], num_ranks: int, num_stages: int
) -> list[tuple[float, float]]:
    """One rank's activation memory over time, by the simulator's rule: a chunk is held from the start of
    its F to the end of its W (or B)."""
    scale = 2.0 * num_ranks / max(num_stages, 1)
    deltas = []
    for _, kind, start, end in passes:
        if kind == "F":
            deltas.append((start, scale))
        elif kind in ("W", "B"):
            deltas.append((end, -scale))
    deltas.sort(key=lambda d: (d[0], d[1]))
    level, curve = 0.0, [(0.0, 0.0)]
    for t, delta in deltas:
        level += delta
        curve.append((t, level))
    return curve


def _sim_panel(sim: SimResult, title: str, unit: str) -> _Panel:
    rows: dict[int, list[_Box]] = {}
    for rank, entries in sim.timeline.items():
        rows[rank] = [_Box(start, end, kind, stage, mb) for (stage, kind, mb), start, end in entries]
    return _Panel(title, unit, len(sim.timeline), rows, dict(sim.memory_curve), sim.makespan)


def _split_action(name: str) -> list[tuple[int, str, int | None]]:
    """``"2F0"`` -> ``[(2, "F", 0)]``; ``"(0F3;3B1)OVERLAP_F_B"`` -> both sub-actions; else ``[]``."""
    overlap = _OVERLAP_RE.match(name)
    if overlap:
        return [p for part in overlap.group(1).split(";") for p in _split_action(part)]
    match = _ACTION_RE.match(name)
    if match is None:
        return []
    stage, kind, mb = match.groups()
    return [(int(stage), kind, int(mb) if mb else None)]


def _events(events: Iterable[Any]) -> list[Any]:
    """``ActionEvent``s from events or plain ``(rank, action, start, end)`` tuples (e.g. read from JSON)."""
    from pp_offload.runtime.timing import ActionEvent

    return [ActionEvent(int(e[0]), str(e[1]), float(e[2]), float(e[3])) for e in events]


def _realized_panel(events: list[Any], title: str) -> _Panel:
    """Boxes (in ms from the first event) and memory curves from ``ActionEvent``s of one step."""
    from pp_offload.runtime.timing import action_category

    if not events:
        raise ValueError("no events to plot; record a step with pp_offload.runtime.timing.ActionTimer")
    t0 = min(e[2] for e in events)
    ranks = sorted({int(e[0]) for e in events})
    rows: dict[int, list[_Box]] = {r: [] for r in ranks}
    passes: dict[int, list[tuple[int, str, float, float]]] = {r: [] for r in ranks}
    stages: set[int] = set()
    for rank, action, start, end in events:
        start, end = (start - t0) * 1e3, (end - t0) * 1e3
        category = action_category(action)
        if category == "wait":
            rows[rank].append(_Box(start, end, "wait"))
            continue
        subs = _split_action(action)
        if category == "comm" or not subs or not all(kind in KIND_COLOURS for _, kind, _ in subs):
            # SEND/RECV and the runtime's bookkeeping (UNSHARD, RESHARD, REDUCE_GRAD, ...)
            rows[rank].append(_Box(start, end, "comm"))
            continue
        # an OVERLAP_F_B ran its sub-actions together: show them side by side in its span
        width = (end - start) / len(subs)
        for i, (stage, kind, mb) in enumerate(subs):
            s, e = start + i * width, start + (i + 1) * width
            rows[rank].append(_Box(s, e, kind, stage, mb))
            stages.add(stage)
            passes[rank].append((stage, kind, s, e))
    num_ranks = len(ranks)
    num_stages = max(stages) + 1 if stages else 2 * num_ranks
    curves = {r: _memory_from_passes(passes[r], num_ranks, num_stages) for r in ranks}
    makespan = (max(e[3] for e in events) - t0) * 1e3
    return _Panel(title, "ms", num_ranks, rows, curves, makespan)


# --------------------------------------------------------------------------------------------------------
# Drawing


def _draw_panel(fig: Any, panel: _Panel, *, memory: bool, xmax: float) -> None:
    ranks = sorted(panel.rows)
    per_rank = 2 if memory else 1
    ratios = [1.0, 0.7] * len(ranks) if memory else [1.0] * len(ranks)
    grid = fig.add_gridspec(
        per_rank * len(ranks), 1, height_ratios=ratios, hspace=0.08, left=0.09, right=0.985, top=0.86
    )
    top = max((max(level for _, level in c) for c in panel.curves.values() if c), default=1.0)
    axes = []
    for i, rank in enumerate(ranks):
        ax = fig.add_subplot(grid[per_rank * i], sharex=axes[0] if axes else None)
        axes.append(ax)
        _draw_row(ax, panel.rows[rank], panel.num_ranks, xmax)
        ax.set_ylabel(f"rank {rank}", rotation=0, ha="right", va="center", fontsize=10, fontweight="bold")
        if memory:
            mem_ax = fig.add_subplot(grid[per_rank * i + 1], sharex=axes[0])
            axes.append(mem_ax)
            _draw_memory(mem_ax, panel.curves.get(rank, [(0.0, 0.0)]), panel.makespan, top)
    for ax in axes[:-1]:
        ax.tick_params(labelbottom=False)
    axes[0].set_xlim(0, xmax * 1.01)
    axes[-1].set_xlabel(f"time ({panel.unit})")
    fig.suptitle(panel.title, fontsize=11, y=0.975)


def _draw_row(ax: Any, boxes: list[_Box], num_ranks: int, xmax: float) -> None:
    from matplotlib.patches import Rectangle

    ax.set_ylim(0, 1)
    ax.set_yticks([])
    ax.set_xlim(0, xmax * 1.01)
    for spine in ("top", "right", "left"):
        ax.spines[spine].set_visible(False)
    width_px = ax.get_window_extent().width or 1.0
    px_per_unit = width_px / (xmax * 1.01 if xmax > 0 else 1.0)
    for box in boxes:
        width = max(box.end - box.start, 0.0)
        if box.kind == "wait":
            ax.add_patch(
                Rectangle(
                    (box.start, 0.2),
                    width,
                    0.6,
                    facecolor=_WAIT_COLOUR,
                    edgecolor="none",
                    hatch="////",
                    alpha=0.6,
                    linewidth=0,
                )
            )
            continue
        if box.kind == "comm":
            ax.add_patch(Rectangle((box.start, 0.0), width, 0.12, facecolor=_COMM_COLOUR, alpha=0.5))
            continue
        colour = _box_colour(box.kind, box.stage, num_ranks)
        ax.add_patch(
            Rectangle((box.start, 0.12), width, 0.76, facecolor=colour, edgecolor="white", linewidth=0.6)
        )
        if box.microbatch is not None and width * px_per_unit >= 9 * len(str(box.microbatch)):
            dark = box.stage is None or box.stage < num_ranks
            ax.text(
                box.start + width / 2,
                0.5,
                str(box.microbatch),
                ha="center",
                va="center",
                fontsize=7.5,
                color="white" if dark else "#222222",
                clip_on=True,
            )


def _settled(curve: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The curve with one point per instant (the last): a free and an allocation at the same time are a
    hand-over, not a dip."""
    out: list[tuple[float, float]] = []
    for t, level in curve:
        if out and out[-1][0] == t:
            out[-1] = (t, level)
        else:
            out.append((t, level))
    return out


def _draw_memory(ax: Any, curve: list[tuple[float, float]], makespan: float, top: float) -> None:
    curve = _settled(curve)
    times = [t for t, _ in curve] + [max(makespan, curve[-1][0])]
    levels = [level for _, level in curve] + [curve[-1][1]]
    ax.fill_between(times, levels, step="post", color=_MEMORY_COLOUR, alpha=0.18, linewidth=0)
    ax.step(times, levels, where="post", color=_MEMORY_COLOUR, linewidth=1.2)
    peak = max(levels)
    ax.axhline(peak, color=_MEMORY_COLOUR, linestyle=":", linewidth=0.8)
    ax.text(
        0.995,
        0.92,
        f"peak {peak:g}",
        transform=ax.transAxes,
        ha="right",
        va="top",
        fontsize=7.5,
        color=_MEMORY_COLOUR,
    )
    ax.set_ylim(0, top * 1.25 if top > 0 else 1.0)
    ax.set_yticks(sorted({0.0, peak}))
    ax.tick_params(axis="y", labelsize=7)
    ax.set_ylabel("act.\nchunks", rotation=0, ha="right", va="center", fontsize=7, color=_MEMORY_COLOUR)
    for spine in ("top", "right"):
        ax.spines[spine].set_visible(False)


def _legend(fig: Any, kinds: Iterable[str], *, realized: bool, num_ranks: int) -> None:
    from matplotlib.patches import Patch

    handles = []
    for kind in kinds:
        colour = KIND_COLOURS[kind]
        handles.append(Patch(facecolor=colour, label=_KIND_LABELS[kind]))
    handles.append(
        Patch(facecolor=_lighter(KIND_COLOURS["F"]), label=f"lighter: chunk 1 (stage ≥ {num_ranks})")
    )
    if realized:
        handles.append(Patch(facecolor=_WAIT_COLOUR, hatch="////", label="waiting for input"))
        handles.append(Patch(facecolor=_COMM_COLOUR, alpha=0.5, label="send/recv, runtime"))
    handles.append(Patch(facecolor=_MEMORY_COLOUR, alpha=0.4, label="activation memory (chunks)"))
    fig.legend(
        handles=handles,
        loc="upper center",
        bbox_to_anchor=(0.5, 0.945),
        ncol=min(len(handles), 8),
        fontsize=8,
        frameon=False,
        handlelength=1.4,
        columnspacing=1.2,
    )


def _kinds_in(panels: Iterable[_Panel]) -> list[str]:
    present = {b.kind for p in panels for row in p.rows.values() for b in row}
    kinds = [k for k in KIND_COLOURS if k in present]
    return kinds or ["F", "I", "W"]


def _figure(num_ranks: int, memory: bool) -> Any:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    rank_height = 1.15 if memory else 0.6
    height = 1.3 + rank_height * num_ranks
    return plt.figure(figsize=(15, height), dpi=110)


def _save(fig: Any, path: str | os.PathLike[str]) -> Path:
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=fig.dpi, facecolor="white")
    plt.close(fig)
    return path


def _sim_title(name: str, sim: SimResult, unit: str, one_f_one_b: float | None) -> str:
    peak = sim.peak
    memory = f"peak act. memory {peak:g} chunks"
    if one_f_one_b:
        memory += f" ({peak / one_f_one_b:.2f}× 1F1B)"
    return f"{name} — predicted: makespan {sim.makespan:.4g} {unit}, bubble {sim.bubble:.1%}, {memory}"


def _realized_title(name: str, panel: _Panel, events: list[Any]) -> str:
    from pp_offload.runtime.timing import realized_bubble

    try:
        bubble = f"bubble {realized_bubble(events):.1%}"
    except ValueError:
        bubble = "no compute actions"
    peak = max((max(level for _, level in c) for c in panel.curves.values()), default=0.0)
    return f"{name} — realized: makespan {panel.makespan:.4g} ms, {bubble}, peak act. memory {peak:g} chunks"


def _one_f_one_b_peak(panel: _Panel) -> float | None:
    """1F1B's peak (``2 * min(d, m)`` chunks) for the order's ``d`` and ``m``."""
    mbs = {b.microbatch for row in panel.rows.values() for b in row if b.microbatch is not None}
    if not mbs:
        return None
    return 2.0 * min(panel.num_ranks, max(mbs) + 1)


# --------------------------------------------------------------------------------------------------------
# Public entry points


def plot_timeline(
    timeline_or_order: SimResult | Mapping[int, Iterable[Any]] | Sequence[Iterable[Any]],
    path: str | os.PathLike[str],
    *,
    costs: Costs | Mapping[str, float] | None = None,
    title: str | None = None,
    memory: bool = True,
    time_unit: str | None = None,
) -> Path:
    """Draw an order's predicted timeline (and, with ``memory``, each rank's activation memory) as a PNG.

    ``timeline_or_order``: a `SimResult`, or an order (ours or torch's actions) that is simulated with
    ``costs`` (``None``: unit costs). ``title`` names the schedule. ``time_unit`` labels the time axis
    (``"ms"`` for costs from `measured_costs`; default ``"cost units"``).
    Returns the path written.
    """
    if isinstance(timeline_or_order, SimResult):
        sim = timeline_or_order
    else:
        sim = simulate(_as_order(timeline_or_order), costs)
    unit = time_unit or "cost units"
    panel = _sim_panel(sim, "", unit)
    panel.title = _sim_title(title or "pipeline order", sim, unit, _one_f_one_b_peak(panel))
    fig = _figure(panel.num_ranks, memory)
    _draw_panel(fig, panel, memory=memory, xmax=panel.makespan)
    _legend(fig, _kinds_in([panel]), realized=False, num_ranks=panel.num_ranks)
    return _save(fig, path)


def plot_realized(
    events: Iterable[Any], path: str | os.PathLike[str], *, title: str | None = None, memory: bool = True
) -> Path:
    """Draw one step as it really ran, from ``ActionEvent``s of all ranks (`ActionTimer.gather`).

    Compute actions are boxes like `plot_timeline`'s; time spent waiting for an input is hatched grey, and
    SEND/RECV and the runtime's other actions (UNSHARD, REDUCE_GRAD, ...) are thin grey marks at the
    bottom of a row. The memory curves apply the simulator's rule to
    the realized times. Pass the events of ONE step (``timer.clear()`` between steps). Returns the path.
    """
    events = _events(events)
    panel = _realized_panel(events, "")
    panel.title = _realized_title(title or "pipeline step", panel, events)
    fig = _figure(panel.num_ranks, memory)
    _draw_panel(fig, panel, memory=memory, xmax=panel.makespan)
    _legend(fig, _kinds_in([panel]), realized=True, num_ranks=panel.num_ranks)
    return _save(fig, path)


def plot_side_by_side(
    order: SimResult | Mapping[int, Iterable[Any]] | Sequence[Iterable[Any]],
    events: Iterable[Any],
    path: str | os.PathLike[str],
    costs: Costs | Mapping[str, float] | None = None,
    *,
    title: str | None = None,
    memory: bool = True,
    share_time_axis: bool | None = None,
) -> Path:
    """Predicted (``order`` simulated with ``costs``) above realized (``events``).

    Give ``costs`` in milliseconds (e.g. ``measured_costs(events)``) so that the makespans compare
    directly. ``share_time_axis``: draw both panels on one time axis, so lengths compare at a glance;
    the default does so while the longer makespan is at most ``_SHARE_AXIS_RATIO`` times the shorter, and
    otherwise gives each panel its own scale, so the shorter stays readable. Returns the path written.
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    events = _events(events)
    name = title or "pipeline schedule"
    sim = order if isinstance(order, SimResult) else simulate(_as_order(order), costs)
    predicted = _sim_panel(sim, "", "ms")
    predicted.title = _sim_title(name, sim, "ms", _one_f_one_b_peak(predicted))
    realized = _realized_panel(events, "")
    realized.title = _realized_title(name, realized, events)
    longer = max(predicted.makespan, realized.makespan)
    shorter = max(min(predicted.makespan, realized.makespan), 1e-12)
    if share_time_axis is None:
        share_time_axis = longer / shorter <= _SHARE_AXIS_RATIO
    num_ranks = max(predicted.num_ranks, realized.num_ranks)
    rank_height = 1.15 if memory else 0.6
    panel_height = 1.0 + rank_height * num_ranks
    fig = plt.figure(figsize=(15, 0.7 + 2 * panel_height), dpi=110)
    top, bottom = fig.subfigures(2, 1, hspace=0.0)
    for sub, panel in ((top, predicted), (bottom, realized)):
        if not share_time_axis:
            panel.unit += ", own scale: realized/predicted = " + format(
                realized.makespan / max(predicted.makespan, 1e-12), ".2f"
            )
        _draw_panel(sub, panel, memory=memory, xmax=longer if share_time_axis else panel.makespan)
    _legend(top, _kinds_in([predicted, realized]), realized=True, num_ranks=num_ranks)
    return _save(fig, path)


def measured_costs(events: Iterable[Any], *, comm: float = 0.0) -> Costs:
    """Median F, I and W durations (ms) of recorded compute actions, as `Costs` for the simulator.

    Stage 0 is left out of I and W: torch skips its I under split backward and runs the whole backward
    at its W. A schedule with full backwards only (B) has its B split evenly between I and W.
    """
    from statistics import median

    from pp_offload.runtime.timing import action_category

    durations: dict[str, list[float]] = {"F": [], "I": [], "W": [], "B": []}
    for _, action, start, end in _events(events):
        if action_category(action) != "compute":
            continue
        for stage, kind, _ in _split_action(action):
            if kind in durations and not (stage == 0 and kind in ("I", "W")):
                durations[kind].append((end - start) * 1e3 / len(_split_action(action)))
    if not durations["F"]:
        raise ValueError("no F actions among the events; record a step with ActionTimer first")
    f = median(durations["F"])
    if durations["I"] and durations["W"]:
        i, w = median(durations["I"]), median(durations["W"])
    elif durations["B"]:
        i = w = median(durations["B"]) / 2
    else:
        i = w = f
    floor = 1e-6
    return Costs(F=max(f, floor), I=max(i, floor), W=max(w, floor), comm=comm)
