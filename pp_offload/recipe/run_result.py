"""What a recipe run returns (`pp_offload.recipe.train.run`) and writes as ``summary.json``."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["RunResult"]


@dataclass
class RunResult:
    """What a run did: per-step losses (every rank has them), where it wrote, the step it resumed from."""

    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    resumed_from: int | None = None
    export_dir: Path | None = None  # with LoRA: the adapter, in peft's format
    merged_dir: Path | None = None  # LoRA with lora.merge: the merged full model
    output_dir: Path | None = None
    schedule: str = ""
    tokens_per_s: float = 0.0
    timeline_png: Path | None = None
    auto: dict[str, Any] | None = None  # schedule: auto's decision (the same on every rank)
    evals: list[dict[str, float]] = field(default_factory=list)  # {"step", "loss", "perplexity", "tokens"}
    skipped_steps: list[int] = field(default_factory=list)  # 1-based steps skipped as non-finite
    preempted: str | None = None  # the signal's name when SIGTERM / SIGUSR1 stopped the run early
    last_step: int = 0  # the step the run's weights are at when it returned

    def summary(self) -> dict[str, Any]:
        """What ``summary.json`` holds of it (beside the config)."""
        paths = {k: str(getattr(self, k)) if getattr(self, k) else None for k in _PATHS}
        auto = None if self.auto is None else {k: self.auto[k] for k in _AUTO_SUMMARY}
        shown = {k: getattr(self, k) for k in _SHOWN}
        return {**shown, **paths, "auto": auto, "eval": self.evals, "final_eval": (self.evals or [None])[-1]}


_SHOWN = ("losses", "grad_norms", "schedule", "resumed_from", "skipped_steps", "preempted", "tokens_per_s")
_PATHS = ("export_dir", "merged_dir", "timeline_png")
_AUTO_SUMMARY = ("schedule", "offload", "memory_limit", "predicted_step_s", "peak_bytes", "reason")
