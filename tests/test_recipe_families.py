"""The recipe on families whose forward does more than Llama's: a Granite-like model (embedding multiplier,
logits scaling, as the split-time proof checks) pipelined with V-Half on 2 gloo ranks equals one process."""

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
REL, ABS = 1e-5, 1e-6  # fp32; pipelined and single-process runs sum microbatch grads in other orders


def _config(out: Path, model: dict) -> dict:
    return {
        "model": {"config": model},
        "data": {"path": "embedded", "seq_len": 32, "max_examples": 200},
        "pipeline": {"schedule": "ScheduleVHalf", "microbatches": 4},
        "train": {"steps": 2, "global_batch_size": 8, "lr": 3e-3, "warmup_steps": 1},
        "output": {"dir": str(out), "metrics": ["csv"], "log_every": 0, "export": False, "timeline": False},
    }


def _run(config: dict, cache: str) -> list[float]:
    from pp_offload.recipe.train import run

    return run(RecipeConfig.from_dict(config), cache_dir=cache, progress=False).losses


def _worker(rank: int, world: int, config: dict, cache: str) -> list[float]:
    return _run(config, cache)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_granite_like_v_half_equals_one_process(tmp_path: Path) -> None:
    cache = str(tmp_path / "cache")
    pipelined = run_on_ranks(_worker, 2, _config(tmp_path / "pp", GRANITE), cache, timeout=240)[0]
    reference = _run(_config(tmp_path / "one", GRANITE), cache)
    assert len(pipelined) == len(reference) == 2
    torch.testing.assert_close(torch.tensor(pipelined), torch.tensor(reference), rtol=REL, atol=ABS)
