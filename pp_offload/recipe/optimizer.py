"""The run's optimizer: torch's AdamW over the parameter groups transformers' Trainer makes.

Why Trainer's groups: a Hugging Face user who sets ``weight_decay`` expects it where ``Trainer`` applies it,
on every weight but the norms' and the biases (`transformers.Trainer.get_decay_parameter_names`): decaying
a norm's scale towards 0 pulls it away from its identity, and a bias has no scale to keep in check. The
decision is transformers' own, made on this rank's parameters by their Hugging Face names (a pipeline
stage keeps them), so every pipeline rank decides as the unsplit model would. ``train.weight_decay_exclude``
names other exclusions, or none (every parameter decays, as the recipe did before).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pp_offload.recipe.config import ConfigError, TrainConfig

__all__ = ["OPTIMIZERS", "DecayGroups", "build_optimizer", "decay_groups"]

#: ``train.optimizer``'s choices: torch.optim.AdamW's implementation (``adamw``: torch picks, foreach on
#: CUDA tensors, a loop over the parameters on the CPU), with Trainer's names for the same two it offers.
OPTIMIZERS: dict[str, dict[str, bool]] = {
    "adamw": {},
    "adamw_foreach": {"foreach": True},
    "adamw_fused": {"fused": True},
    "adamw_torch": {},
    "adamw_torch_fused": {"fused": True},
}


@dataclass(frozen=True)
class DecayGroups:
    """The trainable parameters of a module split by whether weight decay applies, by name."""

    decayed: list[tuple[str, nn.Parameter]]
    kept: list[tuple[str, nn.Parameter]]

    def note(self, train: TrainConfig) -> str:
        """The log line: how many parameters (tensors and values) are decayed, and by which rule."""
        tensors = len(self.decayed) + len(self.kept)
        values = sum(p.numel() for _, p in self.decayed)
        total = values + sum(p.numel() for _, p in self.kept)
        rule = (
            "norm weights and biases are not (transformers Trainer's groups)"
            if train.weight_decay_exclude is None
            else f"names matching {train.weight_decay_exclude} are not"
            if train.weight_decay_exclude
            else "every parameter is (train.weight_decay_exclude: [])"
        )
        settings = f"lr {train.lr:g}, betas {tuple(train.betas)}, eps {train.adam_eps:g}"
        return (
            f"optimizer: {train.optimizer} ({settings}), weight decay {train.weight_decay:g} on "
            f"{len(self.decayed)} of {tensors} parameter tensors ({values:,} of {total:,} values); {rule}"
        )


def decay_groups(module: nn.Module, exclude: list[str] | None) -> DecayGroups:
    """``module``'s trainable parameters split by weight decay: Trainer's default rule when ``exclude`` is
    None, else every parameter whose lowercased name matches none of the regular expressions ``exclude``
    (transformers' `get_parameter_names`, which Trainer's rule also uses)."""
    if exclude is None:
        from transformers import Trainer

        names = set(Trainer.get_decay_parameter_names(None, module))  # uses no state of the trainer
    else:
        from transformers.trainer_pt_utils import get_parameter_names

        names = set(get_parameter_names(module, [], list(exclude)))
    decayed, kept = [], []
    for name, param in module.named_parameters():  # a tied weight once, under its first name
        if param.requires_grad:
            (decayed if name in names else kept).append((name, param))
    return DecayGroups(decayed, kept)


def build_optimizer(train: TrainConfig, module: nn.Module) -> torch.optim.Optimizer:
    """AdamW over ``module``'s trainable parameters (with LoRA: the adapters), in Trainer's two groups:
    ``train.weight_decay`` on the decayed ones, 0 on the others."""
    groups = decay_groups(module, train.weight_decay_exclude)
    params: list[dict[str, Any]] = [
        {"params": [p for _, p in groups.decayed], "weight_decay": train.weight_decay},
        {"params": [p for _, p in groups.kept], "weight_decay": 0.0},
    ]
    params = [g for g in params if g["params"]]
    try:
        return torch.optim.AdamW(
            params, lr=train.lr, betas=tuple(train.betas), eps=train.adam_eps, **OPTIMIZERS[train.optimizer]
        )
    except (RuntimeError, ValueError) as error:
        reason = " ".join(str(error).split())
        raise ConfigError(
            f"train.optimizer={train.optimizer}: torch refuses it for these parameters ({reason}); use "
            "adamw or adamw_foreach"
        ) from error
