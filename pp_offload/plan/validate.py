"""Measure what Hugging Face stages really save for backward, to check `pp_offload.plan.memory`'s formulas.

Why: the planner's memory predictions are only as good as its bytes-per-chunk estimate, and that estimate
is a formula read off transformers' modules. Here tiny models built from configs run one stage's forward
on CPU under ``torch.autograd.graph.saved_tensors_hooks`` and every saved tensor is counted the way
`pp_offload.runtime.store.ActivationStore` decides what to keep: parameters (and views of them), storages
of at most 1024 elements and the stage's own inputs are left out, and a storage is counted once however
many views of it are saved. ``tests/test_plan.py`` asserts the estimate is within 10% of the measurement;
``bench/bench_plan.py`` prints the table. `measure_queue` does the same for the deferred-W queue
(`pp_offload.plan.memory.queued_bytes`): a real input-gradient pass of the stage through
`pp_offload.runtime.deferred_w`'s layers, the queue's bytes counted after it.

Stages are run the way a pipeline stage of these models runs (and the way the planner assumes): no
attention mask (causal sdpa), rotary embeddings computed on the stage, the loss computed after the stage's
forward (measured separately).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

from pp_offload.plan.memory import (
    SMALL_NUMEL,
    chunk_activation,
    layer_activation_bytes,
    precision,
    queued_bytes,
)
from pp_offload.plan.model import model_spec

__all__ = [
    "Measurement",
    "TINY_CONFIGS",
    "measure_layer",
    "measure_queue",
    "measure_stage",
    "saved_bytes",
    "validation_rows",
]


def saved_bytes(fn: Callable[[], Any], *, keep: Iterable[Any] = ()) -> tuple[int, Any]:
    """Run ``fn()`` and return (bytes of the distinct storages autograd saved, ``fn``'s result), counting as
    the activation store does (see the module doc)."""
    import torch
    from torch import nn

    keep_ptrs = {t.untyped_storage().data_ptr() for t in keep if isinstance(t, torch.Tensor)}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
            return t
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in keep_ptrs or storage.nbytes() <= SMALL_NUMEL * t.element_size() or t.numel() == 0:
            return t
        storages[ptr] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    return sum(storages.values()), result


@dataclass(frozen=True)
class Measurement:
    """One stage (or one layer) of one tiny model: measured and estimated bytes."""

    model: str
    dtype: str
    what: str  # "layer", "first stage", "middle stage", "last stage", "loss"
    layers: int
    microbatch_size: int
    seq_len: int
    measured: int
    estimated: int

    @property
    def error(self) -> float:
        return self.estimated / self.measured - 1.0 if self.measured else float("inf")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "error": self.error}


TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama-h64-mha": {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 176,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "num_hidden_layers": 3,
        "vocab_size": 300,
    },
    "llama-h128-gqa": {
        "model_type": "llama",
        "hidden_size": 128,
        "intermediate_size": 352,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "num_hidden_layers": 3,
        "vocab_size": 500,
    },
    "llama-h256-gqa-hd64": {
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "num_hidden_layers": 3,
        "vocab_size": 1000,
    },
    "gpt2-h64": {
        "model_type": "gpt2",
        "n_embd": 64,
        "n_head": 4,
        "n_layer": 3,
        "vocab_size": 300,
        "n_positions": 1024,
    },
    "gpt2-h256": {
        "model_type": "gpt2",
        "n_embd": 256,
        "n_head": 8,
        "n_layer": 3,
        "vocab_size": 1000,
        "n_positions": 1024,
    },
}
"""Tiny configs for the check: hidden 64..256, MHA and GQA, both layouts (dropout is set to 0)."""


def _build(config: dict[str, Any], dtype: str):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(config)
    model_type = cfg.pop("model_type")
    if model_type == "gpt2":
        cfg.update(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    else:
        cfg.update(attention_dropout=0.0)
    hf_config = AutoConfig.for_model(model_type, **cfg)
    hf_config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa")
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[
        precision(dtype).name
    ]
    return hf_config, model.to(torch_dtype).train()


def _parts(model):
    """(embed, layers, final norm, head, rotary or None) of a Llama-layout or GPT-2 causal LM."""
    if hasattr(model, "transformer"):  # GPT-2
        t = model.transformer
        return (t.wte, t.wpe), list(t.h), t.ln_f, model.lm_head, None
    m = model.model
    return m.embed_tokens, list(m.layers), m.norm, model.lm_head, m.rotary_emb


def _stage_fn(model, *, layers: int, first: bool, last: bool, ids, hidden):
    import torch

    embed, blocks, norm, head, rotary = _parts(model)
    b, s = ids.shape
    positions = torch.arange(s).unsqueeze(0).expand(b, s)

    def run():
        if first:
            if rotary is None:
                x = embed[0](ids) + embed[1](positions)
            else:
                x = embed(ids)
        else:
            x = hidden
        kwargs: dict[str, Any] = {"attention_mask": None}
        if rotary is not None:
            kwargs["position_embeddings"] = rotary(x, positions)
            kwargs["position_ids"] = positions
        for block in blocks[:layers]:
            out = block(x, **kwargs)
            x = out[0] if isinstance(out, tuple) else out
        if last:
            x = head(norm(x))
        return x

    return run


def _stage_inputs(model, spec: Any, microbatch_size: int, seq_len: int):
    """A stage's inputs: token ids (a first stage's) and a hidden state that wants a gradient (the others',
    in the model's activation dtype: its first floating-point parameter's)."""
    import torch

    ids = torch.randint(0, spec.vocab_size, (microbatch_size, seq_len))
    act_dtype = next(p for p in model.parameters() if p.is_floating_point()).dtype
    hidden = torch.randn(microbatch_size, seq_len, spec.hidden_size, dtype=act_dtype, requires_grad=True)
    return ids, hidden


def _stage_name(first: bool, last: bool) -> str:
    if first and last:
        return "whole model"
    return "first stage" if first else ("last stage" if last else "middle stage")


def measure_stage(
    name: str,
    config: dict[str, Any],
    *,
    layers: int,
    first: bool,
    last: bool,
    microbatch_size: int,
    seq_len: int,
    dtype: str = "fp32",
) -> list[Measurement]:
    """Measure one stage's saved bytes (and the loss's, for a last stage) against the estimate."""
    import torch

    hf_config, model = _build(config, dtype)
    spec = model_spec(hf_config)
    vocab = spec.vocab_size
    ids, hidden = _stage_inputs(model, spec, microbatch_size, seq_len)
    fn = _stage_fn(model, layers=layers, first=first, last=last, ids=ids, hidden=hidden)
    measured, output = saved_bytes(fn, keep=() if first else (hidden,))
    estimate = chunk_activation(
        spec, dtype, layers=layers, first=first, last=last, microbatch_size=microbatch_size, seq_len=seq_len
    )
    rows = [
        Measurement(
            name, dtype, _stage_name(first, last), layers, microbatch_size, seq_len, measured, estimate.saved
        )
    ]
    if last:
        labels = torch.randint(0, vocab, (microbatch_size, seq_len))
        loss_bytes, _ = saved_bytes(lambda: model.loss_function(output, labels, vocab_size=vocab))
        rows.append(Measurement(name, dtype, "loss", 0, microbatch_size, seq_len, loss_bytes, estimate.loss))
    return rows


def measure_queue(
    name: str,
    config: dict[str, Any],
    *,
    layers: int,
    first: bool,
    last: bool,
    microbatch_size: int,
    seq_len: int,
    dtype: str = "fp32",
    lora_rank: int = 0,
) -> Measurement:
    """One stage's deferred-W queue after its input-gradient pass (``what`` names the stage, ``measured``
    the queue's distinct storages but the stage output's gradient, torch's receive buffer), against
    `pp_offload.plan.memory.queued_bytes`. The stage's trainable linear-like layers defer their weight
    gradients (`pp_offload.runtime.deferred_w.defer_weight_grads`), so the backward is the one I runs;
    ``lora_rank``: peft adapters of that rank on every projection (`pp_offload.models.lora.apply_lora`),
    the base frozen."""
    import dataclasses
    import types

    import torch

    from pp_offload.runtime import deferred_w

    hf_config, model = _build(config, dtype)
    spec = dataclasses.replace(model_spec(hf_config), lora_rank=lora_rank)
    if lora_rank:
        from pp_offload.models.lora import apply_lora, unwrap_peft

        model = unwrap_peft(apply_lora(model, r=lora_rank))
    stage = types.SimpleNamespace(submod=model, backward_maybe_with_nosync=lambda *a, **k: None)
    deferred_w.defer_weight_grads([stage])
    ids, hidden = _stage_inputs(model, spec, microbatch_size, seq_len)
    output = _stage_fn(model, layers=layers, first=first, last=last, ids=ids, hidden=hidden)()
    receive = set()
    with deferred_w.collecting():
        if last:
            labels = torch.randint(0, spec.vocab_size, (microbatch_size, seq_len))
            model.loss_function(output, labels, vocab_size=spec.vocab_size).backward()
        else:
            grad = torch.randn_like(output)
            receive.add((grad.device, grad.untyped_storage().data_ptr()))
            output.backward(grad)
    try:
        measured = deferred_w.queued_bytes(leave_out=receive)
    finally:
        deferred_w.apply_queued_weight_grads(model.parameters())
    estimate = queued_bytes(
        spec, dtype, layers=layers, first=first, last=last, microbatch_size=microbatch_size, seq_len=seq_len
    )
    return Measurement(
        name, dtype, f"{_stage_name(first, last)} queue", layers, microbatch_size, seq_len, measured, estimate
    )


def measure_layer(
    name: str, config: dict[str, Any], *, microbatch_size: int, seq_len: int, dtype: str = "fp32"
) -> Measurement:
    """One decoder layer whose input is kept (as a stage's first layer), rotary cos/sin counted."""
    row = measure_stage(
        name,
        config,
        layers=1,
        first=False,
        last=False,
        microbatch_size=microbatch_size,
        seq_len=seq_len,
        dtype=dtype,
    )[0]
    spec = model_spec(dict(config))
    est = layer_activation_bytes(
        spec, dtype, microbatch_size=microbatch_size, seq_len=seq_len, count_input=False
    )
    if spec.family == "llama":
        a = precision(dtype).act_bytes
        n = microbatch_size * seq_len * spec.head_dim
        est += 2 * (n * a if n > SMALL_NUMEL else 0)
    return Measurement(name, dtype, "layer", 1, microbatch_size, seq_len, row.measured, est)


def validation_rows(
    configs: dict[str, dict[str, Any]] | None = None,
    *,
    shapes: Iterable[tuple[int, int]] = ((1, 64), (2, 256)),
    dtypes: Iterable[str] = ("fp32", "bf16"),
) -> list[Measurement]:
    """Every tiny config x (microbatch size, seq len) x dtype: one layer, a first, a middle and a last stage
    of 2 layers each, and the loss."""
    rows: list[Measurement] = []
    for name, config in (configs or TINY_CONFIGS).items():
        for dtype in dtypes:
            for mb, seq in shapes:
                rows.append(measure_layer(name, config, microbatch_size=mb, seq_len=seq, dtype=dtype))
                for first, last in ((True, False), (False, False), (False, True)):
                    rows += measure_stage(
                        name,
                        config,
                        layers=2,
                        first=first,
                        last=last,
                        microbatch_size=mb,
                        seq_len=seq,
                        dtype=dtype,
                    )
    return rows
