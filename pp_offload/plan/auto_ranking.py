"""The candidates `pp_offload.plan.auto.choose` judged, ranked, and the words that explain the pick, or why
nothing fits and what budget would admit the lowest-memory candidate.

Why a module of its own: the ranking reads only judged candidates (`pp_offload.plan.auto_judge`), and its
tie rule (within ``_TIE`` of the fastest: no offload, no recompute, less memory, our schedules) is the
decision's policy, kept in one place.
"""

from __future__ import annotations

import math
from typing import Any

from pp_offload.plan.auto_judge import _MS, AutoCandidate, _MiB, _reference_bytes
from pp_offload.plan.orders import OURS
from pp_offload.plan.probe import Measurement

_TIE = 0.01


def _rank(candidates: list[AutoCandidate]) -> list[AutoCandidate]:
    """The pick first (fastest that fits; within 1 %: no offload, then less memory, then ours), then the
    other fitting candidates by step time, then the rest (simulated before unbuildable, by step time).

    Why no offload before less memory: the memory is already within the budget, and an offload
    candidate's predicted time carries the copies' uncertainty (bandwidth under load, on CPU the copies'
    serial time), while a 1 % difference is below what a probe step measures reliably."""

    def order(c: AutoCandidate) -> tuple[Any, ...]:
        return (
            c.predicted_step_s,
            c.max_peak,
            c.offload != "none",
            c.recompute != "none",
            c.schedule not in OURS,
            c.schedule,
            c.offload,
        )

    fitting = sorted((c for c in candidates if c.fits), key=order)
    rest = sorted(
        (c for c in candidates if not c.fits),
        key=lambda c: (
            c.predicted_step_s is None,
            c.max_peak,
            c.predicted_step_s or 0.0,
            c.schedule,
            c.offload,
        ),
    )
    if fitting:
        fastest = fitting[0].predicted_step_s
        tied = [c for c in fitting if c.predicted_step_s <= fastest * (1.0 + _TIE)]
        pick = min(
            tied,
            key=lambda c: (
                c.offload != "none",
                c.recompute != "none",
                c.max_peak,
                c.schedule not in OURS,
                c.memory_limit is not None,  # a fixed schedule before the adaptive one at the same cost
                *order(c),
            ),
        )
        fitting.remove(pick)
        fitting.insert(0, pick)
    return fitting + rest


def _label(c: AutoCandidate) -> str:
    limit = f" (memory_limit {c.memory_limit:.2f})" if c.memory_limit is not None else ""
    how = "without offload" if c.offload == "none" else f"with offload {c.offload}"
    again = f" and {c.recompute} recompute" if c.recompute != "none" else ""
    return f"{c.schedule}{limit} {how}{again}"


def _reason(ranked: list[AutoCandidate], budget: list[int] | None) -> str:
    pick = ranked[0]
    fitting = [c for c in ranked if c.fits]
    where = "of all candidates" if budget is None else f"of the {len(fitting)} candidates within the budget"
    text = (
        f"{_label(pick)} is the fastest {where}: predicted {pick.predicted_step_s * _MS:.2f} ms per step, "
        f"activation peak {pick.max_peak / _MiB:.3f} MiB per rank"
    )
    if len(fitting) > 1 and fitting[1].predicted_step_s < pick.predicted_step_s:
        fastest = min(fitting, key=lambda c: c.predicted_step_s)
        text += (
            f" (within 1% of {_label(fastest)} at {fastest.predicted_step_s * _MS:.2f} ms, with no offload, "
            "less memory or our schedule as the tie-break)"
        )
    return text + "."


def _nothing_fits(
    ranked: list[AutoCandidate],
    measurement: Measurement,
    m: int,
    budget: list[int] | None,
    memory_limit: float | None,
    absolute: int | None,
) -> str:
    simulated = [c for c in ranked if c.peak_bytes]
    asked = " and ".join(
        x
        for x in (
            f"memory_limit={memory_limit}" if memory_limit is not None else "",
            f"activation_budget_bytes={absolute}" if absolute is not None else "",
        )
        if x
    )
    if not simulated:
        problems = "; ".join(sorted({c.problem for c in ranked if c.problem}))
        return f"no candidate schedule can run here: {problems}"
    assert budget is not None  # without a budget every simulated candidate fits  # noqa: S101

    def overshoot(c: AutoCandidate) -> float:
        return max(p / b if b > 0 else math.inf for p, b in zip(c.peak_bytes, budget, strict=True))

    closest = min(simulated, key=lambda c: (overshoot(c), c.predicted_step_s))
    rank = max(range(len(budget)), key=lambda r: closest.peak_bytes[r] - budget[r])
    over = closest.peak_bytes[rank] - budget[rank]
    lowest = min(simulated, key=lambda c: (c.max_peak, c.predicted_step_s))
    refs = _reference_bytes(measurement, m)
    needed = max((p / ref for p, ref in zip(lowest.peak_bytes, refs, strict=True) if ref > 0), default=0.0)
    limit_hint = f" or memory_limit >= {math.ceil(needed * 1000) / 1000:.3f}" if 0 < needed <= 1 else ""
    return (
        f"no schedule x offload candidate fits {asked} ({budget[rank] / _MiB:.3f} MiB on rank {rank}): the "
        f"closest, {_label(closest)}, has an activation peak of {closest.peak_bytes[rank] / _MiB:.3f} MiB "
        f"there, {over / _MiB:.3f} MiB ({over / max(budget[rank], 1):.0%}) over. The smallest achievable "
        "activation peak is "
        f"{lowest.max_peak / _MiB:.3f} MiB per rank ({_label(lowest)}): activation_budget_bytes >= "
        f"{lowest.max_peak}{limit_hint} would admit it (or use fewer microbatches in flight / more ranks)."
    )
