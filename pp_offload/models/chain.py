"""Run a model's pipeline stages one after another in one process.

Why a module of its own: the split (`pp_offload.models.split`) and its proof (`pp_offload.models.verify`,
which chains a shrunken copy's stages to compare them with the unsplit model) both need it, and the split
calls the proof; with the chaining here neither imports the other in a circle.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["chain_stages"]


def chain_stages(
    stages: Sequence[nn.Module], input_ids: torch.Tensor, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run ``stages`` (all of a model's, in order) in one process: ``(logits, router aux loss or None)``.

    What the pipeline does across ranks, for proofs and tests: each stage gets the previous one's whole
    output (hidden states, and the router sums when the model has a router aux loss); ``kwargs``
    (``position_ids``, ``attention_mask``) reach every stage, as ``schedule.step``'s keyword arguments do.
    """
    out: Any = (input_ids,)
    for stage in stages:
        out = stage(*(out if isinstance(out, tuple) else (out,)), **kwargs)
    if isinstance(out, tuple):
        return out[0], out[1]
    return out, None
