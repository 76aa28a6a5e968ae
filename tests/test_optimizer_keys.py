"""The optimizer keys a Trainer user looks for (issue 44): ``train.optimizer``, ``train.adam_eps``,
``train.weight_decay_exclude``, ``train.warmup_ratio``, ``lr_schedule: linear``; and the Trainer defaults
docs/config.md quotes, checked against the installed transformers."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from _tiny_hf import RECIPE_LLAMA

from pp_offload.recipe import ConfigError, RecipeConfig, load_config
from pp_offload.recipe.config_types import CHOICES
from pp_offload.recipe.lr import lr_at, warmup_steps_of
from pp_offload.recipe.optimizer import OPTIMIZERS, build_optimizer


def _recipe(**train: object) -> RecipeConfig:
    return RecipeConfig.from_dict({"model": {"config": RECIPE_LLAMA}, "train": train}).validated()


def test_every_optimizer_name_is_torchs_adamw_with_its_implementation() -> None:
    assert set(CHOICES["train.optimizer"]) == set(OPTIMIZERS)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    for name, flags in OPTIMIZERS.items():
        train = _recipe(optimizer=name, adam_eps=1e-6, betas=[0.9, 0.999], weight_decay=0.1).train
        optimizer = build_optimizer(train, model)
        assert isinstance(optimizer, torch.optim.AdamW)
        decayed, kept = optimizer.param_groups  # Trainer's groups: the weight; the bias and the norm
        assert decayed["weight_decay"] == 0.1 and kept["weight_decay"] == 0.0
        assert [p.shape for p in decayed["params"]] == [(4, 4)] and len(kept["params"]) == 3
        assert decayed["eps"] == 1e-6 and decayed["betas"] == (0.9, 0.999)
        assert all(decayed.get(flag) for flag in flags)


def test_a_fused_adamw_torch_cannot_run_is_refused_before_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    from pp_offload.recipe import preflight

    real = torch.optim.AdamW

    def no_fused(params, **kwargs):  # noqa: ANN001, ANN202
        if kwargs.get("fused"):
            raise RuntimeError(
                "`fused=True` requires all the params to be floating point Tensors of supported devices"
            )
        return real(params, **kwargs)

    monkeypatch.setattr(torch.optim, "AdamW", no_fused)
    with pytest.raises(
        ConfigError, match=r"train\.optimizer=adamw_fused: torch .* has no fused AdamW for cpu"
    ):
        preflight._check_optimizer(_recipe(optimizer="adamw_fused", device="cpu"))
    preflight._check_optimizer(_recipe(optimizer="adamw_foreach", device="cpu"))


def test_weight_decay_exclusions_must_be_regular_expressions() -> None:
    with pytest.raises(ConfigError, match=r"train\.weight_decay_exclude: '\(' is not a regular expression"):
        _recipe(weight_decay_exclude=["("])
    with pytest.raises(ConfigError, match=r"train\.optimizer='sgd' must be one of adamw, adamw_foreach"):
        load_config(None, ["train.optimizer=sgd"])
    with pytest.raises(ConfigError, match=r"train\.adam_eps=0 must be a number > 0"):
        load_config(None, ["train.adam_eps=0"])


def test_warmup_ratio_and_the_linear_schedule_are_trainers() -> None:
    """``warmup_ratio`` is ceil(ratio x steps) steps; ``linear`` decays to ``lr * min_lr_ratio`` as
    transformers' linear schedule does to 0 (after the warm-up, whose convention differs: lr.py)."""
    from transformers import get_scheduler

    config = _recipe(steps=10, warmup_ratio=0.25, lr=1.0, lr_schedule="linear", min_lr_ratio=0.0)
    assert warmup_steps_of(config) == math.ceil(0.25 * 10) == 3
    assert [lr_at(config, k) for k in range(3)] == pytest.approx([1 / 3, 2 / 3, 1.0])
    no_warmup = dataclasses.replace(
        config, train=dataclasses.replace(config.train, warmup_ratio=None, warmup_steps=0)
    )
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=0, num_training_steps=10)
    trainer = []
    for _ in range(10):
        trainer.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert [lr_at(no_warmup, k) for k in range(10)] == pytest.approx(trainer)


def test_the_trainer_defaults_docs_quote_are_the_installed_transformers() -> None:
    from transformers import TrainingArguments

    from pp_offload.recipe.config_doc import TRAINER_DEFAULTS

    fields = {f.name: f.default for f in dataclasses.fields(TrainingArguments)}
    for entry in TRAINER_DEFAULTS:
        got = tuple(fields[name] for name in entry.arguments)
        assert [str(v) for v in got] == [str(v) for v in entry.trainer], entry.key
    defaults = RecipeConfig().train
    assert defaults.adam_eps == fields["adam_epsilon"] and defaults.max_grad_norm == fields["max_grad_norm"]
