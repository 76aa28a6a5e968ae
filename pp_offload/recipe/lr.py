"""The learning-rate schedule, and what happens to it when a run is resumed with another ``train.steps``.

The schedule is linear warm-up to ``train.lr``, then cosine (or linear, or constant) down to ``lr *
min_lr_ratio`` at ``train.steps``: a pure function of the step, so a resumed run uses the rates an
uninterrupted one would.

Why the warm-up reaches ``lr`` at step ``warmup_steps`` (step k, counted from 1, at ``lr * k / W``) and
not one step later as transformers' Trainer does (its step k at ``lr * (k - 1) / W``: the first step at
0): a step at rate 0 spends a batch and moves no weight, and ``warmup_steps: W`` then means W steps to
the peak. The two agree from step W + 1 on. Kept also because every checkpoint written so far continues
on this curve (docs/config.md shows the first steps under both).

Why a rule for extensions: a finished 8-step run sits at the floor of its cosine; relaunched with
``train.steps: 16``, the 16-step cosine puts step 9 near the peak again (measured before this rule: 4.8e-4
to 1.95e-3 at the first new step; in a longer run a 7.7x jump that sent the loss from 4.53 to 6.29). So,
by default (``train.extend_lr: continue``), a resume whose ``train.steps`` differs from the checkpoint's
*continues from the learning rate the run is at*: from the resumed step on, the cosine decays from that
rate to the same floor at the new ``train.steps`` (a constant schedule stays constant). A run resumed
during its warm-up keeps the warm-up (``train.warmup_steps`` does not depend on ``train.steps``; a
``train.warmup_ratio`` warm-up is that share of the new ``train.steps``). ``train.extend_lr:
recompute`` takes the new total's schedule as if the run had been planned that long from the start.

The point where the rule took over (`LrRestart`: step and rate) is written into every later checkpoint's
``meta.json``, so a further relaunch of the extended run continues on the same curve.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from pp_offload.recipe.config import RecipeConfig

__all__ = ["LrRestart", "extension", "lr_at", "warmup_steps_of", "warmup_warning"]


@dataclass(frozen=True)
class LrRestart:
    """From 0-based ``step`` on, the decay starts at ``lr`` (the rate the run was at), not ``train.lr``."""

    step: int
    lr: float

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "lr": self.lr}

    @classmethod
    def from_dict(cls, data: Any) -> LrRestart | None:
        """The restart a checkpoint's ``meta.json`` records, or None (none recorded, or not one)."""
        if not isinstance(data, dict):
            return None
        step, lr = data.get("step"), data.get("lr")
        if isinstance(step, int) and not isinstance(step, bool) and isinstance(lr, (int, float)) and lr >= 0:
            return cls(step, float(lr))
        return None


def warmup_steps_of(config: RecipeConfig) -> int:
    """The warm-up's length in steps: ``ceil(warmup_ratio * steps)`` when ``train.warmup_ratio`` is set,
    else ``train.warmup_steps``."""
    train = config.train
    if train.warmup_ratio is not None:
        return math.ceil(train.warmup_ratio * train.steps)
    return train.warmup_steps


def lr_at(config: RecipeConfig, step: int, restart: LrRestart | None = None) -> float:
    """The learning rate of 0-based ``step``: linear warm-up to ``train.lr``, then cosine (or linear, or
    constant) down to ``lr * min_lr_ratio`` at ``train.steps``; from ``restart.step`` on, the decay starts
    at ``restart.lr`` instead."""
    train = config.train
    warmup = warmup_steps_of(config)
    if step < warmup:
        return train.lr * (step + 1) / warmup
    if train.lr_schedule == "constant":
        return train.lr
    floor = train.lr * train.min_lr_ratio
    if restart is not None and step >= restart.step:
        span = max(train.steps - restart.step, 1)
        progress = min((step - restart.step) / span, 1.0)
        top = restart.lr
    else:
        span = max(train.steps - warmup, 1)
        progress = min((step - warmup) / span, 1.0)
        top = train.lr
    if train.lr_schedule == "linear":
        return floor + (top - floor) * (1.0 - progress)
    return floor + (top - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def extension(
    config: RecipeConfig, step: int, old_steps: int, old_restart: LrRestart | None
) -> tuple[LrRestart | None, str]:
    """For a resume at 0-based ``step`` of a run whose checkpoint was written with ``train.steps =
    old_steps`` (and ``old_restart``): the restart the resumed run follows, and the console's words for it.

    With ``train.extend_lr: continue`` and a finished warm-up, the new restart starts at the rate the old
    schedule gives ``step``, so the rate is continuous; ``recompute`` (or a run still warming up) follows
    the new total's schedule from the start."""
    old = replace(config, train=replace(config.train, steps=old_steps))
    before = lr_at(old, step, old_restart)
    change = f"train.steps {old_steps} -> {config.train.steps}"
    if config.train.extend_lr == "recompute":
        after = lr_at(config, step)
        return None, (
            f"{change}: the learning-rate schedule is recomputed for {config.train.steps} steps "
            f"(train.extend_lr=recompute; lr at step {step + 1}: {before:.3e} -> {after:.3e})"
        )
    if step < warmup_steps_of(config) or config.train.lr_schedule == "constant":
        return None, f"{change}: the learning rate goes on as planned (lr at step {step + 1}: {before:.3e})"
    restart = LrRestart(step, before)
    floor = config.train.lr * config.train.min_lr_ratio
    if before <= floor * (1 + 1e-9):
        how = (
            f"stays at the schedule's floor, {floor:.3e} (train.lr x train.min_lr_ratio), for the added steps"
        )
    else:
        how = (
            f"continues from {before:.3e} (its value at step {step + 1}) and decays to {floor:.3e} at step "
            f"{config.train.steps}"
        )
    return restart, (
        f"{change}: the learning rate {how} (train.extend_lr=continue: no jump; to recompute the "
        f"{config.train.steps}-step schedule instead: --set train.extend_lr=recompute)"
    )


def warmup_warning(config: RecipeConfig) -> str | None:
    """The line a run prints when its warm-up is as long as the run or longer: the rate never reaches
    ``train.lr`` (allowed: a deliberately short trial run, but rarely what was meant)."""
    train = config.train
    warmup = warmup_steps_of(config)
    if warmup < train.steps:
        return None
    top = lr_at(config, train.steps - 1)
    if warmup == train.steps:
        what = f"reaches train.lr={train.lr:g} only at the last step, with no decay after it"
    else:
        what = f"never reaches train.lr={train.lr:g} (it ends at {top:.3e})"
    return (
        f"finetune: warning: train.warmup_steps={warmup} >= train.steps={train.steps}: the "
        f"learning rate {what}; lower train.warmup_steps or raise train.steps"
    )
