"""ActivationStore on CPU: the same bookkeeping as on CUDA (views, dtypes, pooling, order checks) with
synchronous copies, so a wrong layout or a missing RELOAD shows up as a wrong gradient or an error here."""

from __future__ import annotations

import contextlib
import gc
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from pp_offload.runtime.compat import stage_backward_input, stage_backward_weight
from pp_offload.runtime.store import ActivationStore, _Chunk

B, S, H, VOCAB = 4, 64, 32, 40
MIN_NUMEL = 64  # below B * S: the int64 ids and LayerNorm's statistics are stored too


class Block(nn.Module):
    """A stage with the saved-tensor shapes a transformer produces: Linear, GELU, LayerNorm, a matmul
    with a transposed weight, two views of one projection (q, k), transposes and reshapes, bf16, int64
    (embedding ids) and bool (where's mask)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, H)
        self.fc1 = nn.Linear(H, 4 * H)
        self.fc2 = nn.Linear(4 * H, H)
        self.norm = nn.LayerNorm(H)
        self.qk = nn.Linear(H, 2 * H)
        self.proj = nn.Parameter(torch.randn(H, H) / H**0.5)
        self.bf = nn.Linear(H, H, dtype=torch.bfloat16)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        y = x + self.emb(ids)
        y = self.norm(y + self.fc2(F.gelu(self.fc1(y))))
        q, k = self.qk(y).chunk(2, dim=-1)
        att = torch.softmax(q @ k.transpose(-1, -2) / h**0.5, dim=-1)
        z = (att @ y) @ self.proj.t()
        zb = self.bf(z.to(torch.bfloat16)).float()
        gate = torch.where(z > 0, z, 0.1 * z)
        w = zb.reshape(b, s * h).view(b, s, h).transpose(1, 2)
        return (w.transpose(1, 2) * gate).tanh()


pytestmark = pytest.mark.usefixtures("one_thread")


def _model() -> Block:
    torch.manual_seed(0)
    return Block()


def _inputs(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, S, H, generator=g).requires_grad_(True)
    ids = torch.randint(0, VOCAB, (B, S), generator=g)
    grad = torch.randn(B, S, H, generator=g)
    return x, ids, grad


def _grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    return [x.grad] + [p.grad for p in model.parameters()]


def _assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for u, v in zip(a, b, strict=True):
        assert u is not None and v is not None
        assert u.dtype == v.dtype
        assert torch.equal(u, v)


def _reference(split: bool) -> list[torch.Tensor]:
    model = _model()
    x, ids, grad = _inputs()
    out = model(x, ids)
    if split:
        _, groups = stage_backward_input([out], [grad], [x], model.parameters())
        stage_backward_weight(model.parameters(), groups)
    else:
        out.backward(grad)
    return _grads(model, x)


def test_full_backward_grads_equal_without_store() -> None:
    model = _model()
    x, ids, grad = _inputs()
    store = ActivationStore("cpu", min_numel=MIN_NUMEL)
    with store.capture((1, 0), keep=[x]):
        out = model(x, ids)
    store.offload((1, 0))
    assert store.resident_bytes() == 0
    store.reload((1, 0))
    out.backward(grad)
    store.release((1, 0))
    _assert_same(_grads(model, x), _reference(split=False))
    st = store.stats()
    assert st.chunks == {} and st.resident_bytes == 0
    assert set(st.host_pool) == {torch.float32, torch.bfloat16, torch.int64, torch.bool}


def test_split_backward_grads_equal_and_w_needs_the_chunk() -> None:
    model = _model()
    x, ids, grad = _inputs()
    store = ActivationStore("cpu", min_numel=MIN_NUMEL)
    with store.capture((1, 0), keep=[x]):
        out = model(x, ids)
    store.offload((1, 0))
    store.reload((1, 0))
    _, groups = stage_backward_input([out], [grad], [x], model.parameters())
    assert store.stats().chunks[(1, 0)].state == "reloaded"  # I done; W still unpacks saved tensors
    stage_backward_weight(model.parameters(), groups)
    store.release((1, 0))
    _assert_same(_grads(model, x), _reference(split=True))

    # released after I: W must fail loudly, not read freed memory
    model = _model()
    x, ids, grad = _inputs()
    with store.capture((1, 0), keep=[x]):
        out = model(x, ids)
    store.offload((1, 0))
    store.reload((1, 0))
    _, groups = stage_backward_input([out], [grad], [x], model.parameters())
    store.release((1, 0))
    with pytest.raises(RuntimeError, match=r"activations of \(1, 0\) were released"):
        stage_backward_weight(model.parameters(), groups)


def test_without_offload_the_graph_uses_the_originals() -> None:
    model = _model()
    x, ids, grad = _inputs()
    store = ActivationStore("cpu", min_numel=MIN_NUMEL)
    with store.capture("mb", keep=[x]):
        out = model(x, ids)
    out.backward(grad)
    store.release("mb")
    _assert_same(_grads(model, x), _reference(split=False))
    assert store.stats().host_pool == {}


def test_what_is_kept_stored_and_viewed() -> None:
    model = _model()
    x, ids, _ = _inputs()
    store = ActivationStore("cpu", min_numel=MIN_NUMEL)
    with store.capture(0, keep=[x]):
        model(x, ids)
    c = store.stats().chunks[0]
    # weights of fc1, fc2, qk, bf (as weight.t()), proj.t(), the LayerNorm's weight and bias: not copied
    assert c.kept["parameter"] == 7
    assert c.kept["keep"] == 0  # x itself is only added to, never saved, in this block
    # q and k (views of one qk projection), y (viewed 3-D by att @ y), softmax's output (saved twice)
    assert c.views == 3
    assert c.stored == 16
    assert c.resident_bytes == c.captured_bytes > 0
    assert set(store._chunks[0].totals) == {torch.float32, torch.bfloat16, torch.int64, torch.bool}


def test_view_of_stored_tensor_is_one_copy() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        a = x * 2  # a scalar multiply saves nothing
        return a.sin().sum() + a.t().cos().sum() + a[:, 3:40].sin().sum() + a.view(4096).exp().sum()

    store = ActivationStore("cpu")
    x = torch.randn(64, 64, requires_grad=True)
    with store.capture("v"):
        out = f(x)
    c = store.stats().chunks["v"]
    assert c.stored == 2  # a (saved by sin), exp's output (saved by exp)
    assert c.views == 2  # a.t() (cos) and a[:, 3:40] (sin) are recorded as views of a
    assert c.copies == 2
    assert c.captured_bytes == 64 * 64 * 4 + 4096 * 4
    store.offload("v")
    store.reload("v")
    (gx,) = torch.autograd.grad(out, [x])
    store.release("v")
    y = x.detach().clone().requires_grad_(True)
    assert torch.equal(gx, torch.autograd.grad(f(y), [y])[0])


def test_small_slice_of_large_storage_is_copied_compactly() -> None:
    store = ActivationStore("cpu", min_numel=0)
    big = torch.randn(256, 64)
    w = torch.randn(8, requires_grad=True)
    with store.capture("s"):
        out = (big[:, 5:13] * w).sum()  # mul saves the strided slice of big (w needs its grad)
    c = store.stats().chunks["s"]
    assert c.stored == 1 and c.copies == 1
    assert c.captured_bytes == 256 * 8 * 4  # the slice, not the 64 KiB storage it lives in
    store.offload("s")
    store.reload("s")
    (g,) = torch.autograd.grad(out, [w])
    store.release("s")
    assert torch.equal(g, big[:, 5:13].sum(0))


def test_keep_tensors_and_their_views_are_not_copied() -> None:
    store = ActivationStore("cpu")
    x = torch.randn(64, 64, requires_grad=True)  # the stage input in the receive buffer
    with store.capture("k", keep=[None, 3, {"args": (x,)}]):
        out = x.sin().sum() + x.t().cos().sum() + x[:, :40].exp().sum()
    c = store.stats().chunks["k"]
    assert c.kept["keep"] == 2  # x (sin), x.t() (cos); exp saves its output, which is stored
    assert c.stored == 1 and c.captured_bytes == 64 * 40 * 4
    assert c.kept_bytes == 64 * 64 * 4
    store.offload("k")
    store.reload("k")
    torch.autograd.grad(out, [x])
    store.release("k")


def test_tiny_and_parameter_tensors_stay_put() -> None:
    store = ActivationStore("cpu", min_numel=1024)
    lin = nn.Linear(16, 16)
    x = torch.randn(8, 16, requires_grad=True)  # 128 elements: small
    with store.capture("t"):
        out = F.gelu(lin(x)).sum()
    c = store.stats().chunks["t"]
    assert c.stored == 0 and c.captured_bytes == 0
    assert c.kept["parameter"] == 1 and c.kept["small"] == 2
    store.offload("t")
    store.reload("t")
    torch.autograd.grad(out, [x, lin.weight])
    store.release("t")
    # with min_numel=0 the same activations are stored, the weight still not
    store = ActivationStore("cpu", min_numel=0)
    with store.capture("t"):
        F.gelu(lin(x)).sum()
    c = store.stats().chunks["t"]
    assert c.stored == 2 and c.kept["parameter"] == 1 and c.kept["small"] == 0


def _step(store: ActivationStore, model: nn.Module, microbatches: int, seed: int) -> None:
    """One pipeline-like step: every forward and offload, then reloads and backwards in reverse order."""
    outs = []
    for mb in range(microbatches):
        x, ids, grad = _inputs(seed + mb)
        with store.capture((0, mb), keep=[x]):
            outs.append((model(x, ids), grad))
        store.offload((0, mb))
    for mb in reversed(range(microbatches)):
        store.reload((0, mb))
        out, grad = outs[mb]
        out.backward(grad)
        store.release((0, mb))


def test_host_buffers_reused_across_steps_without_growth() -> None:
    model = _model()
    store = ActivationStore("cpu", min_numel=MIN_NUMEL)
    pools = []
    for step in range(20):
        _step(store, model, microbatches=2, seed=10 * step)
        pools.append(store.stats().host_pool)
    assert all(p == pools[0] for p in pools[1:])
    assert set(pools[0]) == {torch.float32, torch.bfloat16, torch.int64, torch.bool}
    assert all(s.buffers == 2 and s.in_use == 0 for s in pools[0].values())  # one per offloaded chunk


def test_no_leak_after_many_steps() -> None:
    model = _model()
    store = ActivationStore("cpu", min_numel=MIN_NUMEL)
    weak: list[StorageWeakRef] = []
    handle = model.fc1.register_forward_hook(lambda m, i, o: weak.append(StorageWeakRef(o.untyped_storage())))
    x, ids, grad = _inputs()
    with store.capture("w", keep=[x]):
        out = model(x, ids)
    assert not weak[-1].expired()  # fc1's output is saved (by GELU) and held by the store...
    recorded = [StorageWeakRef(t.untyped_storage()) for t in store._chunks["w"].originals]
    store.offload("w")
    assert weak[-1].expired()  # ...and freed by the offload, while the graph is still alive
    # so is every recorded storage but those the caller holds: the output (saved by tanh) and the ids
    alive = {r.cdata for r in recorded if not r.expired()}
    assert alive == {StorageWeakRef(t.untyped_storage()).cdata for t in (out, ids)}
    store.reload("w")
    out.backward(grad)
    store.release("w")
    handle.remove()

    store = ActivationStore("cpu", min_numel=MIN_NUMEL)
    for step in range(12):
        _step(store, model, microbatches=3, seed=step)
    assert store.resident_bytes() == 0
    assert store._chunks == {}
    assert all(len(free) == 3 for free in store._pool._free.values())
    gc.collect()
    assert not [o for o in gc.get_objects() if type(o) is _Chunk]  # graphs gone, handles gone


def test_backward_without_reload_names_the_chunk() -> None:
    model = _model()
    x, ids, grad = _inputs()
    store = ActivationStore("cpu", min_numel=MIN_NUMEL)
    with store.capture((3, 1), keep=[x]):
        out = model(x, ids)
    store.offload((3, 1))
    with pytest.raises(RuntimeError, match=r"activations of \(3, 1\) were offloaded but not reloaded"):
        out.backward(grad)
    store.reload((3, 1))  # the chunk is intact: a late RELOAD still gives the right grads
    out.backward(grad)
    store.release((3, 1))
    _assert_same(_grads(model, x), _reference(split=False))


def test_bad_input() -> None:
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="without CUDA; use device='cpu'"):
            ActivationStore("cuda")
    with pytest.raises(ValueError, match="pin_memory"):
        ActivationStore("cpu", pin_memory=True)
    with pytest.raises(ValueError, match="min_numel"):
        ActivationStore("cpu", min_numel=-1)
    with pytest.raises(ValueError, match="'cuda' or 'cpu'"):
        ActivationStore("meta")

    store = ActivationStore("cpu")
    for call in (store.offload, store.reload, store.release):
        with pytest.raises(KeyError, match=r"\(9, 9\).*not in the store"):
            call((9, 9))
    x = torch.randn(64, 64, requires_grad=True)
    with store.capture("a"):
        x.sin()
        with pytest.raises(RuntimeError, match="inside its own capture"):
            store.offload("a")
    with pytest.raises(ValueError, match="already in the store"):
        with store.capture("a"):
            pass
    with pytest.raises(RuntimeError, match="before its offload"):
        store.reload("a")
    store.offload("a")
    with pytest.raises(RuntimeError, match="already offloaded"):
        store.offload("a")
    store.reload("a")
    with pytest.raises(RuntimeError, match="already reloaded"):
        store.reload("a")
    store.release("a")
    with pytest.raises(KeyError):
        store.release("a")


def test_in_place_change_of_a_saved_tensor_is_refused() -> None:
    # torch skips its version check for tensors saved through hooks: the store does it instead
    x = torch.randn(2048, requires_grad=True)
    for offload in (True, False):
        store = ActivationStore("cpu")
        with store.capture("ip"):
            a = x * 2
            b = a.sin()
            a.add_(1)
        with pytest.raises(RuntimeError, match=r"chunk 'ip' was modified by an in-place operation"):
            if offload:
                store.offload("ip")
            else:
                b.sum().backward()


def test_reset_returns_host_buffers() -> None:
    store = ActivationStore("cpu")
    x = torch.randn(64, 64, requires_grad=True)
    for key in range(3):
        with store.capture(key):
            (x * 2).sin()
        store.offload(key)
    store.reload(0)
    assert store.resident_bytes() == 64 * 64 * 4
    store.reset()
    assert store.resident_bytes() == 0 and store._chunks == {}
    assert store.stats().host_pool[torch.float32].in_use == 0


def test_pool_grows_in_size_not_in_count_and_stats_serialize() -> None:
    store = ActivationStore("cpu", min_numel=0)
    for n in (1000, 30000, 500):  # one chunk at a time: one buffer, replaced when too small
        x = torch.randn(n, requires_grad=True)
        with store.capture(n):
            (x * 2).sin()
        store.offload(n)
        json.dumps(store.stats().to_dict())
        store.release(n)
    pool = store.stats().host_pool[torch.float32]
    assert pool.buffers == 1 and pool.bytes == 1 << 17 and pool.in_use == 0


# --- CUDA (skipped without a GPU) ------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
SLEEP_CYCLES = 50_000_000  # tens of ms of GPU time: long enough for a missing wait to read garbage


def _assert_close(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    """Some CUDA backward kernels accumulate with atomics: equal up to rounding, not bitwise. A copy read
    too early or a wrong layout shows as garbage, far outside these tolerances."""
    for u, v in zip(a, b, strict=True):
        torch.testing.assert_close(u, v)


def _cuda_case() -> tuple[Block, torch.Tensor, torch.Tensor, torch.Tensor]:
    model = _model().cuda()
    x, ids, grad = _inputs()
    return model, x.detach().cuda().requires_grad_(True), ids.cuda(), grad.cuda()


@cuda
@pytest.mark.parametrize("two_lanes", [False, True], ids=["one_lane", "two_lanes"])
def test_cuda_grads_equal_with_slow_producers_and_slow_copies(two_lanes: bool) -> None:
    model, x, ids, grad = _cuda_case()
    model(x, ids).backward(grad)
    ref = [t.clone() for t in _grads(model, x)]
    model.zero_grad(set_to_none=True)
    x.grad = None

    store = ActivationStore("cuda", min_numel=MIN_NUMEL, lanes="duplex" if two_lanes else "shared")
    assert (store.reload_stream is not store.copy_stream) == two_lanes
    assert store.stats().host_pool == {}
    with store.capture(0, keep=[x]):
        torch.cuda._sleep(SLEEP_CYCLES)  # the forward's kernels run late: offload's copies must wait
        out = model(x, ids)
    torch.cuda.synchronize()
    during = torch.cuda.memory_allocated()
    captured = store.stats().chunks[0].captured_bytes
    store.offload(0)
    assert during - torch.cuda.memory_allocated() > captured // 2  # freed for reuse once the copy ends
    with torch.cuda.stream(store.reload_stream):
        torch.cuda._sleep(SLEEP_CYCLES)  # the reload runs late: backward must wait for it
    store.reload(0)
    out.backward(grad)
    store.release(0)
    _assert_close(_grads(model, x), ref)
    assert all(p.buffers == 1 and p.in_use == 0 for p in store.stats().host_pool.values())
    assert all(t.is_pinned() for free in store._pool._free.values() for t, _ in free)


@cuda
def test_cuda_split_backward_over_steps() -> None:
    model, x, ids, grad = _cuda_case()

    def step(store: ActivationStore | None) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        x.grad = None
        outs = []
        for mb in range(3):
            with store.capture((0, mb), keep=[x]) if store else contextlib.nullcontext():
                outs.append(model(x, ids))
            if store:
                store.offload((0, mb))
        for mb in reversed(range(3)):
            if store:
                store.reload((0, mb))
            _, groups = stage_backward_input([outs[mb]], [grad], [x], model.parameters())
            stage_backward_weight(model.parameters(), groups)
            if store:
                store.release((0, mb))
        return [t.clone() for t in _grads(model, x)]

    ref = step(None)
    store = ActivationStore(torch.device("cuda"), min_numel=MIN_NUMEL)
    for _ in range(5):
        _assert_close(step(store), ref)
    assert store.resident_bytes() == 0 and store._chunks == {}
