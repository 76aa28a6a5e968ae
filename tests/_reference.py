"""The one-process reference the pipelined gloo tests compare with."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def sequential_reference(
    model: nn.Sequential,
    x: torch.Tensor,
    y: torch.Tensor,
    num_microbatches: int,
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Losses per microbatch and the gradients of the summed loss, keyed ``"{stage}.{name}"`` where stage
    ``s`` is ``model[s]``: what a pipeline of ``model``'s children must reproduce."""
    chunks = zip(x.chunk(num_microbatches), y.chunk(num_microbatches), strict=True)
    losses = [loss(model(xm), ym) for xm, ym in chunks]
    sum(losses).backward()
    grads = {f"{s}.{n}": p.grad for s, stage in enumerate(model) for n, p in stage.named_parameters()}
    return [t.detach() for t in losses], grads
