"""Loading only a rank's share of a pretrained checkpoint equals cutting the fully loaded model.

Tiny models are saved with ``save_pretrained`` (sharded into many small files, so several shards are
involved), loaded as a meta-device skeleton, split, and only the split's tensors read: every tensor and
every buffer (rotary ``inv_freq``, Gemma's ``embed_scale``, recomputed, not read) equals the same split of
the fully loaded model, ties included. Checkpoints that cannot be read by part fall back to a full load.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from pp_offload.models import split_model
from pp_offload.models.loading import PartialLoadError, check_checkpoint, empty_model, load_split_weights

SMALL = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4}
CONFIGS = {
    "llama-tied": ("llama", {**SMALL, "num_key_value_heads": 2, "tie_word_embeddings": True}),
    "qwen2-sliding": (
        "qwen2",
        {
            **SMALL,
            "num_key_value_heads": 2,
            "use_sliding_window": True,
            "max_window_layers": 2,
            "sliding_window": 8,
        },
    ),
    "gemma": ("gemma", {**SMALL, "num_key_value_heads": 2, "head_dim": 8}),
    "gpt2": ("gpt2", {"n_embd": 32, "n_layer": 4, "n_head": 4, "bos_token_id": 0, "eos_token_id": 0}),
}


def _saved(tmp_path: Path, name: str) -> tuple[torch.nn.Module, Path]:
    model_type, values = CONFIGS[name]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(model_type, vocab_size=100, **values)
    ).eval()
    where = tmp_path / name
    model.save_pretrained(where, max_shard_size="20KB")
    return model, where


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("stages", [[0, 3], [1, 2], [1, 3]])
def test_partial_load_equals_the_split_of_the_full_model(
    tmp_path: Path, name: str, stages: list[int]
) -> None:
    full, where = _saved(tmp_path, name)
    assert len(list(where.glob("*.safetensors"))) > 2
    want = split_model(full, num_stages=4, stage_indices=stages)
    skeleton = empty_model(where, dtype=torch.float32).eval()
    check_checkpoint(skeleton, where)
    got = split_model(skeleton, num_stages=4, stage_indices=stages)
    load_split_weights(got, skeleton, where)
    for kind in ("named_parameters", "named_buffers"):
        a, b = dict(getattr(want.module, kind)()), dict(getattr(got.module, kind)())
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), key
    held = {id(p) for p in got.module.parameters()}
    assert all(p.is_meta for p in skeleton.parameters() if id(p) not in held)  # the rest never loaded
    tied = full.get_input_embeddings().weight is full.get_output_embeddings().weight
    if tied and stages == [0, 3]:  # both ends on this rank: still one parameter
        assert skeleton.get_input_embeddings().weight is skeleton.get_output_embeddings().weight
    if 0 in stages:  # the recomputed buffers (rotary, Gemma's embed_scale) are used as the model uses them
        ids = torch.randint(0, 100, (2, 10))
        torch.testing.assert_close(got.stages[0](ids), want.stages[0](ids), rtol=0, atol=0)


def test_base_model_checkpoint_and_tied_head_map_by_name(tmp_path: Path) -> None:
    """GPT-2's hub checkpoints hold the base model ("h.0...", no "transformer." prefix, no lm_head)."""
    full, _ = _saved(tmp_path, "gpt2")
    base = tmp_path / "base"
    full.transformer.save_pretrained(base)
    skeleton = empty_model(base, dtype=torch.float32)
    got = split_model(skeleton, num_stages=4, stage_indices=[3])
    load_split_weights(got, skeleton, base)
    torch.testing.assert_close(got.module.lm_head.weight, full.lm_head.weight, rtol=0, atol=0)


def _legacy_bin(model: torch.nn.Module, where: Path) -> Path:
    """A checkpoint in the old pickle format (no safetensors)."""
    where.mkdir()
    model.config.save_pretrained(where)
    torch.save(model.state_dict(), where / "pytorch_model.bin")
    return where


def test_checkpoints_that_cannot_load_by_part_are_refused_early(tmp_path: Path) -> None:
    full, _ = _saved(tmp_path, "llama-tied")
    legacy = _legacy_bin(full, tmp_path / "bin")
    with pytest.raises(PartialLoadError, match="only safetensors checkpoints load by part"):
        check_checkpoint(empty_model(legacy), legacy)
    other = tmp_path / "other"
    AutoModelForCausalLM.from_config(
        AutoConfig.for_model("gpt2", n_embd=32, n_layer=2, n_head=4)
    ).save_pretrained(other)
    skeleton = empty_model(tmp_path / "llama-tied")
    with pytest.raises(
        PartialLoadError, match="the checkpoint has no tensor for 'model.embed_tokens.weight'"
    ):
        check_checkpoint(skeleton, other)


def test_recipe_loads_by_part_only_when_it_pays_and_falls_back_to_a_full_load(tmp_path: Path) -> None:
    from pp_offload.recipe import RecipeConfig
    from pp_offload.recipe.model_loading import load_model

    full, fp32 = _saved(tmp_path, "llama-tied")
    bf16 = tmp_path / "bf16"
    full.to(torch.bfloat16).save_pretrained(bf16)
    legacy = _legacy_bin(full, tmp_path / "bin")

    def loaded(where: Path) -> torch.nn.Module:
        return load_model(RecipeConfig.from_dict({"model": {"path": str(where)}}), None, partial=True)

    assert all(p.is_meta for p in loaded(bf16).parameters())  # converted to fp32: by part
    assert not any(p.is_meta for p in loaded(fp32).parameters())  # same dtype: from_pretrained maps it
    assert not any(p.is_meta for p in loaded(legacy).parameters())  # no safetensors: whole
