"""Bytes per pipeline stage: saved activations of one microbatch, parameters, gradients, optimizer state
and the receive buffers torch's pipelining keeps.

Activations are counted the way `pp_offload.runtime.store.ActivationStore` sees them: every tensor autograd
saves in the stage's forward, once per storage (views of one tensor count once), except parameters,
storages of at most 1024 elements, and the stage's own input (it sits in torch's receive buffer, counted
separately). The formulas below were derived by reading transformers' Llama and GPT-2 modules and checked
tensor by tensor with saved-tensor hooks (``tests/test_plan.py``; ``bench/bench_plan.py`` prints the
comparison). Per token, with ``a`` bytes per activation element (2 in bf16, 4 in fp32), hidden ``h``,
query width ``q``, key/value width ``k``, MLP width ``i``, ``H`` heads:

Llama layer (RMSNorm, rotary embeddings, sdpa attention, gated MLP):
  2 norms x (4h: the fp32 copy of the input that ``pow``/``mul`` save; + a*h normalised; + a*h the norm's
  output, saved by the next projection), attention a*(2q + 2k) (rotated q and k, v, output; the
  o_proj input is a view of the output), 4H (fp32 log-sum-exp), MLP a*4i (gate, activation, up, product)
  => 8h + 4a*h + a*(2q + 2k) + 4a*i. In fp32 the first norm saves the layer input itself (no copy), which
  for a stage's first layer is the receive buffer: 4h less. Rotary cos/sin, 2*a*head_dim, once per stage.
GPT-2 layer (LayerNorm, fused QKV, gelu_new MLP):
  a*(7h + 5i): LayerNorm saves its input (the layer input, then the residual sum), its output feeds the
  next projection, the QKV projection's output is saved whole (q, k, v are views), the attention output;
  gelu_new (a Python formula) saves 4 tensors of width i, and its output feeds c_proj.
Activation checkpointing (``recompute``, `RECOMPUTE`), per decoder layer:
- ``"selective"``: keep what the backward needs so that everything it recomputes is elementwise (norms,
  rotary, residual sum, activation function, gated product), i.e. the outputs of the matmuls and of the
  attention kernel that feed it, and the layer input: Llama a*(h + q + 2k + q + h + 2i) + 4H: the layer input
  (the first norm is recomputed from it), the q and k projections' outputs (rotary is recomputed from
  them), v, the attention output and its log-sum-exp, the o projection's output (the residual sum feeding
  the second norm is recomputed from it and the input), gate and up. GPT-2: a*(h + (q + 2k) + q + h + i) + 4H:
  input, fused QKV output, attention output, c_proj's output, c_fc's output. The down projection's output
  is not kept (the next layer's input is the residual sum, kept there). These are exactly the bytes of a
  layer's store entry under `pp_offload.runtime.recompute` (``bench/bench_recompute.py`` measures them on
  real HF layers; ``tests/test_recompute_plan.py`` compares).
  Dropout masks are not kept (the recompute replays the RNG state).
- ``"full"``: only the layer input (a*h), which on a stage's first layer is the receive buffer (0).
  The stage's final norm is counted as without recompute in every mode, its rotary cos/sin only while at
  least one of its layers runs its attention uncheckpointed (checkpointed layers get them as inputs,
  outside the store).
- ``"mlp"``: ``"selective"`` on the layer's MLP block only (`mlp_recompute_freed`; the ops that free the
  most bytes per byte of recompute traffic: `pp_offload.plan.recompute_groups`).
- A mode on a share of a stage's layers (``"selective:0.75"``, `pp_offload.recompute_plan`): the first
  ``ceil(share x layers)`` layers in that mode, the others as without recompute (`layers_activation_bytes`).
Embedding stage: the token ids (int64) and the embedding output (saved by the first norm).
Deferred weight gradients (``queued``, `queued_bytes`; the default of every split-backward schedule,
`pp_offload.runtime.deferred_w`): the input-gradient pass I is one ordinary backward that frees the saved
tensors, and what lives from I to W is the queue: per trainable linear-like layer its input X and its output
gradient dY, each distinct storage once. Llama layer: X a*(2h + q + i) (q/k/v share the first norm's output,
gate/up the second's; o_proj reads the attention output, down_proj the gated product), dY a*(q + 2k + 2h +
2i) (q, k, v; o_proj's is the gradient of the residual sum after attention; gate, up; down_proj's is the
layer output's gradient). GPT-2: X a*(2h + q + i), dY a*((q + 2k) + 2h + i). The last layer of a stage that
is not the last: its down_proj / c_proj dY *is* the stage output's gradient, torch's receive buffer (counted
by `recv_buffer_bytes`), so a*h less, unless a residual dropout copies it first. The LM head: X a*h (the final
norm's output), dY a*vocab (the logits' gradient, in the model's dtype). LoRA (``spec.lora_rank`` r): only
the adapters queue, base weights and the head are frozen: A reads what the base layer reads (shared as
above, LoRA dropout 0 assumed) and its dY is r wide, B reads A's output (r) and its dY is the projection's
output width (a scaled copy, so never the receive buffer); on the first stage the first layer's q/k/v A
adapters read the frozen embedding's normed output, which wants no gradient: they compute their weight
gradient in I (a*(h + 3r) less; GPT-2's one c_attn A: a*(h + r)). Without deferred W (torch's retained-graph
split, ``deferred_w=False``) nothing is queued and the saved tensors live until W instead.
Head stage: the final norm (as above), then the logits are not saved by the head; the loss (outside the
stage's forward, so never offloaded) keeps fp32 log-probabilities, 4 x vocab per token.

Assumptions (state them when quoting a number):
- sdpa or flash attention, no padding mask: nothing of size seq^2 is saved; grouped-query attention runs
  inside the kernel (``enable_gqa``), so k and v stay at the kv-head width. With a padding mask, transformers
  repeats k/v to all heads and the math kernel may save the seq^2 attention matrix: not modelled.
- ``bf16``/``fp16``: the model's parameters and activations in that dtype (``model.to(dtype)``), not
  autocast over fp32 parameters (which saves extra cast copies).
- Dropout with p > 0 saves a 1-byte mask per dropped element (CUDA's fused dropout); attention dropout
  inside flash attention saves only its RNG state.
- The stage's output is held by torch's ``fwd_cache`` from its forward to its input-gradient pass (counted
  as ``output``); the last stage's logits likewise. ``schedule.step(..., return_outputs=False)`` is assumed:
  torch's default keeps every microbatch's logits until the step ends.
- Activation functions other than silu/swish/gelu/gelu_pytorch_tanh/relu/gelu_new are assumed to save
  only their input.
- Optimizer: AdamW with fp32 moments (8 bytes/param) plus fp32 master weights (4 bytes/param) when the
  parameters are bf16/fp16; gradients in the parameter dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

from pp_offload.plan.model import ModelSpec
from pp_offload.recompute_plan import MODES, parse_recompute

__all__ = [
    "PRECISIONS",
    "RECOMPUTE",
    "ChunkActivation",
    "Precision",
    "StateBytes",
    "chunk_activation",
    "layer_activation_bytes",
    "layer_mode",
    "layer_unit_bytes",
    "layers_activation_bytes",
    "layers_unit_bytes",
    "mlp_recompute_freed",
    "layer_params",
    "layer_recompute_traffic",
    "precision",
    "queued_bytes",
    "recv_buffer_bytes",
    "stage_params",
    "state_bytes",
    "transient_bytes",
]

RECOMPUTE = MODES
"""Activation checkpointing modes of the decoder layers (module doc): none, recompute the elementwise ops
from the kept matmul/attention outputs, or recompute the whole layer from its input. A plan may apply a
mode to the first share of each stage's layers only (``"selective:0.75"``,
`pp_offload.recompute_plan.RecomputePlan`): `chunk_activation` and `layers_activation_bytes` take plans,
`layer_activation_bytes` (one layer) a mode."""

SMALL_NUMEL = 1024
"""The activation store leaves storages of at most this many elements on the device (and we do not count
them): `pp_offload.runtime.store.ActivationStore`'s ``min_numel``."""


@dataclass(frozen=True)
class Precision:
    """Bytes per element of activations and per parameter of weights, gradients and optimizer state."""

    name: str
    act_bytes: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    """AdamW's two fp32 moments (8) plus fp32 master weights (4) when parameters are not fp32."""


PRECISIONS: dict[str, Precision] = {
    "bf16": Precision("bf16", 2, 2, 2, 12),
    "fp16": Precision("fp16", 2, 2, 2, 12),
    "fp32": Precision("fp32", 4, 4, 4, 8),
}


def precision(dtype: str | Precision) -> Precision:
    if isinstance(dtype, Precision):
        return dtype
    key = str(dtype).lower().removeprefix("torch.").replace("bfloat16", "bf16").replace("float32", "fp32")
    key = key.replace("float16", "fp16")
    if key not in PRECISIONS:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(PRECISIONS)}")
    return PRECISIONS[key]


# activation -> (saves its input, other saved tensors of the input's size)
_ACTIVATIONS = {
    "silu": (True, 0),
    "swish": (True, 0),
    "gelu": (True, 0),
    "gelu_pytorch_tanh": (True, 0),
    "relu": (False, 0),  # saves its output, which the next op saves anyway
    "gelu_new": (True, 3),  # 0.5*x*(1+tanh(c*(x+0.044715*x^3))): tanh, 1+tanh and 0.5*x
}


def activation_is_modelled(name: str) -> bool:
    return name in _ACTIVATIONS


def _big(numel: int, nbytes: int) -> int:
    """Bytes of a saved tensor, 0 when the store would leave it on the device as too small."""
    return numel * nbytes if numel > SMALL_NUMEL else 0


@dataclass(frozen=True)
class ChunkActivation:
    """Activation memory of one stage for one microbatch (bytes).

    saved: what autograd saves in the stage's forward, as the activation store captures it: offloadable.
    output: the stage's output, held by torch from the forward to the input-gradient pass.
    loss: what the loss saves (last stage; computed outside the stage's forward, so not offloaded).
    held_after_input: what a ``+once`` recompute plan recomputes in I and keeps on the device until W (the
        recomputed layers' bytes beyond what they save in the forward) under torch's retained-graph split;
        0 on the first stage, where torch runs the whole backward at W, and without ``+once``. Deferred W
        keeps none of it (its I releases the graph).
    queued: deferred weight gradients (`queued_bytes`): the bytes the W queue holds from the end of the
        chunk's I to the end of its W, when ``saved`` and ``resident`` are already freed. ``None``: torch's
        retained-graph split, where ``saved`` lives until W ends and nothing is queued.
    """

    saved: int
    output: int = 0
    loss: int = 0
    held_after_input: int = 0
    queued: int | None = None

    @property
    def total(self) -> int:
        return self.saved + self.output + self.loss

    @property
    def resident(self) -> int:
        """What stays on the device when the chunk is offloaded."""
        return self.output + self.loss


def check_recompute(recompute: str) -> str:
    """``recompute`` as its canonical plan string (``"selective:0.75"``, ``"full"``; a share of 1 is the
    plain mode) if it names a mode of `RECOMPUTE`, with or without a share, else a ValueError naming the
    value and the forms (`pp_offload.recompute_plan.parse_recompute`)."""
    return parse_recompute(recompute).label


def layer_mode(recompute: str) -> str:
    """The mode of one layer: a plan with a share below 1 says nothing about a single layer."""
    plan = parse_recompute(recompute)
    if not plan.uniform:
        raise ValueError(
            f"recompute {recompute!r} applies to a share of a stage's layers; for one layer give its mode "
            f"({plan.mode!r} or 'none'), for a stage use chunk_activation or layers_activation_bytes"
        )
    return plan.mode


def layer_activation_bytes(
    spec: ModelSpec,
    dtype: str | Precision,
    *,
    microbatch_size: int,
    seq_len: int,
    count_input: bool = True,
    recompute: str = "none",
) -> int:
    """Bytes one decoder layer saves for backward for one microbatch (rotary cos/sin excluded: they are
    shared by the stage's layers, see `chunk_activation`).

    ``count_input=False``: the layer's input is the stage's input (a receive buffer, kept by the pipeline),
    so a tensor that *is* that input is not counted (fp32 RMSNorm and LayerNorm save it as is).
    ``recompute``: what stays saved under activation checkpointing (module doc).
    """
    p = precision(dtype)
    a, n = p.act_bytes, microbatch_size * seq_len
    h, i, q = spec.hidden_size, spec.intermediate_size, spec.q_size
    lse = _big(microbatch_size * spec.num_heads * seq_len, 4)
    layer_input = a * h * n if count_input else 0
    recompute = layer_mode(recompute)
    if recompute == "full":
        return layer_input
    if recompute == "mlp":
        plain = layer_activation_bytes(
            spec, p, microbatch_size=microbatch_size, seq_len=seq_len, count_input=count_input
        )
        return plain - mlp_recompute_freed(spec, p, microbatch_size=microbatch_size, seq_len=seq_len)
    if recompute == "selective":
        kv = spec.kv_size
        if spec.family == "gpt2":  # fused QKV output, attention output, c_proj output, c_fc output
            return layer_input + a * (q + 2 * kv) * n + a * q * n + lse + a * h * n + a * i * n
        # q and k before rotary, v, attention output, o projection output, gate, up
        return layer_input + a * (q + 2 * kv) * n + a * q * n + lse + a * h * n + 2 * a * i * n
    saves_input, extra = _ACTIVATIONS.get(spec.hidden_act, (True, 0))
    drop = n * h if spec.resid_dropout > 0 else 0  # 1-byte masks
    total = _attention_unit_bytes(spec, p, n=n, lse=lse, count_input=count_input)  # up to attention's return
    if spec.family == "gpt2":
        ln_stats = 2 * _big(n, 4)  # mean and rstd of one LayerNorm (fp32 on CUDA; CPU keeps bf16 in bf16)
        total += a * h * n + ln_stats  # residual sum = ln_2 input
        total += a * h * n  # ln_2 output = c_fc input
        total += (
            a * i * n * ((1 if saves_input else 0) + extra + 1)
        )  # c_fc out, activation internals, c_proj in
        total += drop  # resid dropout after the MLP
        return total
    total += 4 * h * n + _big(n, 4) + 2 * a * h * n  # post-attention RMSNorm on the residual sum
    total += (
        a * i * n * ((1 if saves_input else 0) + extra + 3)
    )  # gate, activation internals, act, up, product
    return total


def layers_activation_bytes(
    spec: ModelSpec,
    dtype: str | Precision,
    *,
    layers: int,
    first: bool,
    microbatch_size: int,
    seq_len: int,
    recompute: str = "none",
) -> list[int]:
    """Bytes each of a stage's ``layers`` decoder layers saves for one microbatch, first layer first, under
    the recompute plan ``recompute`` (its mode on the first share of the layers,
    `pp_offload.recompute_plan`): what the activation store captures per layer, so what budget offload
    moves per layer. The stage's first layer reads its receive buffer unless the stage is the ``first``
    (there it reads the embedding output)."""
    kw = {"first": first, "microbatch_size": microbatch_size, "seq_len": seq_len, "recompute": recompute}
    return [sum(units) for units in layers_unit_bytes(spec, dtype, layers=layers, **kw)]


def layer_unit_bytes(
    spec: ModelSpec,
    dtype: str | Precision,
    *,
    microbatch_size: int,
    seq_len: int,
    count_input: bool = True,
    recompute: str = "none",
) -> tuple[int, ...]:
    """Bytes each offload unit of one decoder layer saves (sub-layer budget offload,
    `pp_offload.order.offload.OffloadPolicy.granularity`), first unit first, summing to
    `layer_activation_bytes`: the attention half (everything saved up to the return of the attention
    module: the input norm, q/k/v, the attention output and its log-sum-exp, GPT-2's residual dropout
    mask), then the rest (the post-attention norm on the residual sum, the MLP). A layer checkpointed as a
    whole (``full``/``selective``: its forward saves through the checkpoint) is one unit; ``mlp``
    recompute only shrinks the second unit. Rotary cos/sin excluded as in `layer_activation_bytes` (the
    store records them with the first unit that saves them)."""
    mode = layer_mode(recompute)
    kw = {"microbatch_size": microbatch_size, "seq_len": seq_len, "count_input": count_input}
    whole = layer_activation_bytes(spec, dtype, recompute=mode, **kw)
    if mode in ("full", "selective"):
        return (whole,)
    n = microbatch_size * seq_len
    lse = _big(microbatch_size * spec.num_heads * seq_len, 4)
    attention = _attention_unit_bytes(spec, precision(dtype), n=n, lse=lse, count_input=count_input)
    return (attention, whole - attention)


def _attention_unit_bytes(spec: ModelSpec, p: Precision, *, n: int, lse: int, count_input: bool) -> int:
    """What a decoder layer without recompute saves up to its attention module's return (the first
    sub-layer unit; `layer_activation_bytes` adds the rest to it), for ``n`` tokens. GPT-2: ln_1's input
    and stats, its output (the QKV projection's input), the fused QKV output (q, k, v are views of it),
    the attention output (c_proj's input is a view) and its log-sum-exp, the residual dropout mask.
    Llama family: the input RMSNorm (its fp32 input, a copy unless the input is fp32; rsqrt; normalised;
    output), Qwen3's per-head q/k RMSNorms before the rotary embedding, rotated q and k, v, the attention
    output and its log-sum-exp."""
    a, h, q, kv = p.act_bytes, spec.hidden_size, spec.q_size, spec.kv_size
    if spec.family == "gpt2":
        total = (a * h * n if count_input else 0) + 2 * _big(n, 4) + a * h * n
        return total + a * (q + 2 * kv) * n + a * q * n + lse + (n * h if spec.resid_dropout > 0 else 0)
    total = (4 * h * n if (count_input or a != 4) else 0) + _big(n, 4) + 2 * a * h * n
    if spec.qk_norm:
        for width, heads in ((q, spec.num_heads), (kv, spec.num_kv_heads)):
            total += 4 * width * n + _big(n * heads, 4) + a * width * n
    return total + a * (2 * q + 2 * kv) * n + lse


def layers_unit_bytes(
    spec: ModelSpec,
    dtype: str | Precision,
    *,
    layers: int,
    first: bool,
    microbatch_size: int,
    seq_len: int,
    recompute: str = "none",
) -> list[tuple[int, ...]]:
    """`layer_unit_bytes` of each of a stage's ``layers`` decoder layers under the recompute plan
    ``recompute``, first layer first (as `layers_activation_bytes`, which each entry sums to)."""
    kw = {"microbatch_size": microbatch_size, "seq_len": seq_len}
    return [
        layer_unit_bytes(spec, dtype, count_input=first or index > 0, recompute=mode, **kw)
        for index, mode in enumerate(parse_recompute(recompute).modes(layers))
    ]


def mlp_recompute_freed(
    spec: ModelSpec, dtype: str | Precision, *, microbatch_size: int, seq_len: int
) -> int:
    """Bytes one layer stops saving under ``"mlp"`` recompute (selective recompute of the MLP block only:
    its matmul outputs kept, its activation function and gated product recomputed): Llama's MLP saves
    gate, the activation's internals, act, up and the product, and keeps gate and up; GPT-2's saves
    c_fc's output, gelu_new's internals and c_proj's input, and keeps c_fc's output. A dropout after the
    MLP's last matmul would make the recomputation re-run it: not modelled (ValueError)."""
    p = precision(dtype)
    n, i = microbatch_size * seq_len, spec.intermediate_size
    saves_input, extra = _ACTIVATIONS.get(spec.hidden_act, (True, 0))
    if spec.family == "gpt2":
        if spec.resid_dropout > 0:
            raise ValueError("'mlp' recompute of a GPT-2 layer with residual dropout is not modelled")
        return p.act_bytes * i * n * ((1 if saves_input else 0) + extra)
    return p.act_bytes * i * n * ((1 if saves_input else 0) + extra + 1)


def layer_recompute_traffic(
    spec: ModelSpec, dtype: str | Precision, *, microbatch_size: int, seq_len: int, mode: str = "selective"
) -> int:
    """HBM bytes read + written by one selective recompute of one decoder layer for one microbatch
    (``mode="mlp"``: of its MLP block only, the activation function and the gated product).

    Why bytes: the recomputed ops are elementwise (norms, rotary, residual sum, activation, gated product),
    memory-bound on a GPU, so their time is traffic over HBM bandwidth, not FLOPs. Counted op by op as
    transformers runs them (unfused), per token with ``a`` bytes per element: an RMSNorm of width ``w``
    reads and writes ``(a + 4)w`` in its cast to fp32 (none in fp32), ``8w`` in ``pow``, reads ``4w`` in
    ``mean``, ``8w`` in the multiply by rsqrt, ``(4 + a)w`` in the cast back (none in fp32) and ``2aw`` in
    the weight multiply; rotary on a width ``w``: two multiplies, a negation of half, a concatenation and
    an add, ``10aw``; the residual sum ``3ah``; silu-like activations ``2ai`` and the gated product ``3ai``.
    GPT-2: two fused LayerNorms ``2ah`` each (plus their fp32 mean/rstd), the residual sum, and gelu_new's
    eight elementwise ops ``16ai``.
    """
    p = precision(dtype)
    a, n = p.act_bytes, microbatch_size * seq_len
    h, i = spec.hidden_size, spec.intermediate_size
    if spec.family == "gpt2":
        act = 16 * a * i if spec.hidden_act == "gelu_new" else 2 * a * i
        return n * (act if mode == "mlp" else 2 * (2 * a * h + 8) + 3 * a * h + act)
    if mode == "mlp":
        return n * 5 * a * i
    casts = 0 if a == 4 else 2 * (a + 4)

    def norm(width: int) -> int:
        return (casts + 8 + 4 + 8 + 2 * a) * width

    per_token = 2 * norm(h) + 10 * a * (spec.q_size + spec.kv_size) + 3 * a * h + 5 * a * i
    if spec.qk_norm:
        per_token += norm(spec.q_size) + norm(spec.kv_size)
    return n * per_token


def queued_bytes(
    spec: ModelSpec,
    dtype: str | Precision,
    *,
    layers: int,
    first: bool,
    last: bool,
    microbatch_size: int,
    seq_len: int,
) -> int:
    """Bytes the deferred-W queue of one stage holds for one microbatch from its I to its W (module doc,
    "Deferred weight gradients"): every trainable linear-like layer's input and output gradient, each
    distinct storage once, the stage output's gradient (torch's receive buffer) left out. The same under
    every recompute plan: a recomputed layer queues tensors of the same sizes."""
    a, n = precision(dtype).act_bytes, microbatch_size * seq_len
    h, i, q, kv, r = spec.hidden_size, spec.intermediate_size, spec.q_size, spec.kv_size, spec.lora_rank
    gpt2 = spec.family == "gpt2"
    inputs = 2 * h + q + i  # what the projections read, shared inputs once
    outputs = (q + 2 * kv) + 2 * h + (i if gpt2 else 2 * i)  # the projections' output widths
    if r:  # adapters only: A reads the base layer's input, B A's output; dY of A is r wide, of B the output
        projections = 4 if gpt2 else 7
        total = a * n * layers * (inputs + outputs + 2 * projections * r)
        if first and layers:
            # the first layer's q/k/v (c_attn) A adapters read the frozen embedding's normed output, which
            # wants no gradient: they compute their weight gradient in I and queue nothing
            total -= a * n * (h + (1 if gpt2 else 3) * r)
        return total
    total = a * n * layers * (inputs + outputs)
    if layers and not last and not (gpt2 and spec.resid_dropout > 0):
        total -= a * n * h  # the last layer's output gradient is the stage's receive buffer
    if last:
        total += a * n * (h + spec.vocab_size)  # LM head: the final norm's output and the logits' gradient
    return total


def chunk_activation(
    spec: ModelSpec,
    dtype: str | Precision,
    *,
    layers: int,
    first: bool,
    last: bool,
    microbatch_size: int,
    seq_len: int,
    recompute: str = "none",
    deferred_w: bool = True,
) -> ChunkActivation:
    """Activation memory of one stage (``layers`` decoder layers, plus the embedding when ``first`` and the
    final norm, LM head and loss when ``last``) for one microbatch. ``recompute``: activation checkpointing
    of the decoder layers, a mode or a plan with a share (module doc). ``deferred_w``: the stage's split
    backward queues its weight gradients' inputs for W (`queued_bytes`, the runtime's default);
    ``False``: torch's retained-graph split (``queued`` None)."""
    p = precision(dtype)
    queued = None
    if deferred_w:
        kw = {"microbatch_size": microbatch_size, "seq_len": seq_len}
        queued = queued_bytes(spec, p, layers=layers, first=first, last=last, **kw)
    a, n, h, v = p.act_bytes, microbatch_size * seq_len, spec.hidden_size, spec.vocab_size
    saved = 0
    if first:
        saved += _big(n, 8)  # token ids, saved by the embedding lookup
        if spec.family == "gpt2":
            saved += _big(seq_len, 8)  # position ids, (1, seq) broadcast over the microbatch
            saved += n * h if spec.embd_dropout > 0 else 0
    held = 0
    if layers:
        kw = {"microbatch_size": microbatch_size, "seq_len": seq_len, "recompute": recompute}
        layer_bytes = sum(layers_activation_bytes(spec, p, layers=layers, first=first, **kw))
        saved += layer_bytes
        if parse_recompute(recompute).once and not first:
            kw["recompute"] = "none"
            held = sum(layers_activation_bytes(spec, p, layers=layers, first=first, **kw)) - layer_bytes
        if spec.family == "llama" and {"none", "mlp"} & set(parse_recompute(recompute).modes(layers)):
            # rotary cos and sin, shared by the stage's layers, saved by a layer whose attention is not
            # checkpointed (a checkpointed layer takes them as inputs, which the activation store does not
            # see)
            saved += 2 * _big(n * spec.head_dim, a)
    if not last:
        return ChunkActivation(saved=saved, output=a * h * n, held_after_input=held, queued=queued)
    own_input = first or layers > 0  # else the final norm's input is the stage's input
    if spec.family == "gpt2":
        saved += (a * h * n if own_input else 0) + 2 * _big(n, 4) + a * h * n  # ln_f input, stats, output
    else:
        saved += (4 * h * n if (own_input or a != 4) else 0) + _big(n, 4) + 2 * a * h * n
    loss = 4 * v * n + _big(n, 8)  # fp32 log-probabilities, target ids
    return ChunkActivation(saved=saved, output=a * v * n, loss=loss, held_after_input=held, queued=queued)


def transient_bytes(
    spec: ModelSpec, dtype: str | Precision, *, layers: int, last: bool, microbatch_size: int, seq_len: int
) -> int:
    """A rough allowance for memory that lives only during one pass: one layer's worth of gradients of its
    saved tensors during backward, and on the last stage the fp32 and model-dtype gradients of the logits."""
    p = precision(dtype)
    n = microbatch_size * seq_len
    out = layer_activation_bytes(spec, p, microbatch_size=microbatch_size, seq_len=seq_len) if layers else 0
    if last:
        out += (4 + p.act_bytes) * spec.vocab_size * n
    return out


def layer_params(spec: ModelSpec) -> int:
    h, i, q, k = spec.hidden_size, spec.intermediate_size, spec.q_size, spec.kv_size
    if spec.family == "gpt2":
        return 2 * h + (h * 3 * h + 3 * h) + (h * h + h) + 2 * h + (h * i + i) + (i * h + h)
    total = h * q + 2 * h * k + q * h + 3 * h * i + 2 * h
    if spec.attention_bias:
        total += q + 2 * k + h
    if spec.mlp_bias:
        total += 2 * i + h
    if spec.qk_norm:
        total += 2 * spec.head_dim
    return total


def lora_layer_params(spec: ModelSpec) -> int:
    """Adapter parameters of one decoder layer with LoRA of rank ``spec.lora_rank`` on every projection:
    r x (in + out) per projection (``lora_A`` is r x in, ``lora_B`` out x r); 0 without LoRA."""
    h, i, q, k = spec.hidden_size, spec.intermediate_size, spec.q_size, spec.kv_size
    if spec.family == "gpt2":  # c_attn (h -> 3h), attn c_proj (h -> h), c_fc (h -> i), mlp c_proj (i -> h)
        widths = (h + 3 * h) + (h + h) + (h + i) + (i + h)
    else:  # q, k, v, o, gate, up, down
        widths = (h + q) + 2 * (h + k) + (q + h) + 2 * (h + i) + (i + h)
    return spec.lora_rank * widths


def embedding_params(spec: ModelSpec) -> int:
    return spec.vocab_size * spec.hidden_size + spec.max_positions * spec.hidden_size


def head_params(spec: ModelSpec) -> int:
    """Final norm and LM head (the head's weight counted even when tied: see `stage_params`)."""
    norm = 2 * spec.hidden_size if spec.family == "gpt2" else spec.hidden_size
    return norm + spec.vocab_size * spec.hidden_size


def stage_params(spec: ModelSpec, *, layers: int, first: bool, last: bool) -> int:
    """Parameters of one stage (LoRA adapters included). A tied LM head on a stage without the embedding
    holds its own copy (its gradient is summed with the embedding's across ranks); on the embedding's
    stage it is shared."""
    total = layers * (layer_params(spec) + lora_layer_params(spec))
    if first:
        total += embedding_params(spec)
    if last:
        total += head_params(spec)
        if first and spec.tie_word_embeddings:
            total -= spec.vocab_size * spec.hidden_size
    return total


@dataclass(frozen=True)
class StateBytes:
    """Per-rank bytes that live through the whole step."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def state_bytes(
    spec: ModelSpec,
    dtype: str | Precision,
    stages: list[tuple[int, bool, bool]],
    *,
    dp: int = 1,
    dp_shard: bool = False,
) -> StateBytes:
    """Parameters, gradients and optimizer state of the ``(layers, first, last)`` stages one rank holds.

    A tied embedding and LM head on the same rank (V placement puts both on rank 0) count once.
    ``dp_shard``: optimizer state and master weights sharded over the ``dp`` replicas (ZeRO-1/2, or FSDP2
    under pipelining with ``reshard_after_forward=False``, where unsharded parameters and gradients
    live through the step anyway). With LoRA (``spec.lora_rank``) only the adapters have gradients and
    optimizer state; the frozen base counts as parameters only.
    """
    p = precision(dtype)
    count = sum(stage_params(spec, layers=n, first=f, last=la) for n, f, la in stages)
    firsts = any(f for _, f, _ in stages)
    lasts = any(la for _, _, la in stages)
    same_stage = any(f and la for _, f, la in stages)
    if spec.tie_word_embeddings and firsts and lasts and not same_stage:
        count -= spec.vocab_size * spec.hidden_size
    shard = dp if dp_shard else 1
    trained = count
    if spec.lora_rank:
        trained = sum(n for n, _, _ in stages) * lora_layer_params(spec)
    return StateBytes(
        params=count * p.param_bytes,
        grads=trained * p.grad_bytes,
        optimizer=-(-trained * p.optimizer_bytes // shard),
    )


def recv_buffer_bytes(
    spec: ModelSpec,
    dtype: str | Precision,
    *,
    first: bool,
    last: bool,
    microbatch_size: int,
    seq_len: int,
    num_microbatches: int,
) -> int:
    """torch's receive buffers of one stage: one per microbatch for its input (all but the first stage) and
    one per microbatch for its output's gradient (all but the last stage), allocated for the whole run."""
    p = precision(dtype)
    one = p.act_bytes * spec.hidden_size * microbatch_size * seq_len
    return num_microbatches * one * ((0 if first else 1) + (0 if last else 1))
