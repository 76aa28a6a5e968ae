"""What each group of ops that selective recompute re-runs buys: the bytes it stops saving against the HBM
traffic its recomputation costs, for one Llama-family decoder layer.

Why: selective recompute (`pp_offload.runtime.recompute`) re-runs every elementwise op of a layer, but
the groups differ by far. For Llama-3-8B in bf16 (h 4096, MLP 14336), per token (bytes freed / bytes of
traffic): the MLP's activation and gated product 57344 / 143360 (0.40 freed per byte of traffic), the two
RMSNorms with the residual sum 49160 / 319488 (0.15), rotary 0 / 102400 (it frees nothing: the attention
kernel saves the rotated q and k, the same bytes as the projections' outputs selective keeps instead).
So the MLP group frees 54% of selective's bytes for 25% of its recompute time: the ``"mlp"`` recompute
mode (`pp_offload.recompute_plan`) recomputes only that group. The planner's numbers:
``bench/bench_offload_scale.py``.

The figures are the planner's own formulas split by group (`pp_offload.plan.memory`): the groups' freed
bytes add up to a plain layer's bytes minus a selective layer's, their traffic to
`pp_offload.plan.memory.layer_recompute_traffic` (tested).
"""

from __future__ import annotations

from dataclasses import dataclass

from pp_offload.plan.memory import (
    SMALL_NUMEL,
    Precision,
    layer_recompute_traffic,
    mlp_recompute_freed,
    precision,
)
from pp_offload.plan.model import ModelSpec

__all__ = ["RecomputeGroup", "recompute_groups"]


def _big(numel: int, nbytes: int) -> int:
    """Bytes of a saved tensor the activation store would move (0: left on the device as too small)."""
    return numel * nbytes if numel > SMALL_NUMEL else 0


@dataclass(frozen=True)
class RecomputeGroup:
    """One group of recomputed ops of a layer, for one microbatch: bytes it stops saving, HBM bytes its
    recomputation reads and writes (per backward pass that recomputes it)."""

    name: str
    freed: int
    traffic: int

    @property
    def freed_per_traffic(self) -> float:
        return self.freed / self.traffic if self.traffic else 0.0


def recompute_groups(
    spec: ModelSpec, dtype: str | Precision, *, microbatch_size: int, seq_len: int
) -> list[RecomputeGroup]:
    """The groups of one Llama-family layer's selective recompute (module doc); ValueError for other
    layouts."""
    if spec.family != "llama":
        raise ValueError(f"recompute groups are modelled for Llama-family layers, not {spec.family!r}")
    p = precision(dtype)
    a, n = p.act_bytes, microbatch_size * seq_len
    h, q, kv = spec.hidden_size, spec.q_size, spec.kv_size
    kw = {"microbatch_size": microbatch_size, "seq_len": seq_len}
    rsqrt = _big(n, 4)
    casts = 0 if a == 4 else 2 * (a + 4)

    def norm_traffic(width: int) -> int:
        return (casts + 8 + 4 + 8 + 2 * a) * width

    # two RMSNorms stop saving their fp32 input, rsqrt, normalised and output tensors; the layer input and
    # the o projection's output are kept instead (the residual sum is recomputed from them)
    norms = 2 * (4 * h * n + rsqrt + 2 * a * h * n) - 2 * a * h * n
    norms_traffic = n * (2 * norm_traffic(h) + 3 * a * h)
    if spec.qk_norm:  # per-head q and k norms: fp32 copy, rsqrt per head, normalised
        for width, heads in ((q, spec.num_heads), (kv, spec.num_kv_heads)):
            norms += 4 * width * n + _big(n * heads, 4) + a * width * n
            norms_traffic += n * norm_traffic(width)
    mlp_traffic = layer_recompute_traffic(spec, p, mode="mlp", **kw)
    return [
        RecomputeGroup("MLP activation and gated product", mlp_recompute_freed(spec, p, **kw), mlp_traffic),
        RecomputeGroup("RMSNorms and residual sum", norms, norms_traffic),
        RecomputeGroup("rotary embedding", 0, n * 10 * a * (q + kv)),
    ]
