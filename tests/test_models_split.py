"""Split equality: the stages of a Hugging Face causal LM chained in one process compute exactly what the
unsplit model computes (logits, loss, every gradient), for each supported family, tied and untied."""

from __future__ import annotations

import pytest
import torch
import transformers

from pp_offload.models import (
    CausalLMStage,
    TokenCrossEntropy,
    UnsupportedModelError,
    balanced_layers,
    family_of,
    split_model,
)

VOCAB = 61
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def _gpt2(**kwargs: bool) -> transformers.GPT2Config:
    return transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=4,
        n_head=4,
        n_positions=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        **kwargs,
    )


CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**SMALL, tie_word_embeddings=False),
    "llama-tied": lambda: transformers.LlamaConfig(**SMALL, tie_word_embeddings=True),
    "mistral-sliding": lambda: transformers.MistralConfig(**SMALL, sliding_window=5),
    "qwen2-tied-mixed-layers": lambda: transformers.Qwen2Config(
        **SMALL, use_sliding_window=True, sliding_window=5, max_window_layers=2, tie_word_embeddings=True
    ),
    "qwen3": lambda: transformers.Qwen3Config(**SMALL, head_dim=8),
    "gemma": lambda: transformers.GemmaConfig(**SMALL, head_dim=8),
    "gemma2-softcap-sliding": lambda: transformers.Gemma2Config(**SMALL, head_dim=8, sliding_window=5),
    "gpt2": lambda: _gpt2(tie_word_embeddings=True),
    "gpt2-untied": lambda: _gpt2(tie_word_embeddings=False),
}


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    attention = "eager" if name.startswith("gemma2") else "sdpa"  # transformers has no sdpa for Gemma2
    return transformers.AutoModelForCausalLM.from_config(
        CONFIGS[name](), attn_implementation=attention
    ).train()


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (2, 12), generator=gen)
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    labels[:, 6] = -100  # a document boundary: packed sequences of 7 and 5 tokens
    positions = torch.cat([torch.arange(7), torch.arange(5)]).expand(2, -1)
    return ids, labels, positions


@pytest.mark.parametrize("name", list(CONFIGS))
def test_chained_stages_equal_the_unsplit_model(name: str) -> None:
    ids, labels, positions = _batch()
    loss_fn = TokenCrossEntropy()
    loss_fn.num_target_tokens = int((labels != -100).sum())

    model = _model(name)
    logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    loss = loss_fn(logits, labels)
    loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}

    model = _model(name)
    split = split_model(model, num_stages=4, stage_indices=[0, 1, 2, 3])
    assert {n for n, _ in split.module.named_parameters()} == set(want)  # HF names, tied weights once
    h = ids
    for s in range(4):
        h = split.stages[s](h, position_ids=positions)
    torch.testing.assert_close(h, logits, rtol=0, atol=1e-6)
    split_loss = loss_fn(h, labels)
    torch.testing.assert_close(split_loss, loss, rtol=0, atol=1e-6)
    split_loss.backward()
    for n, p in split.module.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-5, atol=1e-7, msg=f"grad of {n}")


def test_v_placement_keeps_a_tied_weight_one_parameter_on_rank_0() -> None:
    model = _model("llama-tied")
    split = split_model(model, num_stages=4, stage_indices=[0, 3])
    assert split.stages[0].model.embed_tokens.weight is split.stages[3].lm_head.weight
    assert sum(1 for _ in split.module.parameters()) == len({id(p) for p in split.module.parameters()})


def test_stage_names_and_layers_follow_the_split() -> None:
    model = _model("llama")
    split = split_model(model, num_stages=2, stage_indices=[1], layers_per_stage=[1, 3])
    stage = split.stages[1]
    assert isinstance(stage, CausalLMStage) and stage.is_last and not stage.is_first
    assert stage.layer_ids == (1, 2, 3)
    names = {n for n, _ in stage.named_parameters()}
    assert "model.layers.1.self_attn.q_proj.weight" in names and "lm_head.weight" in names
    assert not any(n.startswith("model.embed_tokens") or n.startswith("model.layers.0.") for n in names)


def test_balanced_layers_counts_embedding_and_head_as_work() -> None:
    assert balanced_layers(8, 4, first_extra=0.0, last_extra=0.0) == [2, 2, 2, 2]
    assert balanced_layers(8, 4, first_extra=1.3, last_extra=1.3) == [1, 3, 3, 1]
    split = balanced_layers(30, 8, first_extra=2.0, last_extra=2.0)
    assert sum(split) == 30 and split[0] < max(split) and split[-1] < max(split)
    loads = [n + e for n, e in zip(split, [2.0] + [0.0] * 6 + [2.0], strict=True)]
    assert max(loads) == 5.0  # (30 + 4) / 8 = 4.25 rounds up to 5 layer units


def test_bad_splits_fail_clearly() -> None:
    model = _model("llama")
    with pytest.raises(ValueError, match="4 layers, fewer than the 8 pipeline stages"):
        split_model(model, num_stages=8, stage_indices=[0])
    with pytest.raises(
        ValueError, match=r"layers_per_stage \[2, 1\] must have 2 non-negative entries summing"
    ):
        split_model(model, num_stages=2, stage_indices=[0], layers_per_stage=[2, 1])
    with pytest.raises(ValueError, match="must be distinct and in"):
        split_model(model, num_stages=2, stage_indices=[0, 2])


def test_unsupported_models_say_what_is_missing() -> None:
    bert = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48
    )
    with pytest.raises(UnsupportedModelError, match="declares no base_model_pp_plan"):
        family_of(transformers.BertForMaskedLM(bert))
    with pytest.raises(UnsupportedModelError, match="has no .config"):
        family_of(torch.nn.Linear(2, 2))
