"""Write a pipelined model as one Hugging Face checkpoint that ``from_pretrained`` loads.

Why every rank writes its own shard: gathering a large model onto one rank needs that rank to hold all
of it. Each pipeline rank saves the parameters it holds (already under the model's own names) as one
safetensors shard, and rank 0 writes the shard index, the config and the tokenizer: the standard sharded
layout transformers reads. Weights tied to the input embedding (``tie_word_embeddings``) are saved once, as
transformers does. The directory appears complete or not at all (see ``pp_offload.fsutil``); on several
nodes ``out_dir`` must be on a shared filesystem.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pp_offload.fsutil import partial_dir, publish_dir

__all__ = ["export_pretrained"]


def _shard_tensors(module: nn.Module, tied: bool, head: str) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in module.state_dict().items():
        if tied and name == f"{head}.weight":
            continue  # saved as the input embedding; transformers re-ties it on load
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        tensors[name] = tensor.detach().to("cpu").contiguous()
    return tensors


def export_pretrained(
    module: nn.Module,
    config: Any,
    out_dir: str | os.PathLike[str],
    *,
    tokenizer: Any = None,
    group: dist.ProcessGroup | None = None,
    head: str = "lm_head",
    dtype: torch.dtype | None = None,
) -> Path:
    """Save this rank's ``module`` (parameters under HF names) as part of one HF model at ``out_dir``.

    Call on every rank of ``group`` (the pipeline ranks holding distinct parts; pass ``None`` for the default
    group, or when running in one process). ``dtype`` casts floating tensors (e.g. ``torch.bfloat16``).
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank(group) if distributed else 0
    size = dist.get_world_size(group) if distributed else 1
    scratch = partial_dir(out)
    if rank == 0:
        if scratch.exists():
            shutil.rmtree(scratch)
        scratch.mkdir(parents=True)
    if distributed:
        dist.barrier(group)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    tensors = _shard_tensors(module, tied, head)
    if dtype is not None:
        tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    file = "model.safetensors" if size == 1 else f"model-{rank + 1:05d}-of-{size:05d}.safetensors"
    if tensors:
        save_file(tensors, str(scratch / file), metadata={"format": "pt"})
    mine = {name: (file, t.numel() * t.element_size()) for name, t in tensors.items()}
    everyone: list[Any] = [None] * size
    if distributed:
        dist.all_gather_object(everyone, mine, group=group)
    else:
        everyone = [mine]
    if rank == 0:
        weight_map: dict[str, str] = {}
        total = 0
        for part in everyone:
            for name, (where, nbytes) in part.items():
                weight_map.setdefault(name, where)
                total += nbytes if weight_map[name] == where else 0
        if size > 1:
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (scratch / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        config.save_pretrained(scratch)
        if tokenizer is not None:
            tokenizer.save_pretrained(scratch)
        publish_dir(scratch, out)
    if distributed:
        dist.barrier(group)
    return out
