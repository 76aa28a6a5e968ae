"""`bench/bench_offload_scale.py`'s report: its tables as text (`report`) and its figure (`plot`), with the
names both need (the schedules' short names, the targets). Its own module: the bench computes, this shows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

SHORT = {"ScheduleVHalf": "V-Half", "ScheduleVZB": "V-ZB", "ScheduleInterleaved1F1B": "Interleaved1F1B"}
TARGETS = ((0.03, 0.30), (0.10, 0.50))  # (max slowdown, min peak cut)
OLD_RECOMPUTE = ("none", "selective", "full")  # before recompute plans on a share and MLP-only recompute
DEPTH_SLOWDOWN = 0.10  # the 70B depth target's step-time allowance


def best_within(rows: list[dict], slowdown: float) -> dict:
    """The row with the largest peak cut among those within ``slowdown``."""
    ok = [r for r in rows if r["slowdown"] <= slowdown + 1e-9]
    return max(ok, key=lambda r: (r["cut"], -r["step_s"]))


def _name(r: dict) -> str:
    """A row's policy as one label: offload policy, with the recompute mode when there is one."""
    if r["recompute"] == "none":
        return r["policy"]
    rc = r["recompute"].replace("selective", "sel")
    return f"{rc}-recompute" if r["policy"] == "none" else f"{rc}+{r['policy']}"


def _row_text(r: dict) -> str:
    need = " ".join(f"{k}:{v:.2f}" for k, v in r["need_ratio"].items())
    return (
        f"{_name(r):<36}{r['activation_gib']:>8.1f}{100 * r['cut']:>7.1f}%{1e3 * r['step_s']:>9.0f}"
        f"{100 * r['slowdown']:>+8.1f}%{100 * r['moved_share']:>8.1f}%{r['link_capacity_gib']:>9.1f}"
        f"{r['rank_saved_gib']:>10.1f}  {need}"
    )


def _verdicts(rows: list[dict]) -> list[tuple[float, float, dict, bool]]:
    """Per target (max slowdown, min cut): the best row within the slowdown and whether it meets the cut."""
    out = []
    for slowdown, cut in TARGETS:
        best = best_within(rows, slowdown)
        out.append((slowdown, cut, best, best["cut"] >= cut - 1e-9))
    return out


def cut_room(rows: list[dict], best: dict, alone: dict) -> float:
    """Step-time points the target leaves to offload after ``alone`` (the recompute without offload)."""
    limit = next(slowdown for slowdown, _ in TARGETS if best["slowdown"] <= slowdown + 1e-9)
    return max(0.0, limit - alone["slowdown"])


def _bound_text(rows: list[dict], best: dict, cut: float) -> str:
    """Why a target is missed: the link bound of the best row without recompute, and the windows' ceiling
    (budget:1, every layer each chunk's window hides, whatever the time) where it was run."""
    plain = (
        best
        if best["recompute"] == "none"
        else best_within([r for r in rows if r["recompute"] == "none"], best["slowdown"] + 1e-9)
    )
    key = f"{cut:.0%}"
    text = (
        f"bound: without recompute a {cut:.0%} cut moves {cut * plain['rank_saved_gib']:.1f} GiB each way, "
        f"the link carries {plain['link_capacity_gib']:.1f} GiB per direction in the step (need/cap "
        f"{plain['need_ratio'][key]:.2f})"
    )
    if best["recompute"] != "none":  # what the recompute left to offload
        alone = next(r for r in rows if r["recompute"] == best["recompute"] and r["policy"] == "none")
        offloaded = [r for r in rows if r["recompute"] == best["recompute"] and r["policy"] != "none"]
        moved = max(
            (r["moved_share"] for r in offloaded if r["slowdown"] <= best["slowdown"] + 1e-9), default=0
        )
        text += (
            f"; {_name(alone)} alone cuts {100 * alone['cut']:.1f}% at {100 * alone['slowdown']:+.1f}%, and "
            f"budget offload in the {100 * (cut_room(rows, best, alone)):.1f} points left moved "
            f"{100 * moved:.1f}% of the saved bytes"
        )
    ceiling = [r for r in rows if r["recompute"] == "none" and r["policy"] == "budget:1"]
    if ceiling:
        c = ceiling[0]
        text += f"; windows' ceiling (budget:1) {100 * c['cut']:.1f}% at {100 * c['slowdown']:+.1f}%"
    return text


def _groups_text(groups: list[dict]) -> list[str]:
    head = f"{'op group':<34}{'freed':>8}{'traffic':>9}{'freed/traffic':>15}{'of bytes':>10}{'of time':>9}"
    lines = [
        "Llama-3-8B layer, bf16: what each group of selectively recomputed ops frees vs the HBM traffic its "
        "recompute costs (bytes per token per hidden unit; of bytes/time: share of selective's)",
        head,
        "-" * len(head),
    ]
    for g in groups:
        lines.append(
            f"{g['group']:<34}{g['freed_per_token_hidden']:>8.1f}{g['traffic_per_token_hidden']:>9.1f}"
            f"{g['freed_per_traffic']:>15.2f}{100 * g['share_of_selective_bytes']:>9.0f}%"
            f"{100 * g['share_of_selective_time']:>8.0f}%"
        )
    return lines


def _layer_units(rows: list[dict]) -> list[dict]:
    """The rows whose offload moves whole layers (or nothing): not sub-layer units."""
    return [r for r in rows if "sublayer" not in r["policy"]]


def _compare_text(groups: dict[tuple, list[dict]], title: str, names: tuple[str, str], pick) -> list[str]:
    """Per (seq, schedule) on the H100: the best cut within +3% and +10% among the rows ``pick(rows)``
    gives (before, after), with the verdict of the second."""
    head = (
        f"{'seq':>6}  {'schedule':<16}{'target':>10}  {names[0]:<32}{'cut':>7}{'slower':>8}  "
        f"{names[1]:<36}{'cut':>7}{'slower':>8}  verdict"
    )
    lines = [title, head, "-" * len(head)]
    for (machine, seq, schedule), rows in groups.items():
        if machine != "H100":
            continue
        before, after = pick(rows)
        for slowdown, cut in TARGETS:
            a, b = best_within(before, slowdown), best_within(after, slowdown)
            verdict = "MET" if b["cut"] >= cut - 1e-9 else "missed"
            lines.append(
                f"{seq:>6}  {schedule:<16}{f'{cut:.0%}@+{slowdown:.0%}':>10}  {_name(a):<32}"
                f"{100 * a['cut']:>6.1f}%{100 * a['slowdown']:>+7.1f}%  {_name(b):<36}{100 * b['cut']:>6.1f}%"
                f"{100 * b['slowdown']:>+7.1f}%  {verdict}"
            )
    return lines


def _old_new_text(groups: dict[tuple, list[dict]]) -> list[str]:
    """The H100 targets with the recompute modes as they were (none, selective and full of every layer)
    and with the recompute plans (shares, mlp); whole-layer offload units in both."""
    return _compare_text(
        groups,
        "\nTargets, Llama-3-8B, H100, pp 4, m 16: old = no recompute plans (none, selective or full on "
        "every layer), new = with shares of the layers and MLP-only recompute (layer units)",
        ("old best", "new best"),
        lambda rows: ([r for r in _layer_units(rows) if r["recompute"] in OLD_RECOMPUTE], _layer_units(rows)),
    )


def _granularity_text(groups: dict[tuple, list[dict]]) -> list[str]:
    """The H100 targets with whole-layer offload units only, and with sub-layer units allowed (every
    recompute plan in both)."""
    return _compare_text(
        groups,
        "\nTargets, Llama-3-8B, H100, pp 4, m 16: budget offload by whole layers vs by sub-layer units "
        "(attention half, then the rest: budget:sublayer)",
        ("best, layer units", "best, sub-layer units allowed"),
        lambda rows: (_layer_units(rows), rows),
    )


def _depth_text(out: dict[str, Any]) -> list[str]:
    """Part (b): per schedule and pp the lowest peak within +10% and its plan, whether it stays flat with
    depth, and the host link's bound on holding pp 4's peak deeper (`depth_bounds`)."""
    lines = [
        "\nLlama-3-70B, H100, seq 8192, m = 2 pp: activation peak per rank (GiB), none vs the lowest within "
        "+10% over the recompute plans (each family at every share the stages express) alone and with budget "
        "offload in what they leave",
    ]
    head = (
        f"{'schedule':<17}{'pp':>4}{'none':>8}{'best':>8}  {'plan':<38}{'units':<10}{'step s':>8}"
        f"{'slower':>8}  best without recompute"
    )
    lines += [head, "-" * len(head)]
    groups: dict[tuple, list[dict]] = {}
    for r in out["part_b"]:
        groups.setdefault((r["schedule"], r["pp"]), []).append(r)
    pruned = {(p["schedule"], p["pp"], p["plan"]): p["need_can"] for p in out.get("part_b_pruned", ())}
    peaks: dict[str, list[float]] = {}
    for (schedule, pp), rows in groups.items():
        best = best_within(rows, DEPTH_SLOWDOWN)
        plain = best_within([r for r in rows if r["recompute"] == "none"], DEPTH_SLOWDOWN)
        peaks.setdefault(schedule, []).append(best["activation_gib"])
        alone = f"{plain['activation_gib']:.1f} GiB ({_name(plain)}, {100 * plain['slowdown']:+.1f}%)"
        if (schedule, pp, "none") in pruned:  # its offload trial was ruled out by the link bound
            ratio = pruned[(schedule, pp, "none")]
            alone = f"budget@0.1 not run: link bound for {best['activation_gib']:.1f} GiB is {ratio:.2f} > 1"
        lines.append(
            f"{schedule:<17}{pp:>4}{rows[0]['activation_gib']:>8.1f}{best['activation_gib']:>8.1f}  "
            f"{_name(best):<38}{best.get('units', '-'):<10}{best['step_s']:>8.2f}"
            f"{100 * best['slowdown']:>+7.1f}%  {alone}"
        )
    for schedule, values in peaks.items():
        growth = max(values[1:], default=values[0]) / values[0] - 1.0
        verdict = "flat or falling: MET" if growth <= 1e-3 else f"grows up to {100 * growth:+.1f}%: missed"
        lines.append(f"{schedule}: {' / '.join(f'{v:.1f}' for v in values)} GiB -> {verdict}")
    if out.get("part_b_bound"):
        lines.append(
            "\nBound on holding the peak at pp 4's best deeper (H100 link, each way): at the tightest moment "
            "of the plain order (rank, time), need = live bytes - target, can = the most any placement can "
            "have off the device then (out after each chunk's forward starts, back before its next backward "
            "ends, plus the plan's room as slack); step cap = what one direction carries in the +10% step"
        )
        head = (
            f"{'schedule':<17}{'pp':>4}{'target':>8}{'reached':>9}  {'plan (lowest need/can)':<24}{'rank':>5}"
            f"{'t s':>7}{'live':>8}{'need':>8}{'can':>8}{'need/can':>10}{'step cap':>10}{'need/cap':>10}"
        )
        lines += [head, "-" * len(head)]
        for b in out["part_b_bound"]:
            lines.append(
                f"{b['schedule']:<17}{b['pp']:>4}{b['target_gib']:>8.1f}{b['reached_gib']:>9.1f}  "
                f"{b['plan']:<24}{b['rank']:>5}{b['time_s']:>7.2f}{b['live_gib']:>8.1f}{b['need_gib']:>8.1f}"
                f"{b['can_gib']:>8.1f}{b['need_can']:>10.2f}{b['step_cap_gib']:>10.1f}"
                f"{b['need_gib'] / b['step_cap_gib']:>10.2f}"
            )
        for b in out["part_b_bound"]:
            if b["reached_gib"] <= b["target_gib"] * (1 + 1e-3):
                continue
            why = (
                "out of the link's reach for every plan that fits"
                if b["need_can"] > 1
                else f"not excluded by the link, but {100 * b['need_can']:.0f}% of what it can have off then"
            )
            lines.append(
                f"{b['schedule']} pp {b['pp']}: holding {b['target_gib']:.1f} GiB needs "
                f"{b['need_gib']:.1f} GiB off the device on rank {b['rank']} at {b['time_s']:.2f} s "
                f"({b['plan']}, {b['live_gib']:.1f} GiB live), at most {b['can_gib']:.1f} GiB can be: {why}; "
                f"reached {b['reached_gib']:.1f} GiB"
            )
    lines += _gap_text(out.get("part_b_bound", ()))
    for t in out.get("part_b_seconds", ()):
        lines.append(f"(search time: {t['schedule']} pp {t['pp']}: {t['seconds']:.0f} s)")
    for p in out.get("part_b_pruned", ()):
        lines.append(
            f"(pruned: {p['schedule']} pp {p['pp']} {p['plan']} + budget offload: the link bound for the "
            f"best peak found before it is {p['need_can']:.2f} > 1)"
        )
    return lines


def _gap_text(bounds: Any) -> list[str]:
    """Where a missed depth target's gap is (`depth_bounds`' ``gap``): the placement's share (what the
    best plan has off at the tight pass vs what the plain timing allows) and the link's (the rest, only
    reachable by holding that forward back for the copies: ``stall``)."""
    gaps = [b for b in bounds if b.get("gap")]
    if not gaps:
        return []
    lines = [
        "\nGap at the best plan's tightest pass (GiB): need = bytes off the device there for the target; "
        "off = what the best plan's placement has off at that pass; plain = the most any placement can have "
        "off in the plain order's timing; +room = with the plan's step-time room (the bound's can); stall = "
        "(need - plain) / bandwidth: how long that forward would have to wait for the copy lane; idle = "
        "the rank's idle time after that forward in the plain order"
    ]
    head = (
        f"{'schedule':<17}{'pp':>4}  {'plan':<22}{'units':<10}{'rank':>5}{'pass':>9}{'need':>8}{'off':>8}"
        f"{'plain':>8}{'+room':>8}{'off/plain':>10}{'stall s':>9}{'idle s':>8}"
    )
    lines += [head, "-" * len(head)]
    for b in gaps:
        g = b["gap"]
        chunk = f"{g['chunk'][0]}F{g['chunk'][1]}"
        lines.append(
            f"{b['schedule']:<17}{b['pp']:>4}  {g['plan']:<22}{g['units']:<10}{g['rank']:>5}{chunk:>9}"
            f"{g['need_gib']:>8.1f}{g['off_gib']:>8.1f}{g['can_plain_gib']:>8.1f}{g['can_gib']:>8.1f}"
            f"{g['off_gib'] / g['can_plain_gib']:>10.2f}{g['stall_s']:>9.2f}{g['idle_after_s']:>8.2f}"
        )
    for b in gaps:
        g = b["gap"]
        placement = max(g["can_plain_gib"] - g["off_gib"], 0.0)
        link = max(g["need_gib"] - g["can_plain_gib"], 0.0)
        missing = g["need_gib"] - g["off_gib"]
        waits = " (within the rank's idle time after it)" if g["stall_s"] <= g["idle_after_s"] else ""
        reach = " reaches them" if g["can_gib"] >= g["need_gib"] else "; out of reach even with the room"
        lines.append(
            f"{b['schedule']} pp {b['pp']}: of the {missing:.1f} GiB missing at that pass, {placement:.1f} "
            f"are the placement's (the plain timing allows them) and {link:.1f} the link's in the plain "
            f"timing: only a forward held back {g['stall_s']:.2f} s for its copies{waits}{reach}"
        )
    return lines


def report(out: dict[str, Any]) -> str:
    lines = _groups_text(out["groups"]) if out.get("groups") else []
    head = (
        f"{'policy':<36}{'act GiB':>8}{'cut':>8}{'step ms':>9}{'slower':>9}{'moved':>9}{'cap GiB':>9}"
        f"{'saved GiB':>10}  need/cap for a 30% / 50% cut"
    )
    groups: dict[tuple, list[dict]] = {}
    for r in out["part_a"]:
        groups.setdefault((r["machine"], r["seq"], r["schedule"]), []).append(r)
    summary = []
    for (machine, seq, schedule), rows in groups.items():
        lines.append(f"\nLlama-3-8B, {machine}, pp 4, m 16, seq {seq}, {schedule}")
        lines += [head, "-" * len(head)]
        lines += [_row_text(r) for r in rows]
        for slowdown, cut, best, met in _verdicts(rows):
            verdict = "MET" if met else "missed"
            bound = "" if met else "; " + _bound_text(rows, best, cut)
            lines.append(
                f"target cut >= {cut:.0%} at <= +{slowdown:.0%}: best {_name(best)} cuts "
                f"{100 * best['cut']:.1f}% at {100 * best['slowdown']:+.1f}% -> {verdict}{bound}"
            )
            summary.append((machine, seq, schedule, slowdown, cut, best, met))
    lines.append(
        "\nSummary, Llama-3-8B, pp 4, m 16: best within each target's step time (any offload/recompute)"
    )
    head2 = (
        f"{'machine':<7}{'seq':>6}  {'schedule':<16}{'target':>14}  {'best':<24}{'cut':>7}{'slower':>8}"
        "  verdict"
    )
    lines += [head2, "-" * len(head2)]
    for machine, seq, schedule, slowdown, cut, best, met in summary:
        lines.append(
            f"{machine:<7}{seq:>6}  {schedule:<16}{f'{cut:.0%} @ +{slowdown:.0%}':>14}  {_name(best):<24}"
            f"{100 * best['cut']:>6.1f}%{100 * best['slowdown']:>+7.1f}%  {'MET' if met else 'missed'}"
        )
    lines += _old_new_text(groups)
    lines += _granularity_text(groups)
    lines += _depth_text(out)
    if out.get("part_c"):
        lines.append(
            "\nLlama-3-70B, seq 8192, m = 2 pp, budget offload, no recompute: activation peak per rank (GiB) "
            "by depth on faster host links"
        )
        head = f"{'machine':<8}{'schedule':<17}" + "".join(f"{'pp ' + str(p):>22}" for p in (4, 8, 16))
        lines += [head, "-" * len(head)]
        for machine in dict.fromkeys(r["machine"] for r in out["part_c"]):
            for schedule in dict.fromkeys(r["schedule"] for r in out["part_c"]):
                cells = []
                for pp in (4, 8, 16):
                    rows = [
                        r
                        for r in out["part_c"]
                        if (r["machine"], r["schedule"], r["pp"]) == (machine, schedule, pp)
                    ]
                    plain = next(r for r in rows if r["policy"] == "none")
                    budget = next(r for r in rows if r["policy"] == "budget")
                    cells.append(
                        f"{plain['activation_gib']:.0f} -> {budget['activation_gib']:.1f} "
                        f"({100 * budget['slowdown']:+.1f}%)"
                    )
                lines.append(f"{machine:<8}{schedule:<17}" + "".join(f"{c:>22}" for c in cells))
    lines.append(
        "\ncolumns: cut = 1 - peak / peak without offload or recompute; slower = step time vs the same; "
        "sel/full = selective/full activation recompute of every layer, sel:S = selective recompute of the "
        "first share S of each stage's layers (sel:S,mlp: and mlp on the others), mlp = the MLP's "
        "activation and product only (every layer); +budget@X = budget offload within what the "
        "recompute leaves of a total slowdown X; moved = share of the step's saved bytes copied out (and "
        "back); cap = GiB one direction of the host link carries in the step; saved = GiB the busiest "
        "rank's chunks save in the step (after recompute); need/cap = (share of saved bytes the offload "
        "must still move for the cut, after the recompute's own cut) x saved / cap"
    )
    return "\n".join(lines)


def plot(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seqs = sorted({r["seq"] for r in out["part_a"]})
    fig, axes = plt.subplots(1, len(seqs) + 1, figsize=(6.5 * (len(seqs) + 1), 8))
    markers = {
        "none": "o",
        "mlp": "v",
        "mlp:0.75": "^",
        "selective:0.25": "1",
        "selective:0.5": "2",
        "selective:0.75": "3",
        "selective:0.25,mlp": "P",
        "selective:0.5,mlp": "p",
        "selective:0.75,mlp": "*",
        "selective": "s",
        "full": "X",
    }
    for ax, seq in zip(axes, seqs, strict=False):
        for schedule in SHORT.values():
            rows = [
                r
                for r in out["part_a"]
                if r["seq"] == seq and r["schedule"] == schedule and r["machine"] == "H100"
            ]
            if not rows:
                continue
            colour = None
            for recompute, marker in markers.items():
                mine = [r for r in rows if r["recompute"] == recompute]
                if not mine:
                    continue
                pts = ax.scatter(
                    [100 * r["slowdown"] for r in mine],
                    [r["activation_gib"] for r in mine],
                    marker=marker,
                    color=colour,
                    s=30,
                    label=f"{schedule}, recompute {recompute}",
                )
                colour = pts.get_facecolor()[0]
        ax.set_xlim(-1, 16)  # the targets' region; full recompute (+57-67%) and costlier rows: the table
        ax.axvline(3, color="grey", ls=":")
        ax.axvline(10, color="grey", ls="--")
        ax.set_xlabel("step time vs no offload, no recompute (%)")
        ax.set_ylabel("activation peak per rank (GiB)")
        ax.set_title(
            f"Llama-3-8B, H100, pp 4, m 16, seq {seq}\n(marker: recompute plan; colour: schedule; "
            "rows beyond +16%: the table)"
        )
        ax.legend(fontsize=6, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.1))
    ax = axes[-1]
    for schedule in ("V-Half", "Interleaved1F1B"):
        pps = sorted({r["pp"] for r in out["part_b"] if r["schedule"] == schedule})
        none = [
            next(r for r in out["part_b"] if r["schedule"] == schedule and r["pp"] == p)["activation_gib"]
            for p in pps
        ]
        group = {p: [r for r in out["part_b"] if r["schedule"] == schedule and r["pp"] == p] for p in pps}
        best = [best_within(group[p], 0.10)["activation_gib"] for p in pps]
        plain = [
            best_within([r for r in group[p] if r["recompute"] == "none"], 0.10)["activation_gib"]
            for p in pps
        ]
        line = ax.plot(pps, none, "o-", label=f"{schedule} none")[0]
        if any(r["recompute"] == "none" and r["policy"] != "none" for g in group.values() for r in g):
            ax.plot(pps, plain, "^:", color=line.get_color(), label=f"{schedule} best offload within +10%")
        ax.plot(pps, best, "s--", color=line.get_color(), label=f"{schedule} best with recompute within +10%")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("pp")
    ax.set_ylabel("activation peak per rank (GiB)")
    ax.set_title("Llama-3-70B, H100, seq 8192, m = 2 pp")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
