"""The Hugging Face model a run writes at its end (``output.export``): the full model, or with LoRA the
adapter in peft's format (with its base when that exists nowhere else, and the merged model on request).

Why every rank takes part: each pipeline rank holds its own stages and writes its own shard
(`pp_offload.models.export_pretrained` joins them into one model), and under FSDP each stage's parameters
are first gathered whole, a collective over the data-parallel replicas; replica 0 then writes, the others
hold the same values and write nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pp_offload.models import export_pretrained
from pp_offload.models.lora import base_state, export_adapter, merged_state, unwrap_peft
from pp_offload.recipe.config import RecipeConfig
from pp_offload.recipe.runner import Runner

__all__ = ["export_run"]


def export_run(
    config: RecipeConfig, model: nn.Module, runner: Runner, tokenizer: Any, out: Path, dp_rank: int
) -> tuple[Path | None, Path | None]:
    """Write ``out/export`` (and with ``lora.merge`` ``out/merged``) from ``runner``'s parameters; ``model``
    is the Hugging Face model the run was built from (its config, peft's wrapper). Returns (the export,
    the merged model) on the ranks that wrote them, None on the others."""
    state = {name: _whole(t) for name, t in runner.module.state_dict().items()}  # under FSDP: collective
    replica0 = dp_rank == 0  # the other replicas hold the same values and write nothing
    if config.lora is None:
        exported = None
        if replica0:  # a tied LM head is left out by export_pretrained (the first stage saves the embedding)
            exported = export_pretrained(
                _StateDictView(state), model.config, out / "export", tokenizer=tokenizer, group=runner.group
            )
        merged = None
    else:
        exported, merged = _export_lora(config, model, runner, state, tokenizer, out, replica0)
    if runner.group is not None:
        dist.barrier()
    return exported, merged


def _export_lora(
    config: RecipeConfig,
    model: nn.Module,
    runner: Runner,
    state: dict[str, torch.Tensor],
    tokenizer: Any,
    out: Path,
    replica0: bool,
) -> tuple[Path | None, Path | None]:
    """The adapter (peft's format, every rank's layers gathered) to ``out/export``; for a base model built
    from ``model.config`` the base too, to ``out/export/base`` (recorded as the adapter's
    ``base_model_name_or_path``); with ``lora.merge`` the merged model to ``out/merged``."""
    assert config.lora is not None
    if not replica0:
        return None, None
    module, group = runner.module, runner.group
    # a base built from model.config exists nowhere else: its weights go beside the adapter, as an HF model
    base = out / "export" / "base" if config.model.path is None else None
    if base is not None:  # first: peft's save reads the base's config
        base_model = _StateDictView(base_state(module, state))
        export_pretrained(base_model, unwrap_peft(model).config, base, tokenizer=tokenizer, group=group)
    adapter_only = _StateDictView({k: v for k, v in state.items() if ".lora_" in k})
    base_name = str(base.resolve()) if base is not None else None
    adapter = export_adapter(
        adapter_only, model, out / "export", group=group, tokenizer=tokenizer, base_model=base_name
    )
    merged = None
    if config.lora.merge:
        merged = export_pretrained(
            _StateDictView(merged_state(module, state)),
            unwrap_peft(model).config,
            out / "merged",
            tokenizer=tokenizer,
            group=group,
        )
    return adapter, merged


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


class _StateDictView(nn.Module):
    """A module whose state dict is the given tensors (what `export_pretrained` reads)."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self._state = state

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return dict(self._state)
