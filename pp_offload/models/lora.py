"""LoRA adapters (peft) on a causal LM that is then pipelined: apply, split, export.

Why apply before the split: peft replaces each targeted ``nn.Linear`` in place by a LoRA layer holding
the frozen ``base_layer`` and the small ``lora_A``/``lora_B``. Splitting the model underneath the
``PeftModel`` afterwards (`unwrap_peft`, used by `split_model`) keeps peft's parameter names in every stage
(``model.layers.3.self_attn.q_proj.lora_A.default.weight``), so checkpoints and the exported adapter map
back to the one ``PeftModel`` whatever the split, and only the adapter weights are trainable: the optimizer
built from ``requires_grad`` parameters holds only them, and their gradients are all the gradient norm sees.

Why the exports gather or merge per rank: a pipeline rank holds only its stages' adapters. A saved adapter
that holds only the first stage's layers loads without error and silently leaves the other layers
untrained, so `export_adapter` gathers every rank's adapter tensors (they are small) onto rank 0, which
writes peft's own format with peft's own ``save_pretrained``. The merged model is as large as the model, so
`merged_state` folds each rank's adapters into its own base weights (W + scaling * B @ A, peft's merge) and
every rank writes its shard as `export_pretrained` does.
"""

from __future__ import annotations

import hashlib
import math
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pp_offload.models.families import UnsupportedModelError, family_of

__all__ = [
    "LoraError",
    "adapter_state",
    "apply_lora",
    "base_state",
    "default_target_modules",
    "export_adapter",
    "init_adapters",
    "is_adapter_name",
    "is_peft_model",
    "merged_state",
    "unwrap_peft",
]

_ADAPTER = "default"  # peft's name for the one adapter get_peft_model creates
_PEFT_PREFIX = "base_model.model."  # what a PeftModel puts before the wrapped model's names


class LoraError(ValueError):
    """A LoRA setting that cannot work with this model; the message names the value and the fix."""


def is_peft_model(model: Any) -> bool:
    """Whether ``model`` is a peft ``PeftModel`` (checked without importing peft when it is not loaded)."""
    return type(model).__module__.startswith("peft.") and hasattr(model, "get_base_model")


def unwrap_peft(model: nn.Module) -> nn.Module:
    """The causal LM inside a ``PeftModel`` (its LoRA layers in place), or ``model`` itself."""
    return model.get_base_model() if is_peft_model(model) else model


def is_adapter_name(name: str) -> bool:
    """Whether a parameter name is a LoRA adapter's (``...q_proj.lora_A.default.weight``)."""
    return ".lora_" in name


def init_adapters(module: nn.Module, *, seed: int) -> int:
    """(Re)initialise every LoRA adapter under ``module`` as peft does (``lora_A`` uniform in
    +-1/sqrt(fan_in), i.e. kaiming-uniform with a=sqrt(5); ``lora_B`` zero), each from a generator seeded by
    ``seed`` and the parameter's name. Returns the number of adapter tensors set.

    Why by name: peft draws every adapter from the global random stream in module order, so a rank that
    builds only its own stages (a meta-device skeleton loaded by part) would draw other numbers than the
    unsplit model. Seeding each tensor by its name makes the adapters the same whatever the split.
    """
    count = 0
    with torch.no_grad():
        for name, param in module.named_parameters():
            if not is_adapter_name(name) or param.is_meta:
                continue
            if ".lora_B." in name:
                param.zero_()
            else:
                digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
                generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
                bound = 1.0 / math.sqrt(param.shape[1])
                values = torch.empty(param.shape, dtype=torch.float32).uniform_(
                    -bound, bound, generator=generator
                )
                param.copy_(values.to(param.device, param.dtype))
            count += 1
    return count


def _linear_types() -> tuple[type, ...]:
    from transformers.pytorch_utils import Conv1D  # GPT-2's projections

    return (nn.Linear, Conv1D)


def default_target_modules(model: nn.Module) -> list[str]:
    """Names (last path component) of every linear projection inside the decoder layers: attention and MLP
    (``q_proj``, ..., ``down_proj`` on Llama; ``c_attn``, ``c_proj``, ``c_fc`` on GPT-2). The LM head and
    the embeddings are not layers' projections and stay frozen."""
    model = unwrap_peft(model)
    family = family_of(model)
    layers = getattr(getattr(model, family.base), family.layers)
    names = set()
    for name, module in layers.named_modules():
        parts = name.split(".")
        if not name or "base_layer" in parts or any(p.startswith("lora_") for p in parts):
            continue  # inside a LoRA layer of an already wrapped model: the layer itself counts
        if isinstance(module, _linear_types()) or hasattr(module, "base_layer"):
            names.add(parts[-1])
    if not names:
        raise UnsupportedModelError(
            f"{type(model).__name__}: no linear projections found in its decoder layers for LoRA"
        )
    return sorted(names)


def apply_lora(
    model: nn.Module,
    *,
    r: int = 8,
    alpha: float = 16.0,
    dropout: float = 0.0,
    target_modules: Sequence[str] | None = None,
) -> nn.Module:
    """Wrap a transformers causal LM in a peft ``PeftModel`` with one LoRA adapter; freeze everything else.

    ``target_modules`` are module names as peft matches them (``q_proj`` matches every layer's); default:
    `default_target_modules`. Checks first that the model can be pipelined (`family_of`) and that every
    target exists, so a typo fails here, naming the projections the model does have, not after loading.
    """
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise LoraError(f"lora.r={r!r} must be an int >= 1 (the adapter rank, e.g. 8 or 16)")
    if not isinstance(alpha, (int, float)) or alpha <= 0:
        raise LoraError(f"lora.alpha={alpha!r} must be > 0 (the update is scaled by alpha / r)")
    if not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise LoraError(f"lora.dropout={dropout!r} must be in [0, 1)")
    if is_peft_model(model):
        raise LoraError("the model already is a PeftModel: apply LoRA to the plain transformers model once")
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as error:
        raise LoraError("LoRA needs peft: pip install 'pp-offload[hf]' (or pip install peft)") from error
    available = default_target_modules(model)  # raises UnsupportedModelError for a model we cannot split
    if target_modules is None:
        targets = available
    else:
        targets = [str(t) for t in target_modules]
        if not targets:
            raise LoraError("lora.target_modules is empty: name at least one projection, or leave it unset")
        names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
        unknown = [t for t in targets if t not in names and not any(n.endswith(t) for n in names)]
        if unknown:
            raise LoraError(
                f"lora.target_modules {unknown} not found in {type(model).__name__}; its decoder layers' "
                f"projections are {available}"
            )
    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=float(dropout),
        target_modules=targets,
        task_type="CAUSAL_LM",
        fan_in_fan_out=_input_major(model, targets),
    )
    with warnings.catch_warnings():
        # peft's PeftModel.__init__ reads ``model.is_gradient_checkpointing`` (peft 0.21), which transformers
        # 5 deprecates with a FutureWarning on every call; nothing a caller passes avoids that read
        warnings.filterwarnings(
            "ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning
        )
        return get_peft_model(model, config)


def _input_major(model: nn.Module, targets: Sequence[str]) -> bool:
    """Whether the targeted projections store their weight input-major (GPT-2's ``Conv1D``): peft's
    ``fan_in_fan_out``. peft would find out itself, with a warning per layer type; a mix of both kinds
    cannot be served by one flag."""
    from transformers.pytorch_utils import Conv1D

    kinds = {
        isinstance(module, Conv1D)
        for name, module in model.named_modules()
        if isinstance(module, _linear_types()) and any(name == t or name.endswith(f".{t}") for t in targets)
    }
    if len(kinds) > 1:
        raise LoraError(
            f"lora.target_modules {list(targets)} mix Conv1D and Linear projections, which need different "
            "peft fan_in_fan_out settings: target one kind"
        )
    return kinds == {True}


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def adapter_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's adapter tensors (whole, on the CPU) under the wrapped model's names.

    Under FSDP each is first gathered from its shards: a collective over the data-parallel ranks, so call
    it on every rank."""
    return {
        name: _full(tensor).detach().to("cpu")
        for name, tensor in module.state_dict().items()
        if is_adapter_name(name)
    }


def export_adapter(
    module: nn.Module,
    peft_model: nn.Module,
    out_dir: str | os.PathLike[str],
    *,
    group: dist.ProcessGroup | None = None,
    tokenizer: Any = None,
    base_model: str | None = None,
) -> Path | None:
    """Write the adapter of a pipelined ``PeftModel`` in peft's format (``adapter_config.json`` and
    ``adapter_model.safetensors``), loadable by ``PeftModel.from_pretrained(base, out_dir)``.
    ``base_model``: what the adapter config records as ``base_model_name_or_path`` (default: peft's, the
    name the base model was loaded from).

    ``module`` is this rank's split module (`ModelSplit.module`); call on every rank of ``group`` (the
    pipeline ranks; ``None``: the default group, or one process). Every rank's adapter tensors are gathered
    on rank 0 of ``group``, which writes them with peft's own ``save_pretrained`` and returns the directory
    (None on the other ranks). A missing layer is an error, not a partial adapter.
    """
    distributed = dist.is_available() and dist.is_initialized()
    mine = adapter_state(module)
    parts: list[Any] = [mine]
    if distributed:
        parts = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, mine, group=group)
    rank = dist.get_rank(group) if distributed else 0
    out = Path(out_dir)
    if rank == 0:
        state: dict[str, torch.Tensor] = {}
        for part in parts:
            state.update(part)
        expected = {
            name[len(_PEFT_PREFIX) :]
            for name, _ in peft_model.named_parameters()
            if ".lora_" in name and name.startswith(_PEFT_PREFIX)
        }
        missing = sorted(expected - set(state))
        if missing:
            raise LoraError(f"adapter export: no rank holds {missing[:3]} ({len(missing)} missing)")
        if base_model is not None:
            peft_model.peft_config[_ADAPTER].base_model_name_or_path = base_model
        peft_model.save_pretrained(str(out), state_dict={_PEFT_PREFIX + k: v for k, v in state.items()})
        if tokenizer is not None:
            tokenizer.save_pretrained(str(out))
    if distributed:
        dist.barrier(group)
    return out if rank == 0 else None


def merged_state(module: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (whole tensors of ``module``, peft names) with every LoRA layer merged into its base weight,
    under the plain transformers names (``q_proj.weight``): what ``from_pretrained`` loads.

    The merge is peft's: W + scaling * (B @ A), transposed for layers stored input-major (GPT-2's Conv1D).
    """
    return _plain_state(module, state, merge=True)


def base_state(module: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (whole tensors of ``module``, peft names) without the adapters, under the plain
    transformers names: the frozen base model the adapter was trained on, as ``from_pretrained`` loads it
    (what ``PeftModel.from_pretrained`` needs for a base model that exists nowhere else, one built from
    its config)."""
    return _plain_state(module, state, merge=False)


def _plain_state(
    module: nn.Module, state: dict[str, torch.Tensor], *, merge: bool
) -> dict[str, torch.Tensor]:
    from peft.tuners.lora import LoraLayer

    plain = dict(state)
    for prefix, layer in module.named_modules():
        if not isinstance(layer, LoraLayer):
            continue
        if _ADAPTER not in layer.lora_A:
            raise LoraError(f"{prefix}: expected peft's {_ADAPTER!r} adapter, found {list(layer.lora_A)}")
        base = plain.pop(f"{prefix}.base_layer.weight")
        a = plain.pop(f"{prefix}.lora_A.{_ADAPTER}.weight")
        b = plain.pop(f"{prefix}.lora_B.{_ADAPTER}.weight")
        if merge:
            delta = (b.float() @ a.float()) * float(layer.scaling[_ADAPTER])
            if getattr(layer, "fan_in_fan_out", False):
                delta = delta.T
            base = (base.float() + delta).to(base.dtype)
        plain[f"{prefix}.weight"] = base
        bias = plain.pop(f"{prefix}.base_layer.bias", None)
        if bias is not None:
            plain[f"{prefix}.bias"] = bias
    leftover = [name for name in plain if ".lora_" in name or ".base_layer." in name]
    if leftover:
        raise LoraError(f"{'merged' if merge else 'base'} export: unmerged LoRA tensors left: {leftover[:3]}")
    return plain
