"""A Hugging Face model config, reduced to the numbers the planner's formulas need.

Two layer layouts are modelled, the two the planner's activation formulas were validated on:

- ``"llama"``: decoders whose configs declare ``base_model_pp_plan`` (Llama, Mistral, Qwen2, Qwen3...):
  RMSNorm, rotary embeddings, grouped-query attention, gated MLP (``hidden_size``, ``intermediate_size``,
  ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``hidden_act``). Qwen3's per-head
  q/k RMSNorm is added when the config is a ``qwen3`` one.
- ``"gpt2"``: GPT-2 (``n_embd``, ``n_layer``, ``n_head``, ``n_inner``, ``activation_function``): LayerNorm,
  learned positions, fused QKV projection, plain MLP, dropout.

Mixture-of-experts configs are refused (their memory and time are not those of a dense MLP).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pp_offload.plan.shapes import SHAPES, shape

__all__ = ["ModelSpec", "model_spec"]

_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")


@dataclass(frozen=True)
class ModelSpec:
    """What the planner knows about the model (see the module doc for the two layouts)."""

    name: str
    family: str  # "llama" or "gpt2"
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    hidden_act: str
    max_positions: int = 0  # learned position table rows (GPT-2)
    qk_norm: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    resid_dropout: float = 0.0
    embd_dropout: float = 0.0
    # LoRA fine-tuning: adapters of this rank on every projection of the decoder layers (the recipe's
    # default targets), everything else frozen; 0: every weight is trained. See `pp_offload.plan.costs`
    # (W shrinks to the adapters' weight gradient) and `pp_offload.plan.memory.state_bytes`.
    lora_rank: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.lora_rank, bool) or not isinstance(self.lora_rank, int) or self.lora_rank < 0:
            raise ValueError(f"lora_rank must be an int >= 0 (0: full fine-tuning), got {self.lora_rank!r}")

    @property
    def q_size(self) -> int:
        """Width of the attention's query projection (heads x head_dim)."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of one of the key / value projections (kv heads x head_dim)."""
        return self.num_kv_heads * self.head_dim

    def describe(self) -> str:
        gqa = f", {self.num_kv_heads} kv heads" if self.num_kv_heads != self.num_heads else ""
        return (
            f"{self.name} ({self.family} layout): {self.num_layers} layers, hidden {self.hidden_size}, "
            f"MLP {self.intermediate_size} ({self.hidden_act}), "
            f"{self.num_heads} heads of {self.head_dim}{gqa}, "
            f"vocab {self.vocab_size}{', tied embeddings' if self.tie_word_embeddings else ''}"
            f"{f', LoRA rank {self.lora_rank} (base frozen)' if self.lora_rank else ''}"
        )


def model_spec(model: Any) -> ModelSpec:
    """`ModelSpec` from a transformers ``PretrainedConfig``, a dict (a config.json's content), the name of a
    shape in `pp_offload.plan.shapes.SHAPES` (``"llama-3-8b"``, offline), a local path (a model directory
    or a config .json file) or a hub id (resolved by ``AutoConfig.from_pretrained``)."""
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, str) and (named := shape(model)) is not None and not Path(model).exists():
        return _from_mapping({**named, "_name_or_path": model}, default_name=model)
    if isinstance(model, (str, os.PathLike)):
        return _from_mapping(_load(model), default_name=str(model))
    if isinstance(model, Mapping):
        return _from_mapping(model, default_name="model")
    if hasattr(model, "to_dict") and hasattr(model, "model_type"):  # a transformers PretrainedConfig
        return _from_config(model)
    raise TypeError(
        "model must be a transformers PretrainedConfig, a dict, a local path or a hub id, "
        f"got {type(model).__name__}"
    )


def _load(path_or_id: str | os.PathLike[str]) -> dict[str, Any]:
    path = Path(path_or_id).expanduser()
    if path.is_file():
        try:
            return json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read the model config {str(path)!r}: {e}") from e
    if path.is_dir() and (path / "config.json").is_file():
        return _load(path / "config.json")
    text = str(path_or_id)
    if not path.exists() and (
        path.suffix == ".json" or text.startswith((".", "/", "~")) or os.sep + os.sep in text
    ):
        raise ValueError(f"cannot resolve the model {text!r}: no such file or directory")
    if path.exists():
        raise ValueError(
            f"{str(path)!r} is neither a config .json file nor a model directory with a config.json"
        )
    try:
        from transformers import AutoConfig
    except ImportError as e:  # pragma: no cover - transformers is an optional dependency
        raise ValueError(
            f"{str(path_or_id)!r} is not a local file or directory, and resolving hub ids needs transformers "
            f"(pip install 'pp-offload[hf]')"
        ) from e
    try:
        config = AutoConfig.from_pretrained(str(path_or_id))
    except Exception as e:
        first_line = str(e).splitlines()[0] if str(e) else ""
        raise ValueError(
            f"cannot resolve the model {str(path_or_id)!r}: not a local file or directory, not a shape known "
            f"offline ({', '.join(SHAPES)}), and AutoConfig.from_pretrained failed "
            f"({type(e).__name__}: {first_line})"
        ) from e
    return _config_dict(config)


def _config_dict(config: Any) -> dict[str, Any]:
    """A config's fields, with the computed ones (``head_dim``...) its attributes provide."""
    data = dict(config.to_dict())
    for key in ("head_dim", "num_key_value_heads", "intermediate_size", "hidden_act", "tie_word_embeddings"):
        value = getattr(config, key, None)
        if value is not None:
            data[key] = value
    return data


def _from_config(config: Any) -> ModelSpec:
    return _from_mapping(_config_dict(config), default_name=type(config).__name__)


def _from_mapping(cfg: Mapping[str, Any], *, default_name: str) -> ModelSpec:
    if "text_config" in cfg and isinstance(cfg["text_config"], Mapping) and "hidden_size" not in cfg:
        cfg = cfg["text_config"]  # multimodal wrappers: plan the language model
    model_type = str(cfg.get("model_type") or "")
    name = str(cfg.get("_name_or_path") or model_type or default_name)
    moe = [k for k in _MOE_KEYS if cfg.get(k)]
    if moe:
        raise ValueError(
            f"{name}: mixture-of-experts configs ({', '.join(moe)}) are not modelled by the planner; "
            f"it estimates dense decoders (Llama-family and GPT-2 layouts)"
        )
    if model_type == "gpt2" or ("n_embd" in cfg and "n_layer" in cfg):
        return _gpt2(cfg, name)
    if "hidden_size" in cfg and "num_hidden_layers" in cfg:
        return _llama(cfg, name, model_type)
    raise ValueError(
        f"{name}: unsupported config (model_type={model_type!r}); the planner knows Llama-family decoders "
        f"(hidden_size, intermediate_size, num_attention_heads, num_hidden_layers, ...) and GPT-2 "
        f"(n_embd, n_layer, n_head, ...)"
    )


def _int(cfg: Mapping[str, Any], key: str, name: str, default: Any = None) -> int:
    value = cfg.get(key, default)
    if value is None:
        raise ValueError(f"{name}: the config has no {key!r}")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: config {key!r} must be a positive int, got {value!r}")
    return value


def _prob(cfg: Mapping[str, Any], key: str) -> float:
    value = cfg.get(key) or 0.0
    return float(value)


def _llama(cfg: Mapping[str, Any], name: str, model_type: str) -> ModelSpec:
    hidden = _int(cfg, "hidden_size", name)
    heads = _int(cfg, "num_attention_heads", name)
    kv_heads = _int(cfg, "num_key_value_heads", name, heads)
    head_dim = cfg.get("head_dim") or hidden // heads
    if heads % kv_heads:
        raise ValueError(
            f"{name}: num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})"
        )
    return ModelSpec(
        name=name,
        family="llama",
        hidden_size=hidden,
        intermediate_size=_int(cfg, "intermediate_size", name),
        num_layers=_int(cfg, "num_hidden_layers", name),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(head_dim),
        vocab_size=_int(cfg, "vocab_size", name),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        hidden_act=str(cfg.get("hidden_act") or cfg.get("hidden_activation") or "silu"),
        qk_norm=model_type.startswith("qwen3"),
        attention_bias=bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        resid_dropout=0.0,
        embd_dropout=0.0,
    )


def _gpt2(cfg: Mapping[str, Any], name: str) -> ModelSpec:
    hidden = _int(cfg, "n_embd", name)
    heads = _int(cfg, "n_head", name)
    if hidden % heads:
        raise ValueError(f"{name}: n_embd ({hidden}) must be a multiple of n_head ({heads})")
    return ModelSpec(
        name=name,
        family="gpt2",
        hidden_size=hidden,
        intermediate_size=cfg.get("n_inner") or 4 * hidden,
        num_layers=_int(cfg, "n_layer", name),
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        vocab_size=_int(cfg, "vocab_size", name),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        hidden_act=str(cfg.get("activation_function") or "gelu_new"),
        max_positions=_int(cfg, "n_positions", name, 1024),
        attention_bias=True,
        mlp_bias=True,
        resid_dropout=_prob(cfg, "resid_pdrop"),
        embd_dropout=_prob(cfg, "embd_pdrop"),
    )
