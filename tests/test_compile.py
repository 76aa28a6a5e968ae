"""Compiled decoder layers in one process: the recipe's options and selective recompute under compile
(torch's selective-checkpoint policy) against the eager dispatch modes. The pipelines on 2 ranks:
tests/test_compile_gloo.py; inductor (whose kernels reuse a backward's donated buffers) over the whole
gradient matrix: bench/bench_compile_grads.py.

Backend ``aot_eager``: what is saved and recomputed is AOT autograd's partition, which ``aot_eager``
executes op by op, so a dispatch mode can count the recomputed ops.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Any

import pytest
import torch
from _tiny_hf import tiny_hf
from torch import nn

from pp_offload.parallel import activation_checkpointing
from pp_offload.runtime import compat
from pp_offload.runtime.compile import CompileOptions, CompileWatch, check_recompute_compiles, compile_layers
from pp_offload.runtime.deferred_w import compiled_modules
from pp_offload.runtime.store import ActivationStore

pytestmark = pytest.mark.usefixtures("one_thread")


class _Block(nn.Module):
    """A small residual MLP block (a class of this file: dynamo does not trace torch.nn's containers)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down, self.norm = nn.Linear(16, 32), nn.Linear(32, 16), nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.down(nn.functional.gelu(self.up(x))))


def test_compile_options_and_regional_compile() -> None:
    assert CompileOptions.coerce(False) is None and CompileOptions.coerce(None) is None
    assert CompileOptions.coerce(True) == CompileOptions()
    assert CompileOptions.coerce({"mode": "max-autotune", "fullgraph": True}) == CompileOptions(
        mode="max-autotune", fullgraph=True
    )
    with pytest.raises(ValueError, match=r"unknown keys \['backnd'\]; known: mode, backend, fullgraph"):
        CompileOptions.coerce({"backnd": "eager"})
    with pytest.raises(ValueError, match="must be true, false or a mapping"):
        CompileOptions.coerce("yes")
    with pytest.raises(ValueError, match="fullgraph true/false"):
        CompileOptions.coerce({"fullgraph": "no"})
    for plan in (None, "full", "selective", "selective:0.5,mlp"):
        check_recompute_compiles(plan)  # every recompute plan compiles
    with pytest.raises(ValueError, match=r"'\+once' does not compile and is no longer needed.* use 'mlp'"):
        check_recompute_compiles("mlp+once")
    stage = nn.Module()
    stage.embed, stage.layers = nn.Embedding(4, 4), nn.ModuleList([_Block(), _Block()])
    assert compile_layers([stage], CompileOptions(backend="eager")) == 2  # lazy: compiles at the first call
    assert compiled_modules(stage) == ["layers.0", "layers.1"]
    once = nn.Module()
    once.layers = nn.ModuleList([_Block()])
    activation_checkpointing({0: once}, layers=lambda s: s.layers, mode="full+once")
    with pytest.raises(ValueError, match=r"'full\+once': '\+once' does not compile"):
        compile_layers([once])
    lines: list[str] = []
    watch = CompileWatch(2)
    watch.after_step(lines.append)
    assert lines == []
    watch.after_step(lines.append)
    assert (
        len(lines) == 1
        and lines[0].startswith("compile: 2 layers,")
        and "0 graphs compiled after it" in lines[0]
    )


class _CountOps(compat.TorchDispatchMode):
    """Counts the aten ops that run (a cached output handed back by selective recompute does not run)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _saved_bytes_and_backward_ops(model: nn.Module, layers: list[nn.Module], batch: dict) -> tuple:
    """Bytes each layer's capture holds (what an offload would move: the activation store's accounting),
    the matmul and attention ops the backward runs (recomputed ones included), and the gradients."""
    store = ActivationStore("cpu")
    model.zero_grad(set_to_none=True)
    with contextlib.ExitStack() as captures:
        hooks = [
            layer.register_forward_pre_hook(lambda m, a, i=i: captures.enter_context(store.capture(i)))
            for i, layer in enumerate(layers)
        ]
        loss = model(**batch, use_cache=False).last_hidden_state.square().mean()
    for hook in hooks:
        hook.remove()
    held = {key: chunk.captured_bytes for key, chunk in store.stats().chunks.items()}
    with _CountOps() as counted:
        loss.backward()
    heavy = {op: n for op, n in counted.ops.items() if "mm" in op or "attention" in op}
    return held, heavy, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize(("family", "mode"), [("llama", "selective"), ("gpt2", "mlp")])
def test_compiled_selective_recompute_saves_and_recomputes_what_eager_does(family: str, mode: str) -> None:
    """The selective-checkpoint policy under compile keeps the same bytes per layer as the eager dispatch
    modes (trailing matmuls included: the partitioner saves no output the backward does not read) and
    the backward runs the same matmuls and attention kernels: none recomputed."""
    model, layers, batch = tiny_hf(family)
    activation_checkpointing({0: model}, layers=lambda _: layers, mode=mode)
    eager = _saved_bytes_and_backward_ops(model, layers, batch)
    graphs = compat.compile_counters()[1]
    compile_layers([model], CompileOptions(backend="aot_eager"))
    _saved_bytes_and_backward_ops(model, layers, batch)  # compiles
    assert compat.compile_counters()[1] == graphs + 1  # one graph for both layers
    compiled = _saved_bytes_and_backward_ops(model, layers, batch)
    assert compiled[0] == eager[0] and all(n > 0 for n in eager[0].values()), (compiled[0], eager[0])
    assert compiled[1] == eager[1], (compiled[1], eager[1])
    for got, want in zip(compiled[2], eager[2], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_uniform_masks_are_contiguous_tensors_for_packed_and_unpacked_rows() -> None:
    """Compiled stages get a mask tensor of one layout whatever the rows pack (one graph for both): an
    unpacked row's causal mask is a tensor (None by default) with its own batch rows (transformers
    expands it with stride 0), equal to the packed path's mask for one document a row."""
    from transformers import LlamaConfig
    from transformers.masking_utils import create_causal_mask

    from pp_offload.models.masks import build_mask, packed_rows

    config = LlamaConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=1, vocab_size=16)
    config._attn_implementation = "sdpa"
    hidden = torch.zeros(2, 8, 32)
    single = torch.arange(8).repeat(2, 1)
    packed = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]] * 2)

    def mask(positions: torch.Tensor, uniform: bool) -> Any:
        return build_mask(
            create_causal_mask,
            config=config,
            hidden=hidden,
            attention_mask=None,
            position_ids=positions,
            packed=packed_rows(positions),
            uniform=uniform,
        )

    assert mask(single, uniform=False) is None
    plain, documents = mask(single, uniform=True), mask(packed, uniform=True)
    assert isinstance(plain, torch.Tensor) and isinstance(documents, torch.Tensor)
    assert plain.stride() == documents.stride() and plain.dtype == documents.dtype
    assert torch.equal(plain[0, 0], torch.ones(8, 8, dtype=torch.bool).tril())
    assert not torch.equal(plain, documents)


@pytest.mark.parametrize("recompute", ["none", "full", "selective"])
def test_keyed_dropout_under_compile_is_the_unsplit_compiled_models(recompute: str) -> None:
    """GPT-2 with its default dropout 0.1, keyed (`pp_offload.runtime.dropout_keys`), decoder layers compiled
    (``aot_eager``): the keying hooks stay eager, outside the compiled forward, so compiled layers draw their
    masks from the keyed generator state and a split run in any order, recomputing or not, gives the unsplit
    compiled model's losses and gradients. Inductor, measured the same way: worst rel 6.4e-8 under none,
    full and selective (its masks differ from eager's, as its random kernels are its own)."""
    from test_dropout_keys import split_run, unsplit_run

    def compiled(modules: Any) -> None:
        compile_layers(modules, CompileOptions(backend="aot_eager"))

    ref_losses, reference = unsplit_run(compiled)
    losses, model = split_run(recompute, compiled)
    assert losses == ref_losses
    ref_grads = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, ref_grads[name].grad, rtol=1e-5, atol=1e-7, msg=name)
