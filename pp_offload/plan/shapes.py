"""Config shapes of well-known models, by name, so a plan needs neither the hub nor a download.

Why: the models people plan for are gated on the hub (meta-llama needs a licence and a token) and the
planner only needs a handful of numbers from their ``config.json``. ``model_spec("llama-3-8b")`` (and
``pp-offload plan --model llama-3-8b``) reads them from here; any other name is a path or a hub id as
before. The values are those of the models' published ``config.json`` files.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SHAPES", "shape"]

_LLAMA_3 = {"model_type": "llama", "vocab_size": 128256, "num_key_value_heads": 8, "hidden_act": "silu"}

SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": {
        **_LLAMA_3,
        "num_hidden_layers": 16,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_attention_heads": 32,
        "head_dim": 64,
        "tie_word_embeddings": True,
    },
    "llama-3.2-3b": {
        **_LLAMA_3,
        "num_hidden_layers": 28,
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_attention_heads": 24,
        "head_dim": 128,
        "tie_word_embeddings": True,
    },
    "llama-3-8b": {
        **_LLAMA_3,
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "tie_word_embeddings": False,
    },
    "llama-3-70b": {
        **_LLAMA_3,
        "num_hidden_layers": 80,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_attention_heads": 64,
        "tie_word_embeddings": False,
    },
}
"""Name -> the ``config.json`` fields the planner reads (Llama 3 and 3.1 share the 8B and 70B shapes)."""


def shape(name: str) -> dict[str, Any] | None:
    """A copy of the named shape (case-insensitive; ``Llama-3.1-8B`` is ``llama-3-8b``), or None."""
    key = name.strip().lower().replace("llama-3.1-", "llama-3-").replace("meta-", "")
    found = SHAPES.get(key)
    return None if found is None else dict(found)
