"""A recipe run is quiet: no warning raised from pp_offload's own files, and none of the warnings our calls
used to trigger in dependencies (peft's Conv1D fan_in_fan_out, transformers' deprecated
is_gradient_checkpointing and past_key_values). GPT-2 LoRA with activation checkpointing on 2 pipeline
ranks: the path that raised them."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from _dist import run_on_ranks

import pp_offload
from pp_offload.recipe.config import RecipeConfig

OURS = str(Path(pp_offload.__file__).parent)
#: Dependency warnings that our calls triggered, and must not any more (the stages call transformers' mask
#: builders and layers with the argument names their installed signatures have: pp_offload.models.masks).
AVOIDED = (
    "fan_in_fan_out is set to False",
    "`is_gradient_checkpointing` is deprecated",
    "`past_key_values` is deprecated",
)


def _config(out: Path) -> dict:
    return {
        "model": {
            "config": {"model_type": "gpt2", "n_layer": 4, "n_embd": 32, "n_head": 2, "n_positions": 64}
        },
        "data": {"path": "embedded", "seq_len": 32, "max_examples": 200},
        "pipeline": {"schedule": "ScheduleVHalf", "microbatches": 2},
        "train": {"steps": 2, "global_batch_size": 4, "activation_checkpointing": True},
        "output": {"dir": str(out), "log_every": 0, "timeline": False},
        "lora": {"r": 4},
    }


def _worker(rank: int, world: int, config: dict) -> list[tuple[str, str, str]]:
    from pp_offload.recipe.train import run

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(RecipeConfig.from_dict(config), progress=False)
    return [(w.filename, w.category.__name__, str(w.message)) for w in caught]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_gpt2_lora_recipe_run_raises_no_warning_of_ours(tmp_path: Path) -> None:
    per_rank = run_on_ranks(_worker, 2, _config(tmp_path / "run"), timeout=300)
    seen = [w for ranks in per_rank for w in ranks]
    ours = [w for w in seen if w[0].startswith(OURS)]
    assert not ours, ours
    triggered = [w for w in seen if any(m in w[2] for m in AVOIDED)]
    assert not triggered, triggered
    assert (tmp_path / "run" / "export" / "base" / "config.json").is_file()  # the run went to the end
