"""A tiny Hugging Face Llama or GPT-2 (2 layers, hidden 32, no dropout, sdpa) for the recompute tests, and
the recipe's tiny Llama (``model.config`` entries) for tests that launch the recipe."""

from __future__ import annotations

import torch
from torch import nn

#: ``model.config`` of a 4-layer Llama small enough for a recipe run of a few steps on 2 CPU ranks.
RECIPE_LLAMA = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def tiny_hf(family: str) -> tuple[nn.Module, list[nn.Module], dict]:
    """The base model (``AutoModel``, fp32, train mode, seed 0), its decoder layers and a batch of 2 rows of
    24 token ids."""
    from transformers import AutoModel, GPT2Config, LlamaConfig

    torch.manual_seed(0)
    if family == "gpt2":
        config = GPT2Config(n_embd=32, n_head=4, n_layer=2, vocab_size=64, resid_pdrop=0.0, embd_pdrop=0.0)
        config.attn_pdrop = 0.0
    else:
        config = LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_hidden_layers=2,
            vocab_size=64,
        )
    config._attn_implementation = "sdpa"
    model = AutoModel.from_config(config).float().train()
    layers = list(model.h if family == "gpt2" else model.layers)
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    return model, layers, {"input_ids": ids}
