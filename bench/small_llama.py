"""The `transformers` Llama config of the CPU benches that describe their model as a dict (``hidden``,
``intermediate``, ``layers``, ``heads``, ``vocab``, optional ``kv_heads``): one builder for
bench_hotpath.py and bench_queue_peak.py, so their models differ only where their dicts do."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def llama_config(cfg: Mapping[str, Any]) -> Any:
    """``LlamaConfig`` of ``cfg`` with SDPA attention; ``kv_heads`` defaults to ``heads`` (no GQA)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=cfg["hidden"],
        intermediate_size=cfg["intermediate"],
        num_hidden_layers=cfg["layers"],
        num_attention_heads=cfg["heads"],
        num_key_value_heads=cfg.get("kv_heads", cfg["heads"]),
        vocab_size=cfg["vocab"],
        attn_implementation="sdpa",
    )
