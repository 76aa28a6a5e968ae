"""A small copy of a transformers config: same class and every non-size setting, few layers, small dims.

Why: proving a split (`pp_offload.models.verify`) and sweeping every family (`pp_offload.models.sweep`) both
need the model's own code on a model small enough to run in milliseconds. Only sizes shrink: layer count
(keeping one layer of each kind the config distinguishes, such as ``layer_types`` entries or the dense
layers before MoE ones), hidden and head sizes (consistent with the head counts), vocabulary, expert counts,
windows. Every other value (scalings, soft-caps, rope settings, flags) is kept, because those are what a
split can get wrong.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ShrinkError", "shrunken_config"]

LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
MIN_LAYERS = 4
VOCAB = 96

# size -> small value; applied when the key is present with an int value
_SIZES: dict[str, int] = {
    "hidden_size": 32,
    "n_embd": 32,
    "d_model": 32,
    "intermediate_size": 48,
    "moe_intermediate_size": 24,
    "shared_expert_intermediate_size": 24,
    "shared_intermediate_size": 24,
    "dense_intermediate_size": 48,
    "ffn_hidden_size": 48,
    "n_inner": 48,
    "expert_ffn_hidden_size": 24,
    "intermediate_size_mlp": 48,
    "q_lora_rank": 16,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 4,
    "qk_nope_head_dim": 4,
    "qk_head_dim": 8,
    "v_head_dim": 8,
    "index_head_dim": 8,
    "index_n_heads": 2,
    "index_topk": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_head_dim": 8,
    "linear_num_heads": 4,
    "hidden_size_per_layer_input": 8,
    "rotary_dim": 4,  # GPT-J, CodeGen: rotary part of a head of 8
}
_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_TOP_K = ("num_experts_per_tok", "moe_topk", "moe_k", "num_experts_per_token")
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id", "decoder_start_token_id")


class ShrinkError(ValueError):
    """The config has a shape this shrinker does not know how to make small consistently."""


def _num_layers(values: dict[str, Any]) -> tuple[str, int]:
    for key in LAYER_KEYS:
        if isinstance(values.get(key), int) and values[key] > 0:
            return key, values[key]
    raise ShrinkError(f"no layer count among {LAYER_KEYS}")


def _kept_layers(values: dict[str, Any], n: int) -> list[int]:
    """Original indices of the layers kept: the first of each distinct per-layer signature, then the next
    ones until there are ``MIN_LAYERS`` (or all, for a shallower model)."""
    per_layer = [key for key, v in values.items() if isinstance(v, list) and len(v) == n and n > 1]
    dense = values.get("first_k_dense_replace")
    dense = dense if isinstance(dense, int) else 0
    overrides = _per_layer_config(values)
    kept: list[int] = []
    seen: set[Any] = set()
    for i in range(n):
        override = repr(overrides.get(i, (None, None))[1])
        signature = (tuple(repr(values[key][i]) for key in per_layer), i < dense, override)
        if signature not in seen:
            seen.add(signature)
            kept.append(i)
    for i in range(n):
        if len(kept) >= min(MIN_LAYERS, n):
            break
        if i not in kept:
            kept.append(i)
    return sorted(kept)


def _per_layer_config(values: dict[str, Any]) -> dict[int, tuple[str, Any]]:
    """``per_layer_config`` (DOTS3, Gemma4: per-layer size overrides keyed by the layer index as a string)
    as layer index -> (original key, override)."""
    table = values.get("per_layer_config")
    if not isinstance(table, dict):
        return {}
    return {int(key): (key, value) for key, value in table.items() if str(key).isdigit()}


def _small_overrides(override: Any, values: dict[str, Any]) -> Any:
    """One layer's size overrides made small by the same rules as the whole config."""
    if not isinstance(override, dict):
        return override
    merged = {**values, **override}
    small = {**{k: v for k, v in _heads(merged).items() if k in override}}
    for key, value in override.items():
        if key in _SIZES and isinstance(value, int) and value > 0:
            small[key] = _SIZES[key]
        elif key not in small:
            small[key] = value
    return small


def _heads(values: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for heads_key, kv_key in (("num_attention_heads", "num_key_value_heads"), ("n_head", "num_kv_heads")):
        heads = values.get(heads_key)
        if not isinstance(heads, int):
            continue
        out[heads_key] = 4
        kv = values.get(kv_key)
        if isinstance(kv, int):
            out[kv_key] = 4 if kv >= heads else (1 if kv == 1 else 2)
    if "head_dim" in values and values["head_dim"] is None and "num_attention_heads" in values:
        out["head_dim"] = 8  # unset (Ministral's default config): hidden 32 over 4 heads
    if isinstance(values.get("head_dim"), int):
        # MLA configs (DeepSeek) set head_dim to the rotary part of a query head: keep them equal
        rope = values.get("qk_rope_head_dim")
        out["head_dim"] = _SIZES["qk_rope_head_dim"] if rope == values["head_dim"] else 8
    if isinstance(values.get("multi_query"), bool) and values["multi_query"]:
        out.pop("num_kv_heads", None)
    return out


def _token_ids(values: dict[str, Any], vocab: int) -> dict[str, Any]:
    def fit(v: Any) -> Any:
        if isinstance(v, int) and not isinstance(v, bool):
            return v if 0 <= v < vocab else vocab - 1
        if isinstance(v, list):
            return [fit(x) for x in v]
        return v

    return {key: fit(values[key]) for key in _TOKEN_IDS if key in values}


def _rope(values: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """Per-frequency lists (longrope factors, mrope sections) resized to the small head size."""
    out: dict[str, Any] = {}
    for key in ("rope_parameters", "rope_scaling"):
        params = values.get(key)
        if not isinstance(params, dict):
            continue
        params = dict(params)
        partial = params.get("partial_rotary_factor", values.get("partial_rotary_factor", 1.0)) or 1.0
        half = int(head_dim * partial) // 2
        for name in ("short_factor", "long_factor"):
            if isinstance(params.get(name), list):
                params[name] = params[name][:half] + [1.0] * max(0, half - len(params[name]))
        if isinstance(params.get("mrope_section"), list):
            sections = len(params["mrope_section"])
            base = [half // sections] * sections
            base[0] += half - sum(base)
            params["mrope_section"] = base
        out[key] = params
    return out


def shrunken_config(config: Any) -> Any:
    """A copy of ``config`` (same class) with few layers and small sizes; every other setting kept.

    Raises :class:`ShrinkError` when the config has no recognisable layer count, or when its class rejects
    the small sizes.
    """
    values = config.to_dict()
    layer_key, n = _num_layers(values)
    kept = _kept_layers(values, n)
    over: dict[str, Any] = {layer_key: len(kept)}
    for key, v in values.items():
        if isinstance(v, list) and len(v) == n and n > 1:
            over[key] = [v[i] for i in kept]
    overrides = _per_layer_config(values)
    if overrides:
        width = max(len(key) for key, _ in overrides.values())
        over["per_layer_config"] = {
            str(new).zfill(width): _small_overrides(overrides[old][1], values)
            for new, old in enumerate(kept)
            if old in overrides
        }
    for key, size in _SIZES.items():
        if isinstance(values.get(key), int) and values[key] > 0:
            over[key] = size
    over.update(_heads(values))
    routed = any(key in values for key in _TOP_K)
    for key in _EXPERTS:
        if isinstance(values.get(key), int) and values[key] > 1:
            over[key] = 4
        elif key in values and values[key] is None and routed:  # unset in some default configs (dots1)
            over[key] = 4
    has_experts = any(isinstance(over.get(key), int) for key in _EXPERTS)
    for key in _TOP_K:
        if isinstance(values.get(key), int) and values[key] > 0:
            over[key] = min(values[key], 2)
        elif key in values and values[key] is None and has_experts:  # unset in some default configs
            over[key] = 2
    for key in ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts"):
        if isinstance(values.get(key), int) and values[key] > 1:
            over[key] = 1
        elif key in values and values[key] is None and routed:
            over[key] = 1
    for key in ("n_group", "num_expert_group"):
        if isinstance(values.get(key), int):
            over[key] = 1
    if isinstance(values.get("topk_group"), int):
        over["topk_group"] = 1
    if isinstance(values.get("first_k_dense_replace"), int) and values["first_k_dense_replace"] > 0:
        over["first_k_dense_replace"] = 1
    for key in ("sliding_window", "attention_chunk_size", "sliding_window_size", "window_size"):
        if isinstance(values.get(key), int) and values[key] > 4:
            over[key] = 4
    if isinstance(values.get("max_window_layers"), int):
        over["max_window_layers"] = min(values["max_window_layers"], len(kept))
    for key, v in values.items():
        if isinstance(v, float) and any(part in key for part in ("dropout", "pdrop", "jitter")):
            over[key] = 0.0
    vocab = VOCAB
    for key in ("vocab_size", "padded_vocab_size", "vocab_size_per_layer_input"):
        if isinstance(values.get(key), int):
            over[key] = vocab
    over.update(_token_ids(values, vocab))
    head_dim = over.get("head_dim") or (
        over.get("hidden_size", 32) // max(over.get("num_attention_heads", 4), 1)
    )
    over.update(_rope(values, head_dim))
    over["dtype"] = "float32"
    merged = {**values, **over}
    merged.pop("transformers_version", None)
    try:
        small = type(config).from_dict(merged)
    except Exception as exc:  # the class validates its values: say which config could not shrink
        raise ShrinkError(f"{type(config).__name__} rejects the small sizes: {exc}") from exc
    small._attn_implementation = getattr(config, "_attn_implementation", None) or "eager"
    return small
