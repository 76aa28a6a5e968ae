"""Checks of a run that the launcher makes before any rank starts, and the ranks again (under plain
torchrun): things that otherwise fail only after start-up, deep in a rank, with a traceback.

- ``data.seq_len`` beyond the model's positions (``max_position_embeddings``, GPT-2's ``n_positions``):
  the position embedding is indexed out of range in the first forward (an ``IndexError`` 154 lines long,
  measured) or, for rotary models, the model runs on positions it never saw.
- The output directory holds another run's checkpoints, or a checkpoint whose files cannot be trusted
  (``latest.json``, ``meta.json``, an RNG state that is not one): the ranks would refuse it after loading
  the data, under torchrun's 40-line failure report.

Each raises `pp_offload.recipe.config.ConfigError` (or `CheckpointReadError`) with one line naming the
keys or the file and the fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pp_offload.recipe.config import ConfigError, RecipeConfig

__all__ = ["check_checkpoints", "check_positions", "model_positions"]

# A model's position limit, by the config attribute that holds it (GPT-2 maps max_position_embeddings to
# n_positions itself; the first that a config has wins).
_POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")


def model_positions(hf_config: Any) -> tuple[str, int] | None:
    """(the config key, the count) of the positions ``hf_config`` supports, or None when it names none."""
    given = hf_config.to_dict() if hasattr(hf_config, "to_dict") else {}
    for key in _POSITION_KEYS:
        value = getattr(hf_config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            # the key as the user wrote it: GPT-2's config stores n_positions for max_position_embeddings
            named = key if key in given else next((k for k in _POSITION_KEYS if given.get(k) == value), key)
            return named, value
    return None


def check_positions(config: RecipeConfig, hf_config: Any) -> None:
    """Refuse a ``data.seq_len`` longer than the model's positions, naming both keys."""
    found = model_positions(hf_config)
    if found is None or config.data.seq_len <= found[1]:
        return
    key, positions = found
    where = f"model.config.{key}" if config.model.config is not None else f"{key} of model.path's config.json"
    fix = (
        f"raise model.config.{key}" if config.model.config is not None else "use a model with more positions"
    )
    raise ConfigError(
        f"data.seq_len={config.data.seq_len} is longer than the model's positions ({where}={positions}): "
        f"set data.seq_len <= {positions}, or {fix}"
    )


def check_checkpoints(config: RecipeConfig, layout: dict[str, int]) -> str | None:
    """What the ranks will do with ``<output.dir>/checkpoints``, decided now: raises for another run's
    checkpoints (`pp_offload.recipe.resume.plan_resume`) and for a latest checkpoint whose small files
    (``latest.json``, ``meta.json``, every ``rng_<rank>.pt``) cannot be read as data. Returns the resume
    note the ranks will print, or None for a fresh start. Reads nothing of the tensors' DCP files."""
    from pp_offload.recipe.checkpoint import CheckpointReadError, check_rng_files
    from pp_offload.recipe.resume import plan_resume

    root = Path(config.output.dir) / "checkpoints"
    plan = plan_resume(config, root, restarts=0, layout=layout)
    if plan.step is None or plan.wipe:
        return plan.note
    where = root / f"step_{plan.step:08d}"
    if not where.is_dir():
        raise CheckpointReadError(f"{root / 'latest.json'} names step {plan.step} but {where} is missing")
    check_rng_files(root, plan.step)
    return plan.note
