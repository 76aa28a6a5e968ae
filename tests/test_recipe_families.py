"""The recipe on families whose forward does more than Llama's: a Granite-like model (embedding multiplier,
logits scaling, residual and attention multipliers) and a Mixtral-like MoE, without and with its router
load-balancing loss, pipelined with V-Half on 2 gloo ranks, equal one process on the same microbatches."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _dist import run_on_ranks

from pp_offload.recipe import RecipeConfig

GRANITE = {
    "model_type": "granite",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "embedding_multiplier": 6.0,
    "logits_scaling": 4.0,
    "residual_multiplier": 0.5,
    "attention_multiplier": 0.3,
    "tie_word_embeddings": True,
}
MIXTRAL = {
    "model_type": "mixtral",
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "output_router_logits": False,
}
MIXTRAL_AUX = {**MIXTRAL, "output_router_logits": True, "router_aux_loss_coef": 0.5}
REL, ABS = 1e-5, 1e-6  # fp32; pipelined and single-process runs sum microbatch grads in other orders


def _config(out: Path, model: dict) -> dict:
    return {
        "model": {"config": model},
        "data": {"path": "embedded", "seq_len": 32, "max_examples": 200},
        "pipeline": {"schedule": "ScheduleVHalf", "microbatches": 4},
        "train": {"steps": 2, "global_batch_size": 8, "lr": 3e-3, "warmup_steps": 1},
        "output": {"dir": str(out), "report_to": ["csv"], "log_every": 0, "export": False, "timeline": False},
    }


def _run(config: dict, cache: str) -> list[float]:
    from pp_offload.recipe.train import run

    return run(RecipeConfig.from_dict(config), cache_dir=cache, progress=False).losses


def _worker(rank: int, world: int, configs: list[dict], cache: str) -> list[list[float]]:
    return [_run(config, cache) for config in configs]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_granite_like_and_moe_v_half_equal_one_process(tmp_path: Path) -> None:
    cache = str(tmp_path / "cache")
    models = {"granite": GRANITE, "mixtral": MIXTRAL, "mixtral-aux": MIXTRAL_AUX}
    configs = [_config(tmp_path / f"pp-{name}", model) for name, model in models.items()]
    pipelined = run_on_ranks(_worker, 2, configs, cache, timeout=300)[0]  # one spawn for both
    for (name, model), losses in zip(models.items(), pipelined, strict=True):
        reference = _run(_config(tmp_path / f"one-{name}", model), cache)
        assert len(losses) == len(reference) == 2, name
        torch.testing.assert_close(
            torch.tensor(losses),
            torch.tensor(reference),
            rtol=REL,
            atol=ABS,
            msg=lambda m, n=name: f"{n}: {m}",
        )
    # the aux loss is trained, not dropped: same weights and data, the loss differs by coef x aux (~1)
    aux_part = torch.tensor(pipelined[2]) - torch.tensor(pipelined[1])
    assert bool((aux_part > 0.2).all()), aux_part
