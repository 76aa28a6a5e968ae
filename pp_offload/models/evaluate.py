"""Validation loss of a causal LM, unsplit in one process or pipelined across ranks, forward only.

Why not torch's ``schedule.eval()``: it runs the training schedule itself with backward switched off,
replaying its whole order (backward, offload and FSDP actions included), and every switch between
training and evaluation re-initialises the stages' buffers (with a p2p warm-up) in the training
schedule's own state. Evaluation needs none of that: each rank runs its stages' forwards under
``torch.no_grad()`` (nothing saved, so no activation memory, no gradients and no offload
traffic), in stage order and, within a stage, microbatch order, passing hidden states to the rank that
holds the next stage with plain point-to-point sends. Every rank goes through its stages in increasing
index and only ever waits for a lower stage, whose rank never waits for a higher one, so the exchange
cannot deadlock; sends are asynchronous, so microbatches still flow down the pipeline while later ones
are computed.

The loss is the same token cross entropy as training (summed, then divided by the number of counted
targets of all evaluated blocks), so pipelined and one-process evaluation agree to fp32 rounding.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pp_offload.models.loss import IGNORE_INDEX

__all__ = ["EvalResult", "evaluate_model", "evaluate_pipeline"]

# dtype codes of the small header sent before each hidden-state tensor
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_HEADER = 8  # dtype code, ndim, up to 6 dims


@dataclass(frozen=True)
class EvalResult:
    """Mean token cross entropy over ``tokens`` counted targets (labels != -100), and its perplexity."""

    loss: float
    tokens: int

    @property
    def perplexity(self) -> float:
        return math.exp(min(self.loss, 700.0))  # exp overflows a float past ~709

    def to_dict(self) -> dict[str, float]:
        return {"loss": self.loss, "perplexity": self.perplexity, "tokens": self.tokens}


def _token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[float, int]:
    total = F.cross_entropy(
        logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return float(total), int((labels != IGNORE_INDEX).sum())


def _microbatches(batch: Mapping[str, torch.Tensor], n: int) -> list[dict[str, torch.Tensor]]:
    if n < 1:
        raise ValueError(f"microbatches must be >= 1, got {n}")
    rows = batch["input_ids"].shape[0]
    if rows % n:
        raise ValueError(f"a batch of {rows} rows does not split into {n} equal microbatches")
    keys = [k for k in ("input_ids", "labels", "position_ids", "packed_rows") if batch.get(k) is not None]
    parts = {k: batch[k].tensor_split(n) for k in keys}
    return [{k: parts[k][i] for k in keys} for i in range(n)]


def evaluate_model(
    model: nn.Module, batches: Iterable[Mapping[str, torch.Tensor]], *, microbatches: int = 1
) -> EvalResult:
    """The one-process reference: ``model`` (a causal LM, or a peft model around one) on each batch.

    Batches hold ``input_ids`` and ``labels`` (already shifted, as packed by `pp_offload.data`) and
    optionally ``position_ids``; ``microbatches`` only bounds the memory of one forward.
    """
    was_training = model.training
    model.eval()
    total, tokens = 0.0, 0
    device = next(model.parameters()).device
    try:
        with torch.no_grad():
            for batch in batches:
                for mb in _microbatches(batch, microbatches):
                    kwargs = {"use_cache": False}
                    if "position_ids" in mb:
                        kwargs["position_ids"] = mb["position_ids"].to(device)
                    logits = model(input_ids=mb["input_ids"].to(device), **kwargs).logits
                    part, count = _token_loss_sum(logits, mb["labels"].to(device))
                    total += part
                    tokens += count
    finally:
        model.train(was_training)
    return EvalResult(loss=total / max(tokens, 1), tokens=tokens)


def _stages_of(pipeline: Any) -> list[Any]:
    """The ``PipelineStage``s of a schedule (ours or torch's) or a list of stages."""
    if isinstance(pipeline, Sequence):
        return list(pipeline)
    from pp_offload.runtime.compat import schedule_stages

    return schedule_stages(pipeline)


def _send(tensor: torch.Tensor, peer: int, group: Any, tag: int) -> tuple[list[Any], tuple[Any, ...]]:
    if tensor.dim() > _HEADER - 2:
        raise ValueError(f"hidden states of {tensor.dim()} dims cannot be sent (at most {_HEADER - 2})")
    header = torch.zeros(_HEADER, dtype=torch.int64)
    header[0], header[1] = _DTYPES.index(tensor.dtype), tensor.dim()
    header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape)
    tensor = tensor.contiguous()
    if tensor.device.type == "cuda":
        header = header.to(tensor.device)
    return [
        dist.isend(header, dst=peer, group=group, tag=tag),
        dist.isend(tensor, dst=peer, group=group, tag=tag),
    ], (header, tensor)


def _recv(peer: int, group: Any, tag: int, device: torch.device) -> torch.Tensor:
    header = torch.zeros(_HEADER, dtype=torch.int64, device=device if device.type == "cuda" else "cpu")
    dist.recv(header, src=peer, group=group, tag=tag)
    code, ndim = int(header[0]), int(header[1])
    shape = [int(d) for d in header[2 : 2 + ndim]]
    out = torch.empty(shape, dtype=_DTYPES[code], device=device)
    dist.recv(out, src=peer, group=group, tag=tag)
    return out


def _global(group: Any, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def _reshard(module: nn.Module) -> None:
    """Free FSDP-unsharded parameters again after the evaluation forwards (no-op without FSDP)."""
    from torch.distributed.fsdp import FSDPModule

    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.reshard()


def evaluate_pipeline(
    pipeline: Any,
    batches: Iterable[Mapping[str, torch.Tensor]],
    *,
    microbatches: int,
    reduce_group: dist.ProcessGroup | None = None,
) -> EvalResult:
    """Validation loss of a pipelined model: call on every rank, with the same batches on every pipeline
    rank of a replica (each data-parallel replica its own batches).

    ``pipeline`` is a schedule built on this rank's ``PipelineStage``s (any of ours or torch's; their
    stage-to-rank placement is read from the stages after the schedule set it) or the list of stages.
    Only the stages' modules, their ``forward(x, position_ids=...)``, and their process group are used;
    the schedule's own state (buffers, saved activations, offload) is left untouched. The loss and token
    count are summed over ``reduce_group`` (default: every rank), so each rank returns the same result.
    """
    stages = sorted(_stages_of(pipeline), key=lambda s: s.stage_index)
    if not stages:
        raise ValueError("no pipeline stages on this rank")
    mine = {s.stage_index: s for s in stages}
    group = stages[0].group
    placement = dict(stages[0].stage_index_to_group_rank)
    num_stages = stages[0].num_stages
    device = torch.device(stages[0].device)
    total, tokens = 0.0, 0
    pending: list[Any] = []
    keep: list[Any] = []
    modes = {s.stage_index: s.submod.training for s in stages}
    for stage in stages:
        stage.submod.eval()
    try:
        with torch.no_grad():
            for batch in batches:
                mbs = _microbatches(batch, microbatches)
                local: dict[tuple[int, int], torch.Tensor] = {}
                for stage in stages:
                    s = stage.stage_index
                    for i, mb in enumerate(mbs):
                        if s == 0:
                            x = mb["input_ids"].to(device)
                        elif s - 1 in mine:
                            x = local.pop((s, i))
                        else:
                            x = _recv(_global(group, placement[s - 1]), group, s, device)
                        kwargs = {}
                        if "position_ids" in mb:
                            kwargs["position_ids"] = mb["position_ids"].to(device)
                        if "packed_rows" in mb:  # a host fact: stays on the CPU
                            kwargs["packed_rows"] = mb["packed_rows"]
                        out = stage.submod(x, **kwargs)
                        if s == num_stages - 1:
                            part, count = _token_loss_sum(out, mb["labels"].to(device))
                            total += part
                            tokens += count
                        elif s + 1 in mine:
                            local[(s + 1, i)] = out
                        else:
                            works, tensors = _send(out, _global(group, placement[s + 1]), group, s + 1)
                            pending.extend(works)
                            keep.append(tensors)
            for work in pending:
                work.wait()
    finally:
        for stage in stages:
            stage.submod.train(modes[stage.stage_index])
            _reshard(stage.submod)
    sums = torch.tensor([total, float(tokens)], dtype=torch.float64)
    if dist.is_initialized():
        if device.type == "cuda":
            sums = sums.to(device)
        dist.all_reduce(sums, group=reduce_group)
    loss_sum, count = float(sums[0]), int(sums[1])
    return EvalResult(loss=loss_sum / max(count, 1), tokens=count)
