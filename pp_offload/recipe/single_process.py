"""The recipe in one process: the unsplit model on the same microbatches, summed like the pipeline.

Why: it is the reference a pipelined run must reproduce (same losses, gradients and weights), and what a
plain ``python recipes/finetune.py`` trains. It draws the pipeline's dropout masks (keyed by step,
microbatch and layer) and weighs a router's auxiliary loss as the pipeline does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pp_offload.models import TokenCrossEntropy, router_aux_of
from pp_offload.models.evaluate import EvalResult, evaluate_model
from pp_offload.recipe.runner import Runner
from pp_offload.runtime.dropout_keys import DropoutKeys, key_dropout
from pp_offload.runtime.progress import StepProgress

__all__ = ["ONE_PROCESS_NOTE", "SingleProcess"]

#: What a one-process run says first: it is the reference, not a pipeline, and how to get the pipeline.
ONE_PROCESS_NOTE = (
    "finetune: one process: training the unsplit model (no pipeline split); to split it, start one "
    "process per pipeline rank: pp-offload train --nproc-per-node N (or torchrun --nproc-per-node N)"
)


class SingleProcess(Runner):
    """The unsplit ``model`` (under peft's wrapper, the model it wraps: named as the stages are), each step
    cut into ``microbatches`` as the pipeline cuts it."""

    def __init__(self, model: nn.Module, microbatches: int, seed: int = 0) -> None:
        self._module = model
        self.microbatches = microbatches
        aux = router_aux_of(model)  # weighed as the pipeline weighs it: the mean over the microbatches
        self.loss_fn = TokenCrossEntropy(None if aux is None else aux.coef / microbatches)
        self.dropout = DropoutKeys(seed=seed)  # the pipeline's masks: keyed by step, microbatch and layer
        key_dropout(model, self.dropout)

    @property
    def name(self) -> str:
        return "single process"

    @property
    def module(self) -> nn.Module:
        return self._module

    def begin_step(self, step: int) -> None:
        self.dropout.step = step

    def forward_backward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        self.loss_fn.num_target_tokens = int(batch["num_target_tokens"])
        total = 0.0
        chunks = zip(
            *(batch[k].tensor_split(self.microbatches) for k in ("input_ids", "labels", "position_ids")),
            strict=True,
        )
        for j, (input_ids, labels, position_ids) in enumerate(chunks):
            with self.dropout.running(j):
                out = self._module(input_ids=input_ids, position_ids=position_ids, use_cache=False)
                aux = out.aux_loss if self.loss_fn.router_aux_weight is not None else None
                loss = self.loss_fn(out.logits if aux is None else (out.logits, aux), labels)
                loss.backward()
            total += float(loss.detach())
        return torch.tensor(total, dtype=torch.float64)

    def finish_backward(self, where: StepProgress, say: Callable[[str], None]) -> None:
        """Nothing: the one process holds every gradient whole."""

    def grad_norm(self, max_norm: float | None) -> torch.Tensor:
        params = self._module.parameters()
        grads = [p.grad.detach().double().pow(2).sum() for p in params if p.grad is not None]
        norm = torch.stack(grads).sum().sqrt() if grads else torch.zeros((), dtype=torch.float64)
        if max_norm is not None:
            torch.nn.utils.clip_grads_with_norm_(self._module.parameters(), max_norm, norm.float())
        return norm

    def evaluate(self, batches: list[dict[str, torch.Tensor]], microbatches: int) -> EvalResult:
        return evaluate_model(self._module, batches, microbatches=microbatches)
