"""The validation loss during a run: every ``train.eval_every`` steps and at the end, on the same held-out
batches each time (``data.eval_split`` / ``data.eval_path``, the first ``train.eval_batches`` of them).

Why forward only through the runner: the pipeline evaluates with its own stages and schedule (no saved
activations, no offload), the single process with the unsplit model, and both give the mean token loss
every rank agrees on, so the two are compared like the training losses.
"""

from __future__ import annotations

import torch

from pp_offload.data.batches import to_device
from pp_offload.models.evaluate import EvalResult
from pp_offload.recipe.config import RecipeConfig
from pp_offload.recipe.runner import Runner, precision

__all__ = ["HeldOut"]


class HeldOut:
    """``batches``: this data-parallel rank's slices of the held-out global batches (None: no held-out
    data, nothing is measured)."""

    def __init__(
        self,
        config: RecipeConfig,
        batches: list[dict[str, torch.Tensor]] | None,
        runner: Runner,
        device: torch.device,
        dp: int,
    ) -> None:
        self.batches = batches
        self.runner = runner
        self.device = device
        self.every = config.train.eval_every
        self.steps = config.train.steps
        self.microbatches = config.pipeline.microbatches
        self.precision = config.train.precision
        self.dp = dp

    @property
    def enabled(self) -> bool:
        return self.batches is not None

    def due(self, step: int) -> bool:
        """Whether to evaluate after 1-based ``step``, not the last (the final evaluation always runs)."""
        return bool(self.every) and step % self.every == 0 and step != self.steps

    def measure(self) -> EvalResult:
        """The held-out loss now: a collective over every rank."""
        assert self.batches is not None
        batches = [to_device(b, self.device) for b in self.batches]
        with precision(self.precision, self.device, self.dp):
            return self.runner.evaluate(batches, self.microbatches)

    def line(self, step: int, outcome: EvalResult) -> str:
        """What rank 0 prints for it."""
        return (
            f"eval step {step}/{self.steps}  loss {outcome.loss:.4f}  perplexity {outcome.perplexity:.2f}  "
            f"({outcome.tokens} tokens)"
        )
