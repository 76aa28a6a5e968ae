"""Seconds per pass: a stage's forward (F), input-gradient (I) and weight-gradient (W) passes, one
chunk's copy to or from host memory, and one point-to-point transfer between neighbouring ranks.

Compute time = matmul FLOPs / (peak FLOP/s x MFU); everything that is not a matmul (norms, activations,
softmax, optimizer) is folded into the MFU. Per token of a decoder layer, with ``P`` the weights of its
projections: F = 2P + attention, I = 2P + 2.5 x attention, W = 2P. Attention is counted for a causal
kernel that skips masked blocks: QK^T and AV over on average ``seq/2`` keys, ``2 * seq * q_width`` FLOPs
per token forward; flash attention's backward recomputes the scores, 2.5x the forward, all of it in I
(attention has no weights). The LM head is a projection like any other (2 h V each for F, I, W); the
embedding lookup and its gradient are memory-bound and counted as free. Copies: bytes / host bandwidth;
transfers between ranks: hidden-state bytes / p2p bandwidth + latency.

Activation recompute (``recompute``, `pp_offload.plan.memory.RECOMPUTE`): F is unchanged and every backward
pass of a recomputed layer first re-runs what was not kept. With split backward, I and W are two autograd
calls and each recomputes once (so both grow; torch's stage 0, which runs one full backward at W, recomputes
once, at W), and a full backward B recomputes once, not twice (``PassTimes.shared``): the counts are
`pp_offload.recompute_plan.recomputations`, the rule the runtime follows. ``"selective"`` re-runs the
elementwise ops, memory-bound: their HBM traffic (`pp_offload.plan.memory.layer_recompute_traffic`) over
the machine's ``hbm_bandwidth`` at its datasheet peak (optimistic: unfused elementwise kernels reach
~80-90% of it). ``"full"`` re-runs the layer's forward (matmuls and attention, at the same MFU).

LoRA (``spec.lora_rank``): the base weights are frozen, so W computes only the adapters' weight gradients,
2 x (adapter parameters) per token, a few percent of a full W at usual ranks; F and I each add the
adapters' own matmuls (2 x adapter parameters), and the LM head has no W at all. Zero-bubble schedules fill
bubbles with W passes, so with LoRA there is almost nothing to fill them with (measured, not assumed:
``bench/bench_lora.py`` times W on CPU, and ``schedule: auto`` uses the probe's measured W).
"""

from __future__ import annotations

from dataclasses import dataclass

from pp_offload.plan.machines import Machine
from pp_offload.plan.memory import (
    Precision,
    layer_mode,
    layer_recompute_traffic,
    lora_layer_params,
    precision,
)
from pp_offload.plan.model import ModelSpec
from pp_offload.recompute_plan import parse_recompute, recomputations

__all__ = [
    "PassTimes",
    "head_flops",
    "layer_flops",
    "layer_unit_shares",
    "p2p_seconds",
    "recompute_seconds",
    "split_extras",
    "stage_times",
    "transfer_seconds",
]

_FLASH_BACKWARD = 2.5


@dataclass(frozen=True)
class PassTimes:
    """Durations of one stage's passes for one microbatch (seconds, or FLOPs per token)."""

    F: float
    I: float
    W: float
    shared: float = 0.0
    """Time included in both I and W that one full backward B runs once (a recomputation):
    B = I + W - shared."""

    @property
    def total(self) -> float:
        return self.F + self.I + self.W

    @property
    def B(self) -> float:
        """One full backward (schedules without split backward)."""
        return self.I + self.W - self.shared

    def __add__(self, other: PassTimes) -> PassTimes:
        return PassTimes(self.F + other.F, self.I + other.I, self.W + other.W, self.shared + other.shared)

    def scaled(self, factor: float) -> PassTimes:
        return PassTimes(self.F * factor, self.I * factor, self.W * factor, self.shared * factor)


def _projection_weights(spec: ModelSpec) -> int:
    h, i, q, k = spec.hidden_size, spec.intermediate_size, spec.q_size, spec.kv_size
    mlp = (3 if spec.family == "llama" else 2) * h * i
    return h * q + 2 * h * k + q * h + mlp


def layer_flops(spec: ModelSpec, *, seq_len: int) -> PassTimes:
    """FLOPs per token of one decoder layer's F, I and W passes (with LoRA: see the module doc)."""
    matmul = 2.0 * _projection_weights(spec)
    adapters = 2.0 * lora_layer_params(spec)
    attention = 2.0 * seq_len * spec.q_size  # causal: QK^T and AV over seq/2 keys on average
    weight = adapters if spec.lora_rank else matmul
    return PassTimes(matmul + adapters + attention, matmul + adapters + _FLASH_BACKWARD * attention, weight)


def layer_unit_shares(spec: ModelSpec, *, seq_len: int) -> tuple[float, float]:
    """Shares of one decoder layer's F + I + W FLOPs in its attention half (q/k/v/o projections and the
    attention kernel) and in the rest (the MLP): sub-layer offload units
    (`pp_offload.plan.memory.layer_unit_bytes`) take these shares of a stage's passes. Why one share for
    all passes: the simulator times a unit's part of F and of the backward with one share; F + I + W
    weighs them as a step does (attention's backward is heavier than its forward, and has no W)."""
    h, i = spec.hidden_size, spec.intermediate_size
    llama = spec.family == "llama"
    matmul = 2.0 * (3 if llama else 2) * h * i  # gate, up, down (GPT-2: c_fc, c_proj)
    adapters = 2.0 * spec.lora_rank * ((3 if llama else 2) * (h + i))
    mlp = PassTimes(matmul + adapters, matmul + adapters, adapters if spec.lora_rank else matmul)
    share = mlp.total / layer_flops(spec, seq_len=seq_len).total
    return (1.0 - share, share)


def head_flops(spec: ModelSpec) -> PassTimes:
    """FLOPs per token of the LM head's F, I and W passes."""
    x = 2.0 * spec.hidden_size * spec.vocab_size
    return PassTimes(x, x, 0.0 if spec.lora_rank else x)  # LoRA: the head is frozen, no W


def split_extras(spec: ModelSpec, *, seq_len: int) -> tuple[float, float]:
    """(first_extra, last_extra) for `pp_offload.plan.split.balanced_split`: the embedding's and the head's
    F+I+W time in decoder layers. The embedding is memory-bound and counted as 0."""
    return 0.0, head_flops(spec).total / layer_flops(spec, seq_len=seq_len).total


def stage_times(
    spec: ModelSpec,
    machine: Machine,
    dtype: str | Precision,
    *,
    layers: int,
    first: bool,
    last: bool,
    microbatch_size: int,
    seq_len: int,
    recompute: str = "none",
    deferred_w: bool = True,
) -> PassTimes:
    """Seconds of one stage's F, I and W passes for one microbatch; with ``recompute``, each pass includes
    the recomputations of the stage's recomputed layers (all of them, or the plan's share: module doc) that
    the runtime makes in it (`pp_offload.recompute_plan.recomputations`: under deferred W (``deferred_w``,
    the runtime's default) one in I and none in W; under torch's retained-graph split I and W one each, the
    first stage's I none), and ``shared`` the one a full backward makes instead of two."""
    p = precision(dtype)
    per_token = layer_flops(spec, seq_len=seq_len).scaled(layers)
    if last:
        per_token = per_token + head_flops(spec)
    times = per_token.scaled(microbatch_size * seq_len / machine.flops_for(p.name))
    kw = {"microbatch_size": microbatch_size, "seq_len": seq_len}
    plan = parse_recompute(recompute)
    extra = sum(recompute_seconds(spec, machine, p, recompute=mode, **kw) for mode in plan.modes(layers))
    rule = {"first_stage": first, "once": plan.once, "deferred_w": deferred_w}
    at_i, at_w = (recomputations(kind, **rule) for kind in ("I", "W"))
    shared = extra * (at_i + at_w - recomputations("B", **rule))
    return PassTimes(times.F, times.I + extra * at_i, times.W + extra * at_w, shared)


def recompute_seconds(
    spec: ModelSpec,
    machine: Machine,
    dtype: str | Precision,
    *,
    microbatch_size: int,
    seq_len: int,
    recompute: str,
) -> float:
    """Seconds one backward pass (I or W) spends recomputing one decoder layer for one microbatch: 0
    without recompute, HBM traffic / bandwidth for ``"selective"``, the layer's forward for ``"full"``."""
    p = precision(dtype)
    recompute = layer_mode(recompute)
    if recompute == "none":
        return 0.0
    if recompute in ("selective", "mlp"):
        traffic = layer_recompute_traffic(
            spec, p, microbatch_size=microbatch_size, seq_len=seq_len, mode=recompute
        )
        return traffic / machine.hbm_bandwidth
    return layer_flops(spec, seq_len=seq_len).F * microbatch_size * seq_len / machine.flops_for(p.name)


def transfer_seconds(nbytes: float, machine: Machine) -> float:
    """One-way device<->host copy of ``nbytes`` (pinned host memory)."""
    return nbytes / machine.host_bandwidth


def p2p_seconds(
    spec: ModelSpec, machine: Machine, dtype: str | Precision, *, microbatch_size: int, seq_len: int
) -> float:
    """One hidden-state (or its gradient) transfer between neighbouring stages on different ranks."""
    nbytes = precision(dtype).act_bytes * spec.hidden_size * microbatch_size * seq_len
    return nbytes / machine.p2p_bandwidth + machine.p2p_latency
