"""What the training loop drives: one rank's way of computing a step's loss and gradients.

Why a protocol: the recipe trains the same model two ways, as pipeline stages over several processes
(`pp_offload.recipe.pipeline.Pipeline`) and unsplit in one process (`pp_offload.recipe.single_process.
SingleProcess`), the reference a pipelined run must reproduce. The loop (`pp_offload.recipe.train`) is one
loop for both: everything that differs (how a step runs, how the gradient norm is taken, how the held-out
loss is measured, which ranks hold the rest of the model) is a method here, and the loop never asks which
one it has.
"""

from __future__ import annotations

import contextlib
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pp_offload.models.evaluate import EvalResult
from pp_offload.runtime.progress import StepProgress

__all__ = ["Runner", "agree_on_step", "non_finite", "precision"]


class Runner(ABC):
    """One rank's share of training: its parameters (`module`, under Hugging Face names: the optimizer,
    checkpoints and the export read them) and the passes of a step."""

    @property
    @abstractmethod
    def name(self) -> str:
        """What the progress bar and ``summary.json`` call it: the schedule's name, or ``single process``."""

    @property
    @abstractmethod
    def module(self) -> nn.Module:
        """This rank's parameters, under the names of the Hugging Face model."""

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The ranks holding the other parts of this copy of the model (the export writes one shard each);
        None when this rank holds all of it."""
        return None

    @abstractmethod
    def begin_step(self, step: int) -> None:
        """Key the step's dropout masks to ``step`` (0-based), not to the random generator's history, so a
        resumed run and every layout draw the same masks."""

    @abstractmethod
    def forward_backward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Forward and backward over ``batch``'s microbatches (this data-parallel rank's slice, on the
        device), gradients accumulated. Returns this rank's part of the step's loss as a float64 scalar
        (the sum over its microbatches; zero where no loss is computed) without reading it on the host."""

    @abstractmethod
    def finish_backward(self, where: StepProgress, say: Callable[[str], None]) -> None:
        """What completes the gradients after `forward_backward` (collectives included; ``where`` names
        each for the stall report, ``say`` prints a line on rank 0)."""

    @abstractmethod
    def grad_norm(self, max_norm: float | None) -> torch.Tensor:
        """The whole model's gradient norm (over every rank, each gradient counted once), clipping to
        ``max_norm`` unless it is None."""

    @abstractmethod
    def evaluate(self, batches: list[dict[str, torch.Tensor]], microbatches: int) -> EvalResult:
        """The mean token loss on held-out ``batches``, forward only, agreed by every rank."""

    def track(self, where: StepProgress) -> Callable[[], None]:
        """Keep ``where.action`` on the action being executed, for the stall report; returns the undo."""
        return lambda: None

    def waiting_peer(self, where: StepProgress) -> int | None:
        """The rank the current action waits for, or None."""
        return None

    def timeline(self, out: Path, rank: int) -> Any:
        """A `pp_offload.recipe.timeline.StepTimeline` recording one step of this schedule, or None where
        there is no order to draw."""
        return None


def precision(train_precision: str, device: torch.device, dp: int) -> Any:
    """The context a step's passes run in: bf16 autocast for ``train.precision: bf16``, except with
    data-parallel replicas, where FSDP's bf16 parameter policy does it."""
    if train_precision == "bf16" and dp == 1:
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def agree_on_step(
    local_loss: torch.Tensor,
    norm: torch.Tensor,
    stop: bool,
    distributed: bool,
    device: torch.device | None = None,
) -> tuple[float, float, bool, bool]:
    """The step's loss, this rank's gradient norm, whether that norm is finite on every rank, whether any
    rank was asked to stop: one all-reduce over the whole job (the one the loss always took), so every
    rank decides alike, and one host read of all four at the end of the step."""
    where = device if device is not None and device.type == "cuda" else torch.device("cpu")  # NCCL: device
    norm = norm.detach().reshape(()).to(where, torch.float64)
    flags = torch.stack(
        [
            local_loss.detach().reshape(()).to(where, torch.float64),
            (~torch.isfinite(norm)).to(torch.float64),
            torch.tensor(1.0 if stop else 0.0, dtype=torch.float64, device=where),
        ]
    )
    if distributed:
        dist.all_reduce(flags)
    loss, bad_norm, stopping, own_norm = torch.cat([flags, norm.reshape(1)]).tolist()
    return loss, own_norm, bad_norm == 0, stopping > 0


def non_finite(loss: float, norm: float, norm_ok: bool) -> str:
    """``loss nan`` / ``grad norm inf`` / both: what made a step non-finite."""
    parts = [f"loss {loss}"] if not math.isfinite(loss) else []
    if not norm_ok:
        parts.append(f"grad norm {norm if not math.isfinite(norm) else 'nan on another rank'}")
    return ", ".join(parts)
