"""The causal LM a run trains: loaded from ``model.path`` (whole, or as a skeleton read by part), or built
from ``model.config``, with LoRA adapters when asked; and the trial build on the meta device that turns a
bad ``model.config`` into a configuration error before any rank starts.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from pp_offload.recipe.config import ConfigError, RecipeConfig
from pp_offload.recipe.sources import missing_from_cache

__all__ = ["check_config_model", "hf_config_of", "load_model", "meta_model", "num_layers_of", "packing_note"]


def load_model(config: RecipeConfig, tokenizer: Any, *, partial: bool = False) -> nn.Module:
    """The causal LM on the CPU in fp32: from ``model.path``, or randomly initialised from ``model.config``.

    Every rank builds the same model (same seed); each then keeps the stages it holds. The vocabulary of
    a config-only model defaults to the tokenizer's. ``partial`` (pipelined runs): a pretrained model whose
    checkpoint is not in fp32 (bf16 on the hub) is returned as a skeleton on the meta device and
    `build_pipeline` reads only the rank's own tensors (`pp_offload.models.loading`: an fp32 checkpoint
    is memory-mapped by ``from_pretrained`` and costs no more); when the checkpoint cannot be read by part
    (no safetensors, names that do not match), the whole model is loaded, as without ``partial``.
    With a ``lora`` section the model (or the skeleton) comes back wrapped in a peft ``PeftModel``; its
    adapters are initialised by name (`pp_offload.models.lora.init_adapters`), so a rank that loads by part
    gets the same adapters as the unsplit model.
    """
    model = _load_model(config, tokenizer, partial=partial)
    return _with_lora(config, model) if config.lora is not None else model


def packing_note(model: nn.Module) -> str | None:
    """A line to print when ``model``'s family cannot keep packed documents apart, else None.

    The recipe packs several documents into each ``data.seq_len`` block and separates them through the
    position ids (they restart at 0 for each document). GPT-OSS, AFMoE and Falcon build their attention
    masks without the position ids in transformers' own forward, so their documents attend to the earlier
    documents of the same block; the split model does exactly what the unsplit one does (that is what
    ``split_model`` proves), so this is a property of the family, which the user should know about.
    """
    from pp_offload.models.families import UnsupportedModelError, family_of
    from pp_offload.models.lora import unwrap_peft

    try:
        family = family_of(unwrap_peft(model))
    except UnsupportedModelError:
        return None
    if family.mask_positions:
        return None
    return (
        f"note: {type(model).__name__} builds its attention masks without position ids, so documents packed "
        "into one data.seq_len block attend to the earlier documents of that block (transformers' own "
        "forward does the same); set data.seq_len near your documents' length to keep them mostly apart"
    )


def _with_lora(config: RecipeConfig, model: nn.Module) -> nn.Module:
    """``model`` wrapped by peft with the ``lora`` section's adapter, initialised from ``train.seed`` and
    each adapter's name: the same on every rank, whatever it holds, and on resume."""
    from pp_offload.models.families import UnsupportedModelError
    from pp_offload.models.lora import LoraError, apply_lora, init_adapters, unwrap_peft

    lora = config.lora
    assert lora is not None
    try:
        wrapped = apply_lora(
            model, r=lora.r, alpha=lora.alpha, dropout=lora.dropout, target_modules=lora.target_modules
        )
    except (LoraError, UnsupportedModelError) as error:
        raise ConfigError(f"lora: {error}") from error
    init_adapters(unwrap_peft(wrapped), seed=config.train.seed)  # a meta skeleton's: after its load
    return wrapped


def _load_model(config: RecipeConfig, tokenizer: Any, *, partial: bool) -> nn.Module:
    spec = config.model
    torch.manual_seed(config.train.seed)
    kwargs = {"attn_implementation": spec.attn_implementation, "dtype": torch.float32}
    if spec.path is not None:
        with missing_from_cache("model.path", spec.path):
            return _load_pretrained(spec.path, kwargs, partial)
    return _config_model(config, tokenizer, kwargs)


def check_config_model(config: RecipeConfig, tokenizer: Any, *, pipelined: bool) -> None:
    """Build ``model.config``'s model on the meta device (no memory, no time): entries that its config
    class accepts but its modules refuse (``n_embd`` not divisible by ``n_head``), or a family that
    cannot be pipelined, fail here as a configuration error instead of on every rank."""
    if config.model.config is None:
        return
    from pp_offload.models.families import family_of

    model = _quietly(lambda: _meta_config_model(config, tokenizer))
    if pipelined:
        family_of(model)  # UnsupportedModelError: a configuration error


def meta_model(config: RecipeConfig, tokenizer: Any) -> nn.Module:
    """The run's model (``model.config``'s or ``model.path``'s, with its LoRA adapters) with every tensor on
    the meta device: what ``--check`` splits and builds the pipeline from, without memory or weights."""

    def build() -> nn.Module:
        if config.model.config is not None:
            return _meta_config_model(config, tokenizer)
        from pp_offload.models.loading import empty_model

        with missing_from_cache("model.path", str(config.model.path)):
            return empty_model(
                str(config.model.path),
                attn_implementation=config.model.attn_implementation,
                dtype=torch.float32,
            )

    model = _quietly(build)
    if config.lora is not None:
        with torch.device("meta"):
            model = _with_lora(config, model)
    return model


def _meta_config_model(config: RecipeConfig, tokenizer: Any) -> nn.Module:
    with torch.device("meta"):
        return _config_model(
            config,
            tokenizer,
            {"attn_implementation": config.model.attn_implementation, "dtype": torch.float32},
        )


def _quietly(build: Any) -> Any:
    """``build()`` with transformers' notes silenced: a trial build's notes would come again from every
    rank."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return build()
    finally:
        hf_logging.set_verbosity(verbosity)


def _config_model(config: RecipeConfig, tokenizer: Any, kwargs: dict[str, Any]) -> nn.Module:
    from transformers import AutoModelForCausalLM

    values = dict(config.model.config or {})
    values.setdefault("vocab_size", len(tokenizer))
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        values.setdefault(key, getattr(tokenizer, key, None))
    hf_config = _hf_config(values)
    try:
        return AutoModelForCausalLM.from_config(hf_config, **kwargs)
    except (ValueError, TypeError, AssertionError) as error:
        if isinstance(error, ValueError) and "Unrecognized configuration class" in str(error):
            raise ConfigError(
                f"model.config: model_type={hf_config.model_type!r} has no causal LM in transformers"
            ) from error
        raise ConfigError(
            f"model.config: transformers cannot build a {hf_config.model_type!r} model from these entries: "
            f"{_short(error)}"
        ) from error


def _hf_config(values: dict[str, Any]) -> Any:
    """The transformers config of ``model.config``'s entries; a missing or unknown ``model_type`` or an
    entry its config class refuses is a configuration error naming it."""
    from transformers import AutoConfig

    values = dict(values)
    model_type = values.pop("model_type", None)
    if model_type is None:
        raise ConfigError("model.config needs a model_type (e.g. llama, qwen2, gpt2)")
    try:
        return AutoConfig.for_model(model_type, **values)
    except Exception as error:  # ValueError, TypeError, huggingface_hub's StrictDataclassError: the entries
        cause = error.__cause__ if isinstance(error.__cause__, (ValueError, TypeError)) else error
        raise ConfigError(f"model.config (model_type={model_type!r}): {_short(cause)}") from error


def _short(error: BaseException, limit: int = 300) -> str:
    """A dependency's error message on one line, cut to ``limit`` characters."""
    reason = " ".join(str(error).split()) or type(error).__name__
    return reason if len(reason) <= limit else reason[:limit] + "..."


def _load_pretrained(path: str, kwargs: dict[str, Any], partial: bool) -> nn.Module:
    """``model.path``'s model: a meta-device skeleton to be read by part (see `load_model`), or whole."""
    from transformers import AutoModelForCausalLM

    if partial:
        from pp_offload.models.loading import (
            PartialLoadError,
            check_checkpoint,
            checkpoint_dtypes,
            empty_model,
        )

        try:
            if checkpoint_dtypes(path) - {"F32", "I64", "I32", "BOOL"}:  # converted: load by part
                skeleton = empty_model(path, **kwargs)
                check_checkpoint(skeleton, path)
                return skeleton
        except PartialLoadError as error:
            if int(os.environ.get("RANK", "0")) == 0:
                print(f"loading the whole model on every rank: {error}", flush=True)
    return AutoModelForCausalLM.from_pretrained(path, **kwargs)


def num_layers_of(config: RecipeConfig) -> int | None:
    """The model's layer count from its config alone (no weights loaded), or None if it cannot be read."""
    return getattr(hf_config_of(config), "num_hidden_layers", None)


def hf_config_of(config: RecipeConfig) -> Any:
    """The model's transformers config (``model.config``'s entries, or ``model.path``'s config.json): what
    checks before a run read, without loading weights."""
    from transformers import AutoConfig

    spec = config.model
    if spec.config is not None:
        values = dict(spec.config)
        values.pop("vocab_size", None)
        return _hf_config(values)
    if spec.path is not None:
        return AutoConfig.from_pretrained(spec.path)
    raise ConfigError("set model.path (hub id or local dir) or model.config (a dict with model_type)")
