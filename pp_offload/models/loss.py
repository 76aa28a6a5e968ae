"""Token-level cross entropy for pipelined causal LMs, normalised by the step's global target count.

Why not the model's own mean loss per microbatch: a mean per microbatch weighs a microbatch with few target
tokens (padding, masked prompts) as much as a full one, and the sum over microbatches and data-parallel
ranks would not be the unsplit model's loss on the whole batch. Summing token losses and dividing by the
number of target tokens of the whole global batch makes the pipelined step's loss and gradients exactly the
unsplit model's, with ``scale_grads=False`` (torch's scale_grads would divide a weight shared by two stages
on one rank, such as a tied embedding, twice).

A model with a router aux loss (MoE with ``output_router_logits``) has its last stage return
``(logits, aux_loss)``, the aux loss of that microbatch. transformers adds ``router_aux_loss_coef x aux``
to each forward's loss; a step of ``m`` microbatches on ``dp`` replicas is ``m x dp`` forwards, so each
adds ``coef x aux / (m x dp)``: the step's loss is the cross entropy of the whole batch plus ``coef`` times
the MEAN aux loss of its microbatches, what one process computes with gradient accumulation over the same
microbatches (loss divided by the accumulation steps). It equals the unsplit model on the whole batch only
for one microbatch: the aux loss is a product of two means over the forward's tokens, not linear in them.
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

    def __init__(self, router_aux_weight: float | None = None) -> None:
        self.num_target_tokens: int | None = None
        #: ``router_aux_loss_coef / (microbatches x data-parallel replicas)``: the weight of one
        #: microbatch's router aux loss when the last stage returns ``(logits, aux_loss)``
        self.router_aux_weight = router_aux_weight

    def __call__(
        self, output: torch.Tensor | tuple[torch.Tensor, torch.Tensor], labels: torch.Tensor
    ) -> torch.Tensor:
        if self.num_target_tokens is None:
            raise RuntimeError("TokenCrossEntropy.num_target_tokens is not set: set it before each step")
        logits, aux = output if isinstance(output, tuple) else (output, None)
        total = F.cross_entropy(
            logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        )
        loss = total / max(int(self.num_target_tokens), 1)
        if aux is None:
            return loss
        if self.router_aux_weight is None:
            raise RuntimeError(
                "the last stage returned a router aux loss but TokenCrossEntropy.router_aux_weight is not "
                "set: set it to router_aux_loss_coef / (microbatches x data-parallel replicas)"
            )
        return loss + self.router_aux_weight * aux.float().sum()  # the stage's (1,)-shaped aux loss
