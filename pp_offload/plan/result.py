"""What a plan returns: one `Candidate` per schedule, offload policy and recompute plan, and the
`PlanResult` that ranks them (with `PlanError` when nothing fits).

Why a module of its own: the records are shared by the planner (`pp_offload.plan.planner`), the sweep that
fills them (`pp_offload.plan.sweep`), the ranking that explains them (`pp_offload.plan.ranking`) and the
report that prints them (`pp_offload.plan.report`); none of those needs the others to read a record.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from pp_offload.plan.machines import Machine
from pp_offload.plan.model import ModelSpec
from pp_offload.plan.orders import canonical_schedule

__all__ = ["GIB", "Candidate", "PlanError", "PlanResult"]

GIB = 1 << 30


class PlanError(ValueError):
    """No candidate fits (``.result`` holds the ranked candidates), or the inputs are impossible."""

    def __init__(self, message: str, result: PlanResult | None = None) -> None:
        super().__init__(message)
        self.result = result


@dataclass
class Candidate:
    """One schedule with one offload policy and one recompute mode: predicted step time and memory of every
    rank. ``recompute`` is what the recipe applies as ``train.activation_checkpointing`` (``"none"``: off).

    Times in seconds, memory in bytes; ``peak_units`` are the simulator's chunk units (one V stage of one
    microbatch; 1F1B peaks at ``2 * min(pp, m)``).
    """

    schedule: str
    offload: str
    memory_limit: float | None = None
    step_time: float | None = None
    pipeline_time: float | None = None
    dp_sync_time: float = 0.0
    bubble: float | None = None
    peak_units: list[float] = field(default_factory=list)
    activation: list[int] = field(default_factory=list)
    memory: list[int] = field(default_factory=list)
    breakdown: list[dict[str, int]] = field(default_factory=list)
    fits: bool = False
    over_bytes: int = 0
    offloaded_share: float = 0.0
    moved_share: float = 0.0
    reload_wait: float = 0.0
    extrapolated: bool = False
    error: str | None = None
    skipped: str | None = None
    useless: str | None = None
    """Why this offload candidate is never recommended: it moves nothing, or it costs step time without
    lowering the activation peak below the same schedule without offload (and without recompute)."""
    recompute: str = "none"
    pulled_w: int = 0
    """``budget:close-w``: W passes its offload-aware order moved right after their I (0: the order as given,
    the same plan as ``budget``)."""

    @property
    def evaluated(self) -> bool:
        return self.error is None and self.skipped is None

    @property
    def name(self) -> str:
        if self.schedule == "ScheduleVAdaptive" and self.memory_limit is not None:
            return f"ScheduleVAdaptive({self.memory_limit:.2f})"
        return self.schedule

    @property
    def label(self) -> str:
        text = f"{self.name} + {self.offload} offload" if self.offload != "none" else self.name
        return text + (f" + {self.recompute} recompute" if self.recompute != "none" else "")

    @property
    def peak_bytes(self) -> int:
        return max(self.memory) if self.memory else 0

    @property
    def peak_rank(self) -> int:
        return self.memory.index(self.peak_bytes) if self.memory else -1

    @property
    def activation_peak(self) -> int:
        return max(self.activation) if self.activation else 0

    @property
    def peak_unit(self) -> float:
        return max(self.peak_units) if self.peak_units else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(name=self.name, label=self.label, peak_bytes=self.peak_bytes, peak_rank=self.peak_rank)
        return out


@dataclass
class PlanResult:
    """Ranked candidates, the recommendation and why; ``table()`` prints them, ``plot(path)`` draws them."""

    candidates: list[Candidate]
    recommended: Candidate | None
    reason: str
    settings: dict[str, Any]
    model: ModelSpec
    machine: Machine
    schedules: dict[str, dict[str, Any]]
    assumptions: list[str]
    other_split: Candidate | None = None
    """The recommended candidate planned under the other backward split (``settings["deferred_w"]``
    flipped: torch's retained-graph split against deferred weight gradients), where the pick recomputes on
    a split-backward schedule; None elsewhere (`pp_offload.plan.planner.plan`'s ``compare_split``)."""

    @property
    def memory_limit_bytes(self) -> int:
        return int(self.settings["gpu_memory_gib"] * GIB)

    @property
    def recompute(self) -> str | None:
        """The recommended candidate's recompute mode (what the recipe's ``train.activation_checkpointing``
        must apply for the prediction to hold); None when nothing is recommended."""
        return self.recommended.recompute if self.recommended is not None else None

    def candidate(self, schedule: str, offload: str = "none", recompute: str = "none") -> Candidate:
        """The candidate of ``schedule`` (any spelling `canonical_schedule` accepts) with ``offload`` and
        ``recompute``."""
        name = canonical_schedule(schedule)
        for c in self.candidates:
            if c.schedule == name and c.offload == offload and c.recompute == recompute:
                return c
        raise KeyError(f"no candidate {name} with offload {offload!r} and recompute {recompute!r}")

    def table(self) -> str:
        from pp_offload.plan.report import format_table

        return format_table(self)

    def plot(self, path: Any) -> Any:
        from pp_offload.plan.report import plot_plan

        return plot_plan(self, path)

    def to_dict(self) -> dict[str, Any]:
        return {
            "settings": self.settings,
            "model": asdict(self.model),
            "machine": asdict(self.machine),
            "recommended": self.recommended.label if self.recommended else None,
            "recompute": self.recompute,
            "reason": self.reason,
            "candidates": [c.to_dict() for c in self.candidates],
            "schedules": self.schedules,
            "assumptions": self.assumptions,
            "other_split": self.other_split.to_dict() if self.other_split is not None else None,
        }
