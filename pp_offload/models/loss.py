"""Token-level cross entropy for pipelined causal LMs, normalised by the step's global target count.

Why not the model's own mean loss per microbatch: a mean per microbatch weighs a microbatch with few target
tokens (padding, masked prompts) as much as a full one, and the sum over microbatches and data-parallel
ranks would not be the unsplit model's loss on the whole batch. Summing token losses and dividing by the
number of target tokens of the whole global batch makes the pipelined step's loss and gradients exactly the
unsplit model's, with ``scale_grads=False`` (torch's scale_grads would divide a weight shared by two stages
on one rank, such as a tied embedding, twice).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pp_offload.data.packing import IGNORE_INDEX

__all__ = ["IGNORE_INDEX", "TokenCrossEntropy"]


class TokenCrossEntropy:
    """``loss_fn(logits, labels)`` for the last stage: summed token cross entropy / ``num_target_tokens``.

    Labels are already shifted (``labels[:, t]`` is the token after ``input_ids[:, t]``) and
    ``IGNORE_INDEX`` marks targets that do not count. Set :attr:`num_target_tokens` before each step to the
    global batch's count of counted targets (all microbatches, all data-parallel ranks).
    """

    def __init__(self) -> None:
        self.num_target_tokens: int | None = None

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.num_target_tokens is None:
            raise RuntimeError("TokenCrossEntropy.num_target_tokens is not set: set it before each step")
        total = F.cross_entropy(
            logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        )
        return total / max(int(self.num_target_tokens), 1)
