"""Whether a run starts fresh or continues from the checkpoints in its output directory.

Why automatic: a worker restarted by ``torchrun --max-restarts`` runs the same command again, and so does
a job requeued after preemption; both must continue from the newest complete checkpoint, not train again
from step 0 over it. Why checked: the same output directory may hold checkpoints of *another* run (other
model, data or learning rate); continuing that silently would train something nobody asked for. Each
checkpoint records the config that wrote it (``meta.json``); a run continues by itself only when the
settings that define the run are equal, and otherwise stops with an error that names the differences and
the three ways on (``--resume``, another ``output.dir``, ``output.overwrite=true``).

What may change between the launches of one run: ``train.steps`` (extend or shorten the run), the
pipeline layout (checkpoints hold parameters by name, whatever rank held them), timeouts, evaluation,
logging and output settings. Changing ``train.steps`` keeps the learning rate continuous by default
(`pp_offload.recipe.lr`: the added steps decay from the current rate; ``train.extend_lr: recompute`` takes
the new total's schedule instead); a layout other than the checkpoint's (``pp x dp``) is resharded by DCP
on load. The console says both, in the one line that reports the resume.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pp_offload.recipe.checkpoint import CheckpointReadError, check_rng_files, checkpoint_meta, latest_step
from pp_offload.recipe.config import ConfigError, RecipeConfig
from pp_offload.recipe.lr import LrRestart, extension

__all__ = ["ResumePlan", "check_checkpoints", "plan_resume", "run_differences"]

# Keys that may differ between launches of one run (section -> keys; "*": the whole section).
_FREE = {
    "pipeline": "*",
    "output": "*",
    "train": {
        "steps",
        "extend_lr",
        "timeout_s",
        "stall_timeout",
        "max_bad_steps",
        "eval_every",
        "eval_batches",
        "device",
    },
    "data": {"eval_split", "eval_path", "eval_max_examples"},
    "model": {"verify_split", "attn_implementation"},
}


@dataclass(frozen=True)
class ResumePlan:
    """``step``: the checkpoint to continue from (None: start at step 0); ``wipe``: delete the output
    directory's checkpoints first (``output.overwrite``); ``note``: the line rank 0 prints;
    ``lr_restart``: where the learning rate continues from (`pp_offload.recipe.lr`); ``layout_changed``:
    the checkpoint was written at another ``pp x dp`` (a ``schedule: auto`` choice is probed again)."""

    step: int | None
    wipe: bool = False
    note: str | None = None
    lr_restart: LrRestart | None = None
    layout_changed: bool = False


def _flat(config: dict[str, Any]) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for section, values in config.items():
        free = _FREE.get(section, set())
        if free == "*":
            continue
        if not isinstance(values, dict):  # lora: None
            flat[section] = values
            continue
        for key, value in values.items():
            if key not in free:
                flat[f"{section}.{key}"] = list(value) if isinstance(value, tuple) else value
    return flat


def run_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``key: saved -> current`` for each run-defining key that differs (see the module docstring)."""
    before, after = _flat(saved), _flat(current)
    return [
        f"{key}: {before.get(key)!r} -> {after.get(key)!r}"
        for key in sorted(set(before) | set(after))
        if before.get(key) != after.get(key)
    ]


def plan_resume(
    config: RecipeConfig, root: Path, *, restarts: int, layout: dict[str, int] | None = None
) -> ResumePlan:
    """Decide from ``root`` (``<output.dir>/checkpoints``) and the config; raises `ConfigError` for a
    fresh run on another run's checkpoints. ``restarts``: torchrun's restart count (a restart never
    overwrites: it continues the run its first round started). ``layout``: this run's ``{"pp", "dp"}``,
    compared with the checkpoint's."""
    step = latest_step(root)
    if step is None:
        return ResumePlan(None)
    output = config.output
    if output.overwrite and not output.resume and restarts == 0:
        return ResumePlan(
            None, wipe=True, note=f"finetune: output.overwrite: deleting {root} (up to step {step})"
        )
    meta = checkpoint_meta(root) or {}
    saved = meta.get("config")
    differences = run_differences(saved, config.to_dict()) if saved is not None else None
    if not output.resume and differences != []:
        why = (
            "differs in " + "; ".join(differences[:4]) + (" ..." if len(differences) > 4 else "")
            if differences
            else "was written without a recorded config"
        )
        raise ConfigError(
            f"output.dir={output.dir!r} holds checkpoints of another run (up to step {step}; it {why}): "
            "continue it anyway with --resume (output.resume=true), start over there with "
            "--set output.overwrite=true (deletes them), or give a new --output-dir"
        )
    how = "restart" if restarts else ("--resume" if output.resume else "same run")
    note = f"finetune: resumed from step {step} ({how})"
    if output.resume and differences:
        note += "; config changed since: " + "; ".join(differences)
    before = meta.get("layout")
    changed = layout is not None and isinstance(before, dict) and before != layout
    if changed:
        note += (
            f"; checkpoint written at pp {before.get('pp')} x dp {before.get('dp')}, resumed at pp "
            f"{layout['pp']} x dp {layout['dp']}: model and optimizer resharded"
        )
    restart = LrRestart.from_dict(meta.get("lr_restart"))
    old_steps = (saved or {}).get("train", {}).get("steps")
    if isinstance(old_steps, int) and old_steps != config.train.steps and step < config.train.steps:
        restart, words = extension(config, step, old_steps, restart)
        note += f"; {words}"
    if step >= config.train.steps:
        note += f"; nothing left to train (train.steps={config.train.steps})"
    return ResumePlan(step, note=note, lr_restart=restart, layout_changed=changed)


def check_checkpoints(config: RecipeConfig, layout: dict[str, int]) -> str | None:
    """What the ranks will do with ``<output.dir>/checkpoints``, decided by the launcher before any rank
    starts: raises for another run's checkpoints (`plan_resume`) and for a latest checkpoint whose small
    files (``latest.json``, ``meta.json``, every ``rng_<rank>.pt``) cannot be read as data, which the
    ranks would refuse only after loading the data, under torchrun's 40-line failure report. Returns the
    resume note the ranks will print, or None for a fresh start. Reads nothing of the tensors' DCP files."""
    root = Path(config.output.dir) / "checkpoints"
    plan = plan_resume(config, root, restarts=0, layout=layout)
    if plan.step is None or plan.wipe:
        return plan.note
    where = root / f"step_{plan.step:08d}"
    if not where.is_dir():
        raise CheckpointReadError(f"{root / 'latest.json'} names step {plan.step} but {where} is missing")
    check_rng_files(root, plan.step)
    return plan.note
