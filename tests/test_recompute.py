"""Selective recompute (one process, CPU): the same gradients as no checkpointing, with full and split
(I then W) backward; the kept matmul/attention outputs go through the activation store when a capture runs
(exact bytes, offload/reload, errors); in-place changes are refused; the recipe knob."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from _tiny_hf import tiny_hf
from torch import nn

from pp_offload.parallel import CHECKPOINTING_MODES, activation_checkpointing, checkpointing_mode
from pp_offload.runtime import compat
from pp_offload.runtime.recompute import SAVED_OPS, saved_op_packets, selective_checkpoint_context
from pp_offload.runtime.store import ActivationStore

ROWS, HIDDEN, LAYERS = 48, 32, 3
BLOCK_BYTES = ROWS * HIDDEN * 4  # one fp32 activation of a block


pytestmark = pytest.mark.usefixtures("one_thread")


def _blocks() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[
            nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, HIDDEN))
            for _ in range(LAYERS)
        ]
    )


def _grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    model(x).square().mean().backward()
    return [p.grad.clone() for p in model.parameters()] + [x.grad]


def _split_grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """Zero-bubble style: input gradients (I) and weight gradients (W) as two autograd calls."""
    x = x.detach().requires_grad_(True)
    loss = model(x).square().mean()
    params = list(model.parameters())
    (dx,) = torch.autograd.grad(loss, [x], retain_graph=True)
    return [*torch.autograd.grad(loss, params), dx]


def _hf_grads(model: nn.Module, batch: dict, split: bool = False) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss = model(**batch).last_hidden_state.square().mean()
    params = [p for p in model.parameters() if p.requires_grad]
    if split:
        emb = [p for n, p in model.named_parameters() if "embed_tokens" in n or n.startswith("wte")]
        rest = [p for p in params if all(p is not e for e in emb)]
        torch.autograd.grad(loss, emb, retain_graph=True)  # an I-like first pass
        return list(torch.autograd.grad(loss, rest))
    loss.backward()
    return [p.grad.clone() for p in params]


@pytest.mark.parametrize("mode", ["selective", "mlp", "mlp:0.5"])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_selective_recompute_keeps_hf_gradients_with_full_and_split_backward(family: str, mode: str) -> None:
    model, layers, batch = tiny_hf(family)
    plain = _hf_grads(model, batch)
    plain_split = _hf_grads(model, batch, split=True)
    count = len(layers) if mode != "mlp:0.5" else len(layers) // 2
    assert activation_checkpointing({0: model}, layers=lambda _: layers, mode=mode) == count
    if mode.startswith("mlp"):  # the MLP submodule is wrapped, the layer itself is not
        assert all("forward" not in vars(layer) for layer in layers)
        assert ["forward" in vars(layer.mlp) for layer in layers] == [i < count for i in range(len(layers))]
    for got, want, what in (
        (_hf_grads(model, batch), plain, "full backward"),
        # the second autograd call recomputes every layer again from the same cache (torch's own selective
        # checkpointing refuses that: "Trying to backward an extra time")
        (_hf_grads(model, batch, split=True), plain_split, "split backward"),
    ):
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7, msg=lambda m, what=what: f"{what}: {m}")


def test_cached_outputs_join_the_captured_chunk_and_move_with_it() -> None:
    x = torch.randn(ROWS, HIDDEN, generator=torch.Generator().manual_seed(2))
    model = _blocks()
    want, want_split = _grads(model, x), _split_grads(model, x)
    store = ActivationStore("cpu")

    def capture(key: str) -> tuple[torch.Tensor, torch.Tensor]:
        xin = x.detach().requires_grad_(True)
        with store.capture(key, keep=[xin]):
            loss = model(xin).square().mean()
        return xin, loss

    plain = capture("plain")[1]
    plain_bytes = store.stats().chunks["plain"].captured_bytes
    del plain
    store.release("plain")
    assert activation_checkpointing({0: model}, layers=list, mode="selective") == LAYERS
    model.zero_grad(set_to_none=True)
    xin, loss = capture("selective")
    stats = store.stats().chunks["selective"]
    # each block keeps its first Linear's output (GELU's input); its second Linear is the block's last op
    # (nothing after it saves a tensor): the recomputation never reaches it, so its output is not kept.
    # Also moved: the block inputs (the previous block's output; the first block's is the stage input
    # the pipeline holds) and the last output (square's input)
    assert stats.cached == LAYERS
    assert stats.captured_bytes == 2 * LAYERS * BLOCK_BYTES
    # without recompute: per block the inputs of Linear, GELU and Linear (the stage input excepted), and
    # the output (square's input; with recompute it is the last cached output, one storage)
    assert plain_bytes == 3 * LAYERS * BLOCK_BYTES
    store.offload("selective")
    assert store.resident_bytes() == 0  # nothing of the chunk left on the "device"
    with pytest.raises(RuntimeError, match=r"'selective'.*not reloaded"):
        torch.autograd.grad(loss, [xin], retain_graph=True)
    store.reload("selective")
    loss.backward()
    got = [p.grad.clone() for p in model.parameters()] + [xin.grad]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)
    store.release("selective")

    # split backward under the store: I, the chunk dropped (offloaded again without a copy), reloaded, W
    xin, loss = capture("split")
    store.offload("split")
    store.reload("split")
    (dx,) = torch.autograd.grad(loss, [xin], retain_graph=True)
    store.offload("split")
    store.reload("split")
    got = [*torch.autograd.grad(loss, list(model.parameters())), dx]
    for g, w in zip(got, want_split, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)
    store.release("split")


def test_full_checkpointing_keeps_only_layer_inputs_in_the_store() -> None:
    model = _blocks()
    activation_checkpointing({0: model}, layers=list, mode="full")
    store = ActivationStore("cpu")
    xin = torch.randn(ROWS, HIDDEN).requires_grad_(True)
    with store.capture("c", keep=[xin]):
        model(xin)
    stats = store.stats().chunks["c"]
    assert stats.cached == 0 and stats.captured_bytes == (LAYERS - 1) * BLOCK_BYTES


class _LinearGelu(nn.Module):
    """Returns its Linear's output too: the cached addmm output is a tensor the caller holds."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.fc(x)
        return y, F.gelu(y)


def test_cached_output_changed_in_place_is_refused() -> None:
    layer = _LinearGelu()
    activation_checkpointing({0: layer}, layers=lambda m: [m], mode="selective")
    store = ActivationStore("cpu")
    for where in ("no store", "captured", "offloaded"):
        x = torch.randn(ROWS, HIDDEN, requires_grad=True)
        with store.capture(where) if where != "no store" else contextlib.nullcontext():
            y, z = layer(x)
        y.add_(1.0)  # GELU's backward needs y: its recomputation replays the cached (now changed) y
        with pytest.raises(RuntimeError, match="modified by an in-place|modified in place"):
            if where == "offloaded":
                store.offload(where)
            z.sum().backward()
        if where != "no store":
            store.release(where)


def test_reloaded_chunk_changed_in_place_by_a_backward_is_refused() -> None:
    class ScalesItsSavedTensor(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            y = x * 2
            ctx.save_for_backward(y)
            return y.sin()

        @staticmethod
        def backward(ctx, grad):
            (y,) = ctx.saved_tensors
            y.mul_(1.0)  # an in-place change of an unpacked saved tensor
            return grad * y.cos() * 2

    store = ActivationStore("cpu")
    x = torch.randn(ROWS, HIDDEN, requires_grad=True)
    with store.capture("c"):
        out = ScalesItsSavedTensor.apply(x).sum()
    store.offload("c")
    store.reload("c")
    torch.autograd.grad(out, [x], retain_graph=True)
    with pytest.raises(RuntimeError, match=r"chunk 'c' was modified in place after its reload"):
        torch.autograd.grad(out, [x])


def test_saved_ops_that_save_nothing_are_refused() -> None:
    """An op in NON_SAVING_OPS is never kept (the forward skips it), so naming it in saved_ops would only fail
    later, in the recomputation: refused when the context is made."""
    with pytest.raises(ValueError, match=r"\['add'\].*leave them out"):
        selective_checkpoint_context(["mm", "add"])


def test_saved_op_list_and_modes() -> None:
    aten = torch.ops.aten
    packets = saved_op_packets()
    assert {aten.mm, aten.addmm, aten.bmm, aten.baddbmm} <= packets
    assert aten.gelu not in packets and aten.mul not in packets and aten.native_layer_norm not in packets
    assert len(packets) <= len(SAVED_OPS)
    with pytest.raises(ValueError, match="none of saved_ops"):
        selective_checkpoint_context(["no_such_op"])
    with pytest.raises(ValueError, match="non-empty list of aten op names"):
        selective_checkpoint_context([])
    assert CHECKPOINTING_MODES == ("full", "selective", "mlp")
    assert [checkpointing_mode(v) for v in (False, None, "none", True, "full", "selective")] == [
        None,
        None,
        None,
        "full",
        "full",
        "selective",
    ]
    with pytest.raises(ValueError, match="got 'partial'.*'selective'"):
        checkpointing_mode("partial")
    model = _blocks()
    with pytest.raises(ValueError, match="mode must be one of"):
        activation_checkpointing({0: model}, layers=list, mode="some")
    assert activation_checkpointing({0: model}, layers=list) == LAYERS
    assert activation_checkpointing({0: model}, layers=list) == 0  # idempotent
    assert activation_checkpointing({0: model}, layers=list, mode="selective") == LAYERS  # switched
    x = torch.randn(ROWS, HIDDEN)
    assert torch.equal(model(x), _blocks()(x))  # same forward, same weights


def test_a_share_of_the_layers_wraps_the_earliest_and_unwraps_the_rest() -> None:
    """``selective:0.5`` of 3 layers: the first ceil(1.5) = 2 checkpointed, the third its own forward
    again; ``none`` undoes everything; the recipe knob takes the plan string."""

    def wrapped(model: nn.Module) -> list[str | None]:
        return [
            getattr(vars(b).get("forward"), "func", None) and vars(b)["forward"].func.__name__ for b in model
        ]

    assert checkpointing_mode("Selective:0.50") == "selective:0.5"
    assert checkpointing_mode("full:1") == "full"
    with pytest.raises(ValueError, match="share S in"):
        checkpointing_mode("selective:0")
    model = _blocks()
    assert activation_checkpointing({0: model}, layers=list) == LAYERS  # full, every layer
    assert activation_checkpointing({0: model}, layers=list, mode="selective:0.5") == 2
    assert wrapped(model) == ["_selective", "_selective", None]
    assert activation_checkpointing({0: model}, layers=list, mode="full:0.34") == 2  # ceil(1.02)
    assert wrapped(model) == ["_checkpointed", "_checkpointed", None]
    with pytest.raises(ValueError, match="has none"):  # Linear+GELU blocks have no mlp submodule
        activation_checkpointing({0: model}, layers=list, mode="selective:0.5,mlp")
    assert activation_checkpointing({0: model}, layers=list, mode="none") == 0
    assert wrapped(model) == [None, None, None] and all("forward" not in vars(b) for b in model)
    x = torch.randn(ROWS, HIDDEN)
    assert torch.equal(model(x), _blocks()(x))
    assert activation_checkpointing({0: model}, layers=list, mode="selective:0.5") == 2
    assert [g.shape for g in _grads(model, x)] == [g.shape for g in _grads(_blocks(), x)]
    for got, want in zip(_grads(model, x), _grads(_blocks(), x), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_recipe_refuses_an_unknown_checkpointing_mode() -> None:
    from pp_offload.recipe.config import ConfigError, RecipeConfig

    model = {"config": {"model_type": "llama"}}
    RecipeConfig.from_dict({"model": model, "train": {"activation_checkpointing": "selective"}}).validated()
    config = RecipeConfig.from_dict({"model": model, "train": {"activation_checkpointing": "sometimes"}})
    with pytest.raises(ConfigError, match="train.activation_checkpointing: .*got 'sometimes'"):
        config.validated()


def test_selective_under_fsdp_style_split_input_and_weight_functions() -> None:
    """torch's pipelining split backward helpers (what the runtime calls for I and W) on a selective
    stage: the W pass recomputes from the same cache and gives the plain gradients."""
    from pp_offload.runtime.compat import stage_backward_input, stage_backward_weight

    x = torch.randn(ROWS, HIDDEN, generator=torch.Generator().manual_seed(3))
    model = _blocks()
    want = _split_grads(model, x)
    activation_checkpointing({0: model}, layers=list, mode="selective")
    model.zero_grad(set_to_none=True)
    xin = x.detach().requires_grad_(True)
    out = model(xin).square().mean()
    grads, param_groups = stage_backward_input([out], None, [xin], model.parameters())
    stage_backward_weight(model.parameters(), param_groups)
    for g, w in zip([p.grad for p in model.parameters()] + [grads[0]], want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)


def test_cache_is_freed_with_the_graph_after_full_and_split_backward(monkeypatch) -> None:
    import gc

    from torch.multiprocessing.reductions import StorageWeakRef

    from pp_offload.runtime import recompute

    cached: list[StorageWeakRef] = []
    record = recompute._Cache.record

    def recording(self, func, out):
        if func.overloadpacket in self.saved:
            cached.append(StorageWeakRef(out.untyped_storage()))
        record(self, func, out)

    monkeypatch.setattr(recompute._Cache, "record", recording)
    model = _blocks()
    activation_checkpointing({0: model}, layers=list, mode="selective")
    x = torch.randn(ROWS, HIDDEN)
    _grads(model, x)
    _split_grads(model, x)
    gc.collect()
    assert len(cached) == 2 * 2 * LAYERS
    assert all(ref.expired() for ref in cached), "selective recompute's cache outlived the graph"


def test_trailing_matmul_is_not_kept_and_is_rerun_if_a_recomputation_reaches_it() -> None:
    """A block's last Linear (only non-saving ops after it) is not kept: a recomputation stops before it.
    With early stop off, the recomputation reaches it and gets zeros in its place: the same gradients."""
    from torch.utils.checkpoint import set_checkpoint_early_stop

    from pp_offload.runtime.recompute import NON_SAVING_OPS

    assert {"add", "view", "_to_copy", "detach"} <= set(NON_SAVING_OPS) and "mul" not in NON_SAVING_OPS
    x = torch.randn(ROWS, HIDDEN, generator=torch.Generator().manual_seed(4))
    model = _blocks()
    want, want_split = _grads(model, x), _split_grads(model, x)
    activation_checkpointing({0: model}, layers=list, mode="selective")
    store = ActivationStore("cpu")
    xin = x.detach().requires_grad_(True)
    with store.capture("c", keep=[xin]):
        out = model(xin)
    # kept: each block's first Linear output; moved too: the inputs of blocks 2 and 3
    assert store.stats().chunks["c"].cached == LAYERS
    assert store.stats().chunks["c"].captured_bytes == (2 * LAYERS - 1) * BLOCK_BYTES
    store.release("c")
    del out
    for early_stop in (True, False):
        with set_checkpoint_early_stop(early_stop):
            for got, w in ((_grads(model, x), want), (_split_grads(model, x), want_split)):
                for g, ref in zip(got, w, strict=True):
                    torch.testing.assert_close(g, ref, rtol=1e-6, atol=1e-7)


def test_a_kept_output_changed_later_in_its_own_layer_is_refused() -> None:
    class ScalesItsProjection(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(HIDDEN, HIDDEN)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.fc(x)
            z = F.gelu(y)  # GELU saves y: the recomputation reads the kept y
            y.mul_(2.0)  # ... which this changes after the fact
            return z + y

    layer = ScalesItsProjection()
    activation_checkpointing({0: layer}, layers=lambda m: [m], mode="selective")
    with pytest.raises(RuntimeError, match=r"output of aten.addmm.default was modified in place later"):
        layer(torch.randn(ROWS, HIDDEN, requires_grad=True))


class _Tap(nn.Module):
    """Returns its Linear's output (kept: GELU reads it) as the next layer's input, and a side loss."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.fc(x)
        return y, F.gelu(y).mean()


def test_kept_output_that_is_also_the_next_layers_input_is_one_copy() -> None:
    torch.manual_seed(0)
    layers = [_Tap(), _Tap()]
    x = torch.randn(ROWS, HIDDEN, generator=torch.Generator().manual_seed(5))

    def loss_of(xin: torch.Tensor) -> torch.Tensor:
        h, extra = xin, []
        for layer in layers:
            h, side = layer(h)
            extra.append(side)
        return h.square().mean() + sum(extra)

    xin = x.clone().requires_grad_(True)
    loss_of(xin).backward()
    want = [p.grad.clone() for layer in layers for p in layer.parameters()] + [xin.grad]
    for layer in layers:
        layer.zero_grad(set_to_none=True)
    activation_checkpointing({0: nn.ModuleList(layers)}, layers=list, mode="selective")
    store = ActivationStore("cpu")
    xin = x.clone().requires_grad_(True)
    with store.capture("c", keep=[xin]):
        loss = loss_of(xin)
    stats = store.stats().chunks["c"]
    # y1: kept by layer 1 and saved as layer 2's input; y2: kept by layer 2 and saved by square
    assert stats.cached == 2 and stats.captured_bytes == 2 * BLOCK_BYTES and stats.copies == 2
    assert stats.views == 2  # each storage recorded twice, copied once
    store.offload("c")
    store.reload("c")
    loss.backward()
    got = [p.grad for layer in layers for p in layer.parameters()] + [xin.grad]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)


class _CountOps(compat.TorchDispatchMode):
    """Counts the aten ops dispatched inside it, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _split_backward_counts(model: nn.Module, batch: dict) -> tuple[dict[str, int], dict[str, int]]:
    """The ops of an input-gradient pass (w.r.t. the embedding) and of the weight-gradient pass after it."""
    model.zero_grad(set_to_none=True)
    loss = model(**batch).last_hidden_state.square().mean()
    emb = [p for n, p in model.named_parameters() if "embed_tokens" in n or n.startswith("wte")]
    rest = [p for p in model.parameters() if p.requires_grad and all(p is not e for e in emb)]
    with _CountOps() as first:
        torch.autograd.grad(loss, emb, retain_graph=True)
    with _CountOps() as second:
        torch.autograd.grad(loss, rest)
    return first.counts, second.counts


MATMUL_AND_ATTENTION = ("mm", "addmm", "bmm", "_scaled_dot_product_flash_attention_for_cpu")


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_selective_recompute_reruns_no_matmul_or_attention_in_either_backward_pass(family: str) -> None:
    """Selective recompute's cost is the elementwise ops it re-runs: in both passes of a split backward the
    matmuls and attention kernels run exactly as often as without recompute (full recompute re-runs them,
    so the count can tell). On an H100 its W pass measured 2.5x the plain one: this pins down that the cache
    serves the matmuls on CPU (bench/results/gpu/README.md)."""

    def heavy(counts: dict[str, int]) -> dict[str, int]:
        return {op: counts.get(op, 0) for op in MATMUL_AND_ATTENTION}

    counts = {}
    for mode in ("none", "selective", "mlp", "full"):
        model, layers, batch = tiny_hf(family)
        if mode != "none":
            activation_checkpointing({0: model}, layers=lambda _, layers=layers: layers, mode=mode)
        first, second = _split_backward_counts(model, batch)
        counts[mode] = (heavy(first), heavy(second))
    assert sum(counts["none"][1].values()) > 0  # the weight-gradient pass runs matmuls at all
    assert counts["selective"] == counts["none"] == counts["mlp"]
    assert sum(counts["full"][1].values()) > sum(counts["none"][1].values())


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_deferred_w_recomputation_runs_no_trailing_matmul(family: str) -> None:
    """Under deferred W (`pp_offload.runtime.deferred_w`) a linear saves its inputs after computing its
    output, so a recomputation reaches the layer's trailing matmul (Llama's down projection, GPT-2's MLP
    output projection) although nothing after it saves a tensor: it gets zeros of that output's shape
    instead of running again, and the gradients stay the plain model's. Counted: the backward (I, with its
    recomputation) runs exactly the matmuls it runs without recompute."""
    import types

    from pp_offload.runtime.deferred_w import apply_queued_weight_grads, collecting, defer_weight_grads

    matmuls = ("mm", "addmm", "bmm", "linear_dw_queued")

    def backward(mode: str) -> tuple[int, list[torch.Tensor]]:
        model, layers, batch = tiny_hf(family)
        if mode != "none":
            activation_checkpointing({0: model}, layers=lambda _: layers, mode=mode)
        defer_weight_grads([types.SimpleNamespace(submod=model, backward_maybe_with_nosync=lambda: None)])
        loss = model(**batch).last_hidden_state.square().mean()
        with _CountOps() as ops, collecting():
            loss.backward()
        apply_queued_weight_grads(model.parameters())
        return sum(ops.counts.get(op, 0) for op in matmuls), [p.grad for p in model.parameters()]

    plain_matmuls, plain = backward("none")
    for mode in ("selective", "mlp"):
        counted, grads = backward(mode)
        assert counted == plain_matmuls, mode
        for g, w in zip(grads, plain, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)
