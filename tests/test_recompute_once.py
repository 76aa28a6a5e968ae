"""``+once`` recompute plans (one process, CPU): a checkpointed layer recomputes once per microbatch under
split backward (I recomputes, W reuses), with the same gradients as no checkpointing; the recomputed
tensors live from I to the release of the backward nodes that saved them; the layer inputs go through the
activation store; a recomputation that differs from the forward is an error; RNG and no-grad behave as
``torch.utils.checkpoint``."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from _tiny_hf import tiny_hf
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from pp_offload.parallel import activation_checkpointing, checkpointing_mode
from pp_offload.recompute_plan import RecomputePlan, parse_recompute, recomputations
from pp_offload.runtime import recompute_once
from pp_offload.runtime.recompute_once import RecomputeMismatchError, checkpoint_once
from pp_offload.runtime.step_counts import count_layer_runs
from pp_offload.runtime.store import ActivationStore

ROWS, HIDDEN, LAYERS = 48, 32, 3


pytestmark = pytest.mark.usefixtures("one_thread")


def _hf_grads(model: nn.Module, batch: dict, split: bool) -> list[torch.Tensor]:
    """Full backward, or zero-bubble style: the embedding's gradient (an I-like pass over every layer)
    with ``retain_graph``, then the other parameters' (W)."""
    model.zero_grad(set_to_none=True)
    # no KV cache, as in training: a cache passed to checkpointed layers would tie their graphs to it
    loss = model(**batch, use_cache=False).last_hidden_state.square().mean()
    params = [p for p in model.parameters() if p.requires_grad]
    if not split:
        loss.backward()
        return [p.grad.clone() for p in params]
    emb = [p for n, p in model.named_parameters() if "embed_tokens" in n or n.startswith("wte")]
    rest = [p for p in params if all(p is not e for e in emb)]
    first = torch.autograd.grad(loss, emb, retain_graph=True)
    return [*first, *torch.autograd.grad(loss, rest)]


@pytest.mark.parametrize("mode", ["full+once", "selective+once", "mlp+once", "selective:0.5,mlp+once"])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_once_keeps_hf_gradients_and_runs_each_layer_twice(family: str, mode: str) -> None:
    model, layers, batch = tiny_hf(family)
    want = {split: _hf_grads(model, batch, split) for split in (False, True)}
    activation_checkpointing({0: model}, layers=lambda _: layers, mode=mode)
    runs = count_layer_runs([model])
    assert len(runs) == 0 and runs is not None
    for split in (False, True):
        runs.clear()
        got = _hf_grads(model, batch, split)
        for g, w in zip(got, want[split], strict=True):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7, msg=lambda m, s=split: f"split={s}: {m}")
        # the forward and one recomputation, in either backward; torch's checkpoint runs a layer 3 times
        # under split backward
        assert set(runs.values()) == {2}, (split, dict(runs))
        assert len(runs) == len(layers)


def test_plan_strings_and_the_rule() -> None:
    plan = parse_recompute("selective:0.75,mlp+once")
    assert plan == RecomputePlan("selective", 0.75, "mlp", once=True)
    assert plan.label == "selective:0.75,mlp+once" and parse_recompute(plan.label) == plan
    assert parse_recompute(" Full + once ").label == "full+once"
    assert checkpointing_mode("mlp+once") == "mlp+once"
    for bad, match in (
        ("none+once", "applies to a plan that recomputes"),
        ("full+twice", "only modifier after '\\+' is 'once'"),
        ("fast+once", "unknown recompute mode"),
    ):
        with pytest.raises(ValueError, match=match):
            parse_recompute(bad)
    with pytest.raises(ValueError, match="applies to a plan that recomputes"):
        RecomputePlan("none", once=True)
    torch_split = {"deferred_w": False, "once": True}
    assert [recomputations(k, **torch_split) for k in ("F", "I", "W", "B")] == [0, 1, 0, 1]
    # torch's first stage runs its whole backward at W: that is the one recomputation
    assert [recomputations(k, first_stage=True, **torch_split) for k in ("F", "I", "W", "B")] == [0, 0, 1, 1]


def test_switching_between_once_and_per_pass_rewraps_the_layers() -> None:
    model, layers, batch = tiny_hf("llama")
    want = _hf_grads(model, batch, True)
    for mode in ("selective", "selective+once", "mlp+once", "full", "none"):
        activation_checkpointing({0: model}, layers=lambda _: layers, mode=mode)
        runs = count_layer_runs([model])
        got = _hf_grads(model, batch, True)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)
        per_layer = {"selective": 3, "full": 3, "none": None}.get(mode, 2)
        assert set(runs.values()) == ({per_layer} if per_layer else set()), (mode, dict(runs))


def _blocks() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[
            nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, HIDDEN))
            for _ in range(LAYERS)
        ]
    )


def test_recomputed_tensors_live_from_input_pass_to_weight_pass(monkeypatch) -> None:
    """I's recomputation is held for W (that is the plan's memory price) and freed once W has released the
    nodes that saved them: nothing outlives the graph."""
    held: list[StorageWeakRef] = []
    recompute = recompute_once._Frame.recompute
    model = _blocks()
    x = torch.randn(ROWS, HIDDEN).requires_grad_(True)
    # weights and the stage input are saved too, but they live on anyway
    lasting = {t.untyped_storage().data_ptr() for t in [x, *model.parameters()]}

    def recording(self) -> None:
        recompute(self)
        storages = (t.untyped_storage() for t in self.recomputed.values())
        held.extend(StorageWeakRef(s) for s in storages if s.data_ptr() not in lasting)

    monkeypatch.setattr(recompute_once._Frame, "recompute", recording)
    activation_checkpointing({0: model}, layers=list, mode="full+once")
    loss = model(x).square().mean()
    assert held == []  # the forward keeps only the inputs
    torch.autograd.grad(loss, [x], retain_graph=True)
    gc.collect()
    assert held and not any(ref.expired() for ref in held)  # kept for W
    count = len(held)
    torch.autograd.grad(loss, list(model.parameters()))
    assert len(held) == count  # W recomputed nothing
    del loss
    gc.collect()
    assert all(ref.expired() for ref in held), "recomputed tensors outlived the graph"


def test_layer_inputs_go_through_the_store_and_come_back_after_offload() -> None:
    x = torch.randn(ROWS, HIDDEN, generator=torch.Generator().manual_seed(2))
    plain = _blocks()
    xin = x.clone().requires_grad_(True)
    loss = plain(xin).square().mean()
    (want_dx,) = torch.autograd.grad(loss, [xin], retain_graph=True)
    want = [*torch.autograd.grad(loss, list(plain.parameters())), want_dx]

    model = _blocks()
    activation_checkpointing({0: model}, layers=list, mode="selective+once")
    store = ActivationStore("cpu")
    xin = x.clone().requires_grad_(True)
    with store.capture("c", keep=[xin]):
        loss = model(xin).square().mean()
    assert store.stats().chunks["c"].captured_bytes > 0  # layer inputs and kept matmul outputs
    store.offload("c")
    assert store.resident_bytes() == 0
    with pytest.raises(RuntimeError, match=r"'c'.*not reloaded"):
        torch.autograd.grad(loss, [xin], retain_graph=True)
    store.reload("c")
    (dx,) = torch.autograd.grad(loss, [xin], retain_graph=True)
    got = [*torch.autograd.grad(loss, list(model.parameters())), dx]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)
    store.release("c")


def test_recomputation_that_differs_from_the_forward_is_refused() -> None:
    state = {"extra": True}
    lin = nn.Linear(HIDDEN, HIDDEN)

    def layer(h: torch.Tensor) -> torch.Tensor:
        out = torch.tanh(lin(h))
        if state["extra"]:
            out = torch.sigmoid(out) * out
        return out.sin()

    x = torch.randn(ROWS, HIDDEN, requires_grad=True)
    y = checkpoint_once(layer, x).sum()
    state["extra"] = False  # the recomputation saves fewer tensors than the forward did
    with pytest.raises(RecomputeMismatchError, match="same ops in backward as in forward"):
        y.backward()


def test_dropout_is_recomputed_with_the_forwards_rng_and_no_grad_just_runs() -> None:
    torch.manual_seed(3)
    block = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Dropout(0.5), nn.Linear(HIDDEN, HIDDEN)).train()
    x = torch.randn(ROWS, HIDDEN)

    def grads(wrap) -> list[torch.Tensor]:
        torch.manual_seed(7)
        block.zero_grad(set_to_none=True)
        xin = x.clone().requires_grad_(True)
        out = wrap(block, xin)
        torch.rand(5)  # the RNG moves on before backward; the recomputation must not see it
        out.square().mean().backward()
        return [p.grad.clone() for p in block.parameters()] + [xin.grad]

    want = grads(lambda m, h: m(h))
    got = grads(lambda m, h: checkpoint_once(m, h))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    with torch.no_grad():
        torch.manual_seed(7)
        out = checkpoint_once(block, x)
    assert out.grad_fn is None


# --- the planner charges what the runtime does ------------------------------------------------------------


@pytest.mark.parametrize("first", [False, True])
def test_planner_times_and_bytes_of_a_once_plan(first: bool) -> None:
    """I recomputes, W does not (torch's first stage: W is the one backward pass and recomputes); the
    bytes recompute freed come back from I to W, except on the first stage."""
    from pp_offload.plan.costs import stage_times
    from pp_offload.plan.machines import resolve_machine
    from pp_offload.plan.memory import chunk_activation, layers_activation_bytes
    from pp_offload.plan.model import model_spec

    spec, machine = model_spec("llama-3-8b"), resolve_machine("H100")
    kw = {"layers": 4, "first": first, "last": False, "microbatch_size": 1, "seq_len": 4096}
    plain, per_pass, once = (
        stage_times(spec, machine, "bf16", recompute=plan, **kw)
        for plan in ("none", "selective", "selective+once")
    )
    assert once.I == pytest.approx(per_pass.I)
    assert once.W == pytest.approx(per_pass.W if first else plain.W)
    assert once.I + once.W - once.shared == pytest.approx(per_pass.I + per_pass.W - per_pass.shared)  # B
    keep, recomputed, kept_for_w = (
        chunk_activation(spec, "bf16", recompute=plan, **kw)
        for plan in ("none", "selective", "selective+once")
    )
    assert kept_for_w.saved == recomputed.saved < keep.saved
    layer_kw = {k: kw[k] for k in ("layers", "first", "microbatch_size", "seq_len")}
    freed = sum(layers_activation_bytes(spec, "bf16", **layer_kw)) - sum(
        layers_activation_bytes(spec, "bf16", recompute="selective", **layer_kw)
    )
    assert kept_for_w.held_after_input == (0 if first else freed) and freed > 0


def test_activation_peak_counts_the_once_bytes_from_input_to_weight_pass() -> None:
    """One stage, two microbatches, F F I I W W: without the I-to-W bytes the peak is two chunks' saved
    bytes at the second F; with them both chunks hold them from their I to their W."""
    from pp_offload.order.actions import F as FWD
    from pp_offload.order.actions import I, W
    from pp_offload.order.offload_inputs import StageBytes, activation_peaks
    from pp_offload.sim import SimResult

    timeline = {
        0: [((0, FWD, 0), 0, 1), ((0, FWD, 1), 1, 2), ((0, I, 0), 2, 3), ((0, I, 1), 3, 4)]
        + [((0, W, 0), 4, 5), ((0, W, 1), 5, 6)]
    }
    sim = SimResult(6.0, {0: 6.0}, {0: 2.0}, timeline, {0: []}, {0: []}, {0: 0.0})
    assert activation_peaks(sim, [StageBytes(saved=100)]) == [200]
    assert activation_peaks(sim, [StageBytes(saved=100, held_after_input=30)]) == [260]


def test_auto_option_once_is_priced_like_the_plain_plan_under_deferred_w() -> None:
    from pp_offload.plan.auto import RecomputeOption
    from pp_offload.plan.probe import Measurement

    measured = Measurement.uniform(2, F=0.01, I=0.012, W=0.008, saved_bytes=4000, layers=2)
    per_pass = RecomputeOption("selective", kept_share=0.4, forward_share=0.2).apply(measured)
    option = RecomputeOption("selective", kept_share=0.4, forward_share=0.2, once=True)
    assert option.label == "selective+once"
    once = option.apply(measured)
    for before, p, o in zip(measured.stages, per_pass.stages, once.stages, strict=True):
        # deferred W: one backward per microbatch, so +once changes neither time nor the I-to-W bytes
        assert (o.I, o.W) == (pytest.approx(p.I), pytest.approx(p.W)) and o.W == pytest.approx(before.W)
        assert o.saved_bytes == p.saved_bytes
        assert o.held_after_input == 0


def test_within_search_keeps_once_on_every_share_of_a_family() -> None:
    from pp_offload.plan.within import plan_shares

    assert plan_shares("full:S+once", [2, 2]) == ["full:0.5+once", "full+once"]
    assert plan_shares("selective:S,mlp+once", [2, 2])[-1] == "selective+once"
    assert plan_shares("mlp+once", [2, 2]) == ["mlp+once"]


@pytest.mark.parametrize("mode", ["full+once", "selective+once"])
def test_no_frame_or_recomputed_tensor_outlives_its_graph(mode: str, monkeypatch) -> None:
    """A recomputation runs ops that save their own outputs (rsqrt in the norms, the attention kernel):
    had its graph held those outputs with their history, the cycle through C++ would keep every tensor it
    recomputed alive for good (16 MB a step in a pipeline, found by bench_hotpath)."""
    model, layers, batch = tiny_hf("llama")
    lasting = {p.untyped_storage().data_ptr() for p in model.parameters()}
    held: list[StorageWeakRef] = []
    recompute = recompute_once._Frame.recompute

    def recording(self) -> None:
        recompute(self)
        storages = (t.untyped_storage() for t in self.recomputed.values())
        held.extend(StorageWeakRef(s) for s in storages if s.data_ptr() not in lasting)

    monkeypatch.setattr(recompute_once._Frame, "recompute", recording)
    frames: list[weakref.ReferenceType] = []  # this test's frames only (another test's may be held elsewhere)
    init = recompute_once._Frame.__init__

    def tracked(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        frames.append(weakref.ref(self))

    monkeypatch.setattr(recompute_once._Frame, "__init__", tracked)
    activation_checkpointing({0: model}, layers=lambda _: layers, mode=mode)
    for split in (False, True):
        _hf_grads(model, batch, split)
    gc.collect()
    alive = [ref for ref in frames if ref() is not None]
    assert frames and alive == [], f"{len(alive)} of {len(frames)} checkpoint frames outlived their graph"
    assert held and all(ref.expired() for ref in held), "recomputed tensors outlived their graph"
