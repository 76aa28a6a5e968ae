"""Attention masks for pipeline stages, built without reading a device tensor on the host.

Why this module exists: transformers' mask builders, handed ``position_ids``, find out whether a row packs
several documents with ``if (packed_sequence_mask[:, -1] == 0).all()`` (``find_packed_sequence_indices``):
a host synchronization in every stage forward. On CUDA that tiny device-to-host read queues behind any
activation offload copy already on the copy engine, so the next forward is launched only when the whole
copy has ended (the 0% copy/compute overlap of the first GPU run). The fact it needs -- does a row hold more
than one document? -- is known on the host before the batch ever reaches the device, so the training loop
decides it there (`packed_rows`) and passes it to every stage as a CPU tensor keyword argument, split into
microbatches by ``schedule.step`` like ``position_ids``.

With that fact the masks equal transformers' own, value for value:

- no packed row: the builder gets no position ids (transformers then finds no packing either);
- packed rows: the builder gets a same-document mask function over document ids computed on the device
  (``cumsum`` of position-id breaks, no host read). transformers applies the same function, plus a remap of
  token indices to in-document positions; for causal and sliding-window masks that remap changes nothing
  (inside one document the positions step by one, as the indices do), so it is left out. Chunked attention
  (Llama 4) depends on absolute positions: there the position ids go to transformers as before, and its
  packing check stays (one host read per stage forward, documented in docs/models.md).

Callers without the host fact (``packed=None``) get transformers' behaviour: decided on the host when the
position ids are on the CPU, by transformers (a host read) otherwise. The builders' signatures changed across
transformers 5.x (``input_embeds`` -> ``inputs_embeds``, ``past_key_values`` -> ``cache``, ``cache_position``
dropped); `build_mask` passes each what its installed signature names, so no deprecated argument is used.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["PACKED_ROWS_KEY", "build_mask", "document_ids", "packed_rows"]

PACKED_ROWS_KEY = "packed_rows"
"""The keyword argument (and batch key) carrying `packed_rows` to every stage's forward."""

_POSITION_DEPENDENT_KINDS = frozenset({"chunked_attention"})
"""Layer kinds whose mask depends on absolute in-document positions, not only on document membership."""


def _breaks(position_ids: torch.Tensor) -> torch.Tensor:
    """Where a row's position ids do not step by one (a new document starts), as transformers reads them."""
    first = position_ids[:, :1] - 1
    return torch.diff(position_ids, prepend=first, dim=-1) != 1


def packed_rows(position_ids: torch.Tensor) -> torch.Tensor:
    """Per row, whether it packs more than one document: a CPU bool tensor of shape ``(batch,)``.

    Call it on the host copy of the batch (before moving it to the device). It is transformers' own test
    (``find_packed_sequence_indices``: a break in the position ids after the first token), per row."""
    if position_ids.dim() == 1:
        position_ids = position_ids.unsqueeze(0)
    return _breaks(position_ids.detach().cpu())[:, 1:].any(dim=-1)


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Per token, the index of its document within its row (0, 0, 1, 1, 1, 2, ...), computed where the
    position ids are, without a host read."""
    return _breaks(position_ids).cumsum(-1)


def _any_on_host(packed: torch.Tensor) -> bool:
    """Whether any row packs documents, read from host memory through numpy: no aten op runs, so nothing
    can wait on a device; a device tensor is refused (it would be the very read this module avoids)."""
    if packed.device.type != "cpu":
        raise ValueError(
            f"packed_rows must stay on the CPU (the host's fact about the batch), got a tensor on "
            f"{packed.device}; compute it with pp_offload.models.masks.packed_rows before moving the batch"
        )
    return bool(packed.numpy().any())


@functools.cache
def _parameters(build: Callable[..., Any]) -> frozenset[str]:
    return frozenset(inspect.signature(build).parameters)


def _call(build: Callable[..., Any], config: Any, hidden: torch.Tensor, **kwargs: Any) -> Any:
    """``build(...)`` with the names its installed signature has (module doc)."""
    names = _parameters(build)
    args: dict[str, Any] = {"config": config}
    args["inputs_embeds" if "inputs_embeds" in names else "input_embeds"] = hidden
    if "cache" in names:
        args["cache"] = None
    elif "past_key_values" in names:
        args["past_key_values"] = None
    if "cache_position" in names:
        args["cache_position"] = torch.arange(hidden.shape[1], device=hidden.device)
    return build(**args, **kwargs)


def build_mask(
    build: Callable[..., Any],
    *,
    config: Any,
    hidden: torch.Tensor,
    attention_mask: Any,
    position_ids: torch.Tensor | None,
    packed: torch.Tensor | None,
    kind: str = "full_attention",
    extra: dict[str, Any] | None = None,
    uniform: bool = False,
) -> Any:
    """The mask ``build`` (a transformers mask builder such as ``create_causal_mask``) gives for a layer of
    ``kind``, without a host read when ``packed`` (`packed_rows` of the batch, on the CPU) is given.

    ``position_ids`` None means the family builds its masks without them (no packing check at all).

    ``uniform``: never None (transformers' ``allow_is_causal_skip=False``), for compiled layers. A causal
    mask of unpacked rows is None by default (sdpa then runs its causal kernel without a mask) and a tensor
    for packed rows; a compiled layer guards on that difference and compiles a second graph the first time
    the other kind of microbatch comes, possibly many steps in. With a tensor for both, packed and
    unpacked microbatches share one graph; the price is the masked attention kernel for unpacked rows
    (the same values: an explicit causal mask). The mask is made contiguous too: transformers expands the
    causal mask of unpacked rows over the batch (stride 0) where a packed one has its own rows, and a
    compiled layer guards on strides."""
    if uniform:
        mask = build_mask(
            build,
            config=config,
            hidden=hidden,
            attention_mask=attention_mask,
            position_ids=position_ids,
            packed=packed,
            kind=kind,
            extra={**(extra or {}), "allow_is_causal_skip": False}
            if "allow_is_causal_skip" in _parameters(build)
            else extra,
        )
        return mask.contiguous() if isinstance(mask, torch.Tensor) else mask
    extra = dict(extra or {})
    if position_ids is None or attention_mask is not None:
        # transformers checks packing only without a padding mask: nothing to decide here
        return _call(build, config, hidden, attention_mask=attention_mask, position_ids=position_ids, **extra)
    if packed is None and position_ids.device.type == "cpu":
        packed = packed_rows(position_ids)
    any_packed = packed is not None and _any_on_host(packed)
    if packed is None or kind in _POSITION_DEPENDENT_KINDS and any_packed:
        return _call(build, config, hidden, attention_mask=None, position_ids=position_ids, **extra)
    if not any_packed:
        return _call(build, config, hidden, attention_mask=None, position_ids=None, **extra)
    from transformers.masking_utils import and_masks, packed_sequence_mask_function

    ids = document_ids(position_ids.expand(hidden.shape[0], -1))
    same_document = packed_sequence_mask_function(ids)
    given = extra.pop("and_mask_function", None)
    combined = same_document if given is None else and_masks(given, same_document)
    extra["allow_is_causal_skip"] = False  # packed documents never give a plain causal mask
    if "allow_is_causal_skip" not in _parameters(build):
        del extra["allow_is_causal_skip"]
    return _call(
        build, config, hidden, attention_mask=None, position_ids=None, and_mask_function=combined, **extra
    )
