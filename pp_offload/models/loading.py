"""Load only this rank's share of a pretrained model: a skeleton on the meta device, then the owned weights.

Why: ``AutoModelForCausalLM.from_pretrained`` on every pipeline rank puts the whole model in every
process's host memory (a 70B model in fp32 is 280 GB per process, eight processes per node), although
each rank keeps a ``1 / pp`` share. Here the model is built on the meta device (no memory), split, and
only the tensors of the split's modules are read from the checkpoint's safetensors files, which are
memory-mapped, so a rank's peak is about its own share. On the hub, only the shards holding owned
tensors are downloaded (``transformers.utils.cached_file``).

Non-persistent buffers (rotary ``inv_freq``, Gemma's ``embed_scale``) are not in checkpoints: they are
recomputed with the model's own ``_init_weights``, as transformers does after its own meta-device load.
A checkpoint whose tensor names cannot be matched to the model's (other than by the base-model prefix
or a tied LM head), or one without safetensors, raises `PartialLoadError`; the recipe then falls back to
loading the whole model.

When it pays: a checkpoint in another dtype than the training one (bf16 on the hub, fp32 master weights
here) is converted tensor by tensor, so ``from_pretrained`` materialises the whole converted model
(``bench/bench_loading.py``: a 134M-parameter Llama, bf16 checkpoint, rank 1 of 4 holding 22% of the
weights: peak RSS +957 MiB above the imports with ``from_pretrained``, +285 MiB loading by part). A
checkpoint already in the training dtype is memory-mapped by ``from_pretrained`` and tensors nobody
touches never become resident (same model in fp32: +108 MiB vs +339 MiB by part, which copies), so the
recipe loads by part only when the dtypes differ.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pp_offload.models.split import ModelSplit

__all__ = ["PartialLoadError", "check_checkpoint", "checkpoint_dtypes", "empty_model", "load_split_weights"]

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


class PartialLoadError(RuntimeError):
    """The checkpoint cannot be loaded tensor by tensor; the message says why."""


def empty_model(path: str | os.PathLike[str], **kwargs: Any) -> nn.Module:
    """The model of ``path`` (hub id or local directory) with every parameter on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, **kwargs)


def _file(path: str, name: str) -> str | None:
    if Path(path).is_dir():
        candidate = Path(path) / name
        return str(candidate) if candidate.is_file() else None
    from transformers.utils import cached_file

    return cached_file(path, name, _raise_exceptions_for_missing_entries=False)


def _weight_map(path: str) -> dict[str, str]:
    """Checkpoint tensor name -> file name (relative to the checkpoint)."""
    index = _file(path, _INDEX)
    if index is not None:
        return dict(json.loads(Path(index).read_text())["weight_map"])
    single = _file(path, _SINGLE)
    if single is None:
        raise PartialLoadError(
            f"{path} has no {_SINGLE} or {_INDEX} (only safetensors checkpoints load by part)"
        )
    from safetensors import safe_open

    with safe_open(single, framework="pt") as f:
        return {name: _SINGLE for name in f.keys()}  # noqa: SIM118 (safe_open is not a mapping)


def _checkpoint_name(name: str, available: set[str], model: nn.Module) -> str:
    """The checkpoint's name for the model's tensor ``name`` (a LoRA layer's frozen ``base_layer`` is the
    checkpoint's projection)."""
    name = name.replace(".base_layer.", ".")
    if name in available:
        return name
    prefix = f"{getattr(model, 'base_model_prefix', '')}."
    if name.startswith(prefix) and name[len(prefix) :] in available:
        return name[len(prefix) :]  # a base-model checkpoint (e.g. GPT-2's "h.0....")
    head = model.get_output_embeddings()
    if getattr(model.config, "tie_word_embeddings", False) and head is not None:
        if name == _weight_name(model, head):  # a tied head is saved as the input embedding
            return _checkpoint_name(_weight_name(model, model.get_input_embeddings()), available, model)
    raise PartialLoadError(f"the checkpoint has no tensor for {name!r}")


def _sources(module: nn.Module, model: nn.Module, path: str) -> tuple[dict[str, str], dict[str, str]]:
    """(checkpoint name -> file, ``module``'s tensor name -> checkpoint name)."""
    weight_map = _weight_map(path)
    available = set(weight_map)
    names = [n for n in module.state_dict(keep_vars=True) if ".lora_" not in n]  # adapters: not in it
    return weight_map, {name: _checkpoint_name(name, available, model) for name in names}


def checkpoint_dtypes(path: str | os.PathLike[str]) -> set[str]:
    """The safetensors dtypes (``"BF16"``, ``"F32"``, ...) of the checkpoint's tensors (of its first
    shard), without reading them."""
    from safetensors import safe_open

    path = str(path)
    first = sorted(set(_weight_map(path).values()))[0]
    local = _file(path, first)
    if local is None:
        raise PartialLoadError(f"{path}: shard {first} named in the index is missing")
    with safe_open(local, framework="pt") as f:
        return {f.get_slice(name).get_dtype() for name in f.keys()}  # noqa: SIM118


def check_checkpoint(model: nn.Module, path: str | os.PathLike[str]) -> None:
    """Raise `PartialLoadError` unless every tensor of ``model`` (an `empty_model`) can be read from the
    checkpoint at ``path`` by name: call before splitting, to fall back to a full load early."""
    _sources(model, model, str(path))


def _shared_parameters(module: nn.Module) -> list[list[str]]:
    """Names of parameters registered more than once (a tied embedding and LM head), grouped."""
    groups: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _weight_name(model: nn.Module, module: nn.Module) -> str:
    """The model's name for ``module``'s weight (``lm_head.weight``, ``model.embed_tokens.weight``)."""
    return next(f"{name}.weight" for name, sub in model.named_modules() if sub is module)


def load_split_weights(
    split: ModelSplit, model: nn.Module, path: str | os.PathLike[str], *, dtype: torch.dtype = torch.float32
) -> int:
    """Materialise ``split.module`` (built from `empty_model`) on the CPU with the checkpoint's tensors.

    Returns the number of tensors read. Parameters of ``model`` outside the split stay on the meta device.
    LoRA adapters (peft) are not in the checkpoint: they are left uninitialised here
    (`pp_offload.models.lora.init_adapters` sets them).
    Raises `PartialLoadError` when a tensor cannot be found (nothing is half-loaded that is then used:
    the caller falls back to a full load).
    """
    from safetensors import safe_open

    path = str(path)
    module = split.module
    weight_map, wanted = _sources(module, model, path)
    shared = _shared_parameters(module)
    module.to_empty(device="cpu")  # new tensors, one per registration: ties are re-made below
    for first, *others in shared:
        param = module.get_parameter(first)
        for other in others:
            owner, _, attr = other.rpartition(".")
            setattr(module.get_submodule(owner), attr, param)
    state = module.state_dict(keep_vars=True)
    for sub in module.modules():  # non-persistent buffers are not in checkpoints: recompute them
        if sub._non_persistent_buffers_set:
            model._init_weights(sub)
    by_file: dict[str, list[str]] = {}
    for name, source in wanted.items():
        by_file.setdefault(weight_map[source], []).append(name)
    loaded = 0
    with torch.no_grad():
        for file, names in sorted(by_file.items()):
            local = _file(path, file)
            if local is None:
                raise PartialLoadError(f"{path}: shard {file} named in the index is missing")
            with safe_open(local, framework="pt") as f:
                for name in names:
                    target = state[name]
                    tensor = f.get_tensor(wanted[name])
                    if tuple(tensor.shape) != tuple(target.shape):
                        raise PartialLoadError(
                            f"{name}: checkpoint shape {tuple(tensor.shape)}, model shape "
                            f"{tuple(target.shape)}"
                        )
                    target.copy_(tensor.to(dtype) if tensor.is_floating_point() else tensor)
                    loaded += 1
    return loaded
