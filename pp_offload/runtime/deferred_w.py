"""Deferred weight gradients: I is one ordinary backward, W runs the queued weight-gradient GEMMs.

Why: torch splits a stage's backward into I and W as two ``autograd.grad`` calls over one graph kept alive
from I to W. Everything a chunk saved then lives until W, a checkpointed layer recomputes in both calls
(F, I, W: three runs), and a compiled region, one autograd node computing input and weight gradients
together, runs in both calls: wrong gradients or a crash (pytorch #143599, #161904). The zero-bubble
papers' code and DeepSeek's DualPipe split differently, and so does this module: the backward of a
trainable linear-like layer (``nn.Linear``, transformers' GPT-2 ``Conv1D``, peft's LoRA A and B, the LM
head) returns its input gradient and queues (input, output gradient); W takes the queue that microbatch's
I filled and accumulates each weight gradient with the GEMM autograd would run, so eager results are the
same bits. I is then one backward without ``retain_graph``: compiled regions run once, a checkpointed
layer recomputes once, and the gradients of everything else (norms, embeddings, biases, fused expert
tensors) are computed in I as a full backward computes them.

Under torch.compile the layer is a ``torch.library`` custom op with registered autograd, so dynamo and
inductor see one opaque op inside a compiled layer, and its backward calls a second custom op that returns
the input gradient and, when it runs, queues (copies of its tensors when the backward was compiled: inductor
reuses an op's input buffers for later intermediates). In eager mode the same forward, context and backward
run as a plain ``autograd.Function`` (`_EagerLinear`): torch.library's Python dispatch cost 67 us per layer
call against 14 us (`bench/bench_linear_dispatch.py`). Changing what the registered backward does needs new
op names: torch's compile caches (AOT autograd, FX graph) key on the forward graph, which names only the
forward op, and would hand an old backward back. The runtime side is torch's own hook,
``PipelineStage(..., dw_builder=...)``: with a builder, the stage runs a full backward at I and calls the
builder's runner at W (at once after a B).

Use `defer_weight_grads` on a rank's stages before the first step; pp_offload's schedules and
`pp_offload.runtime.catalog.build_schedule` do it for every split-backward schedule (``deferred_w=False``
gives torch's retained-graph split back).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pp_offload.runtime import compat
from pp_offload.runtime.store import save_in_capture

__all__ = [
    "all_deferring",
    "apply_queued_weight_grads",
    "collecting",
    "compiled_modules",
    "defer_weight_grads",
    "deferred_modules",
    "own_forwards",
    "queued_bytes",
    "queued_storages",
    "refuse_compiled_split",
    "WeightPass",
]

# (weight as the op saw it, layer input, output gradient, transposed) per queued weight gradient, in the
# order I produced them. One process-wide queue: autograd may run a backward on another thread (one per
# device), and a rank runs one stage's backward at a time, so what a runner takes is its microbatch's.
_QUEUE: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]] = []
# What the layers' backward does with a weight gradient: "collect" (queue it: a deferring stage's I, or a
# `collecting` block), "discard" (torch's shape inference, 2.13, runs an ``autograd.grad`` for the stage
# inputs through these layers: its weight gradients are not wanted) or "direct" (any other backward: the
# gradient is accumulated at once, as plain autograd would, so a stage left deferring under a schedule that
# does not drain the queue still gets its gradients).
_MODE = ["direct"]
# (data_ptr, shape) -> weight of each deferring layer, for "direct" mode.
_WEIGHTS: dict[tuple[int, tuple[int, ...]], Any] = {}


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def _weight_grad(x: torch.Tensor, dy: torch.Tensor, transposed: bool) -> torch.Tensor:
    """The GEMM autograd runs for ``F.linear`` (``mm_mat2_backward`` of a column-major ``weight.t()``) or
    for ``Conv1D``'s ``addmm(bias, x, weight)``: the same shapes and order, so the same bits in eager."""
    if transposed:
        return _flat(x).t().mm(_flat(dy))
    return _flat(dy).t().mm(_flat(x))


def _input_grad(dy: torch.Tensor, weight: torch.Tensor, transposed: bool, shape: Any) -> torch.Tensor:
    w = weight.t() if transposed else weight
    return _flat(dy).mm(w).reshape(shape)


def _linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool
) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, or GPT-2 ``Conv1D``'s ``addmm`` on a (in, out) weight."""
    if transposed:
        out = torch.addmm(bias, _flat(x), weight) if bias is not None else _flat(x).mm(weight)
        return out.reshape(*x.shape[:-1], weight.shape[1])
    return nn.functional.linear(x, weight, bias)


_linear_dw_queued = torch.library.custom_op("pp_offload::linear_dw_queued", _linear, mutates_args=())
"""`_linear` as one op for dynamo and inductor (module doc); eager code calls `_linear` (`_EagerLinear`)."""


@_linear_dw_queued.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    out = weight.shape[1] if transposed else weight.shape[0]
    return x.new_empty(*x.shape[:-1], out)


def _input_grad_queueing(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    transposed: bool,
    compiled: bool,
    share: int = -1,
    first: bool = True,
    after: torch.Tensor | None = None,
) -> torch.Tensor:
    """The input gradient; queues (x, dy) for W as a side effect. As an op (`_input_grad_and_queue`) it
    returns dX so the partitioner keeps it (an op whose output nobody uses would be dropped as dead code,
    and its queueing with it).

    ``compiled`` (set when the backward was traced by torch.compile): the queue keeps copies. Inductor
    plans a compiled backward's memory as if an op kept none of its inputs: it reuses their buffers for
    later intermediates of the same graph (and the saved activations' buffers, when it may donate them),
    which would overwrite a queued tensor before W reads it (measured: wrong weight gradients).
    ``share`` >= 0: layers that read one input (q/k/v, gate/up, LoRA A adapters) share one copy of it
    (`_trace_share`): the ``first`` copies it, the others (which take the first's input gradient as
    ``after``, so that they run after it) queue that copy. The defaults (no sharing) are the schema of
    graphs compiled before sharing existed, which torch's compile caches may still hand back."""
    mode = _MODE[-1]
    if mode == "collect":
        if compiled:
            x, dy = _shared_copy(x, share, first), dy.clone()
        else:
            x, dy = _compact(x), _compact(dy)
        # detached: a queued input would otherwise hold its forward graph (and the saved tensors of any node
        # this backward did not run) until W
        _QUEUE.append((weight, x.detach(), dy.detach(), transposed))
    elif mode == "direct":
        ref = _WEIGHTS.get(_key(weight))
        param = ref() if ref is not None else None
        if param is None:
            raise RuntimeError(
                f"a deferring layer's weight (shape {tuple(weight.shape)}) got a gradient outside a "
                "deferring stage's backward and is not the weight it was set up with; run the backward "
                "through the pipeline schedule, or wrap it in pp_offload.runtime.deferred_w.collecting()"
                " and call apply_queued_weight_grads"
            )
        _accumulate(param, _weight_grad(x, dy, transposed))
    return _input_grad(dy, weight, transposed, x.shape)


_input_grad_and_queue = torch.library.custom_op(
    "pp_offload::input_grad_and_queue", _input_grad_queueing, mutates_args=()
)


@_input_grad_and_queue.register_fake
def _(dy: torch.Tensor, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.empty_like(x)  # the input gradient has the input's shape


# Compiled backwards: the copy of each shared layer input, by share slot, made by the slot's first user in
# the running graph (`_input_grad_and_queue`); emptied when a backward's collecting ends (a user that finds
# its slot empty copies the input itself: always exact).
_SHARED: dict[int, torch.Tensor] = {}
# While tracing: id of a traced layer input -> (a weak reference to it, its first user's input gradient, its
# share slot), so that the layers reading one input share one slot; dropped once the input is (its trace
# ended). The gradient is held: autograd's accumulation may drop it before the input's last reader is
# traced. Slots are never reused.
_TRACED: dict[int, tuple[Any, Any, int]] = {}
_SLOTS = itertools.count()


# Eager backwards: the compact copy of each queued view of a larger storage, by (storage, offset, size,
# stride, dtype), with the view it was made from: that keeps the storage, so the key names that memory
# until the backward's collecting ends and empties this.
_COMPACT: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = {}


def _compact(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy of it when it views a larger storage: a saved tensor the activation store reloaded
    is a view of one buffer holding the whole chunk (`pp_offload.runtime.store`), which a queued view
    would keep until W. Layers that read one such view (q/k/v, gate/up) share one copy."""
    storage = t.untyped_storage()
    if storage.nbytes() <= t.numel() * t.element_size():
        return t
    key = (t.device, storage.data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
    found = _COMPACT.get(key)
    if found is None:
        found = _COMPACT[key] = (t, t.clone())
    return found[1]


def _shared_copy(x: torch.Tensor, share: int, first: bool) -> torch.Tensor:
    if share < 0:
        return x.clone()
    if first or share not in _SHARED:
        _SHARED[share] = x.clone()
    return _SHARED[share]


def _trace_share(x: torch.Tensor) -> tuple[int, bool, torch.Tensor | None]:
    """At trace time: (slot, first, after) for a deferring layer reading the traced input ``x``: a new slot
    for an input no traced layer read yet, else the slot of the layer that read it first and that layer's
    input gradient (``after``: a data dependency that runs the first user, which copies, before)."""
    known = _TRACED.get(id(x))
    if known is not None:
        ref, dx, slot = known
        if ref() is x:
            return slot, False, dx
    return next(_SLOTS), True, None


def _note_first(x: torch.Tensor, slot: int, dx: torch.Tensor) -> None:
    for key in [k for k, (ref, _, _) in _TRACED.items() if ref() is None]:
        del _TRACED[key]  # inputs of finished traces
    _TRACED[id(x)] = (weakref.ref(x), dx, slot)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    x, weight, bias, transposed = inputs
    ctx.save_for_backward(x, weight)
    ctx.transposed = transposed
    ctx.has_bias = bias is not None


def _backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
    x, weight = ctx.saved_tensors
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    dx = dw = db = None
    if need_w and need_x:
        if torch.compiler.is_compiling():  # the op, which the partitioner keeps and inductor calls
            share, first, after = _trace_share(x)
            dx = torch.ops.pp_offload.input_grad_and_queue(
                dy, x, weight, ctx.transposed, True, share, first, after
            )
            if first:
                _note_first(x, share, dx)
        else:  # eager: its body, without torch.library's dispatch
            dx = _input_grad_queueing(dy, x, weight, ctx.transposed, False)
    else:
        # No input gradient wanted (a first layer behind a frozen embedding): nothing would keep a queueing
        # op alive under compile, so the weight gradient is computed here, in I. Still one pass, still exact.
        if need_x:
            dx = _input_grad(dy, weight, ctx.transposed, x.shape)
        if need_w:
            dw = _weight_grad(x, dy, ctx.transposed)
    if need_b and ctx.has_bias:
        db = _flat(dy).sum(0)
    return dx, dw, db, None


_linear_dw_queued.register_autograd(_backward, setup_context=_setup_context)


class _EagerLinear(torch.autograd.Function):
    """Eager mode's deferring linear: the op's forward, context and backward as a plain autograd Function.
    Why: torch.library's dispatch of a Python custom op (schema defaults, redispatch, its own autograd
    wrapper) cost 67 us of Python per layer call over a plain linear, forward and backward together,
    against 14 us here (`bench/bench_linear_dispatch.py`); compiled code needs the op, eager code does
    not. The context is set in ``forward``: with a separate ``setup_context``, ``apply`` binds every call's
    arguments with ``inspect.signature``, which cost most of that saving again."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: Any, transposed: bool) -> torch.Tensor:
        _setup_context(ctx, (x, weight, bias, transposed), None)
        return _linear(x, weight, bias, transposed)

    backward = staticmethod(_backward)


# --- which layers -----------------------------------------------------------------------------------------


def _conv1d_class() -> type | None:
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # transformers is optional for hand-built stages
        return None
    return Conv1D


def _linear_like(module: nn.Module, conv1d: type | None) -> bool | None:
    """True/False (transposed weight or not) for a layer whose weight gradient can be deferred; None else.
    Subclasses with their own forward (quantized linears, peft's wrappers) are left to autograd."""
    if type(module).forward is nn.Linear.forward and isinstance(module, nn.Linear):
        return False
    if conv1d is not None and type(module).forward is conv1d.forward and isinstance(module, conv1d):
        return True
    return None


_CLASSES: dict[type, type] = {}


def _deferring_class(cls: type, transposed: bool) -> type:
    """``cls`` with its forward through the deferring op, one subclass per class (same name). Why a class
    and not a per-instance forward: dynamo guards on the identity of an instance's forward, so a compiled
    decoder layer would recompile for each layer's own bound forward; a shared class is one guard."""
    sub = _CLASSES.get(cls)
    if sub is None:

        def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
            if torch.compiler.is_compiling():  # one opaque op for dynamo and inductor
                return _linear_dw_queued(x, self.weight, self.bias, transposed)
            return _EagerLinear.apply(x, self.weight, self.bias, transposed)

        namespace = {"forward": forward, "_pp_offload_transposed": transposed, "_pp_offload_base": cls}
        sub = _CLASSES[cls] = type(cls.__name__, (cls,), {**namespace, "__qualname__": cls.__qualname__})
    return sub


def _is_deferring(module: nn.Module) -> bool:
    return "_pp_offload_base" in vars(type(module))


def deferred_modules(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """The layers under ``root`` whose weight gradients `defer_weight_grads` queued for W."""
    return [(n, m) for n, m in root.named_modules() if _is_deferring(m)]


def _patch_layers(root: nn.Module) -> int:
    """Route every trainable linear-like layer under ``root`` through the custom op (idempotent); returns
    how many layers defer. Frozen layers keep their own forward: they queue nothing either way."""
    conv1d = _conv1d_class()
    count = 0
    for module in root.modules():
        if _is_deferring(module):
            count += 1
            continue
        transposed = _linear_like(module, conv1d)
        weight = getattr(module, "weight", None)
        if transposed is None or not isinstance(weight, torch.Tensor) or not weight.requires_grad:
            continue
        _WEIGHTS[_key(weight)] = weakref.ref(weight)
        module.__class__ = _deferring_class(type(module), transposed)
        count += 1
    return count


# --- W ------------------------------------------------------------------------------------------------------


def _key(t: torch.Tensor) -> tuple[int, tuple[int, ...]]:
    return t.data_ptr(), tuple(t.shape)


def apply_queued_weight_grads(params: Iterable[torch.Tensor], entries: list[Any] | None = None) -> int:
    """Accumulate the queued weight gradients into ``params``' ``.grad`` (autograd's accumulation: assign
    the first, add the next), emptying the queue (or ``entries``) as it goes, so each queued tensor is
    freed once used. Returns how many were applied. An entry whose weight is none of ``params`` is an error:
    it would be a gradient silently lost. For hand-built code that runs a backward through deferring
    layers outside a pipeline schedule: ``with collecting(): loss.backward()``, then call it."""
    queue = _QUEUE if entries is None else entries
    by_key = {_key(p): p for p in params if p.requires_grad}
    taken, queue[:] = list(queue), []
    taken.reverse()  # popped from the end: I's order, each entry dropped once used
    applied = 0
    while taken:
        weight, x, dy, transposed = taken.pop()
        if weight.numel() and weight.untyped_storage().nbytes() == 0:
            raise RuntimeError(
                f"a weight of shape {tuple(weight.shape)} had its storage freed between the I that queued "
                "its gradient and this W (an FSDP unit resharded after its forward?), so its gradient "
                "cannot be matched to a parameter; shard with reshard_after_forward=False under split "
                "backward (pp_offload.parallel.apply_fsdp's default)"
            )
        param = by_key.get(_key(weight))
        if param is None:
            raise RuntimeError(
                f"a weight gradient was queued for a weight of shape {tuple(weight.shape)} that is not among "
                "the parameters being updated; run each backward through deferring layers via the pipeline "
                "schedule, or call apply_queued_weight_grads with the module that holds the layer"
            )
        with torch.no_grad():  # x is a graph's intermediate: its product must not extend that graph
            grad = _weight_grad(x, dy, transposed)
            del x, dy, weight
            _accumulate(param, grad)
        applied += 1
    return applied


def _accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)


def queued_storages(entries: list[Any] | None = None) -> dict[tuple[Any, int], int]:
    """(device, data pointer) -> bytes of each distinct storage the queue (or ``entries``, a runner's
    share of it) holds."""
    seen: dict[tuple[Any, int], int] = {}
    for _, x, dy, _ in _QUEUE if entries is None else entries:
        for t in (x, dy):
            storage = t.untyped_storage()
            seen[(t.device, storage.data_ptr())] = storage.nbytes()
    return seen


def queued_bytes(entries: list[Any] | None = None, leave_out: Iterable[tuple[Any, int]] = ()) -> int:
    """Bytes held by the queue (or ``entries``), each distinct storage once: the deferred-W share of I-to-W
    memory. ``leave_out``: storages, as (device, data pointer), not to count (the stage output's gradient,
    torch's receive buffer, which lives for the whole run)."""
    skip = set(leave_out)
    return sum(b for key, b in queued_storages(entries).items() if key not in skip)


@contextlib.contextmanager
def collecting(mode: str = "collect") -> Iterator[None]:
    """Queue the weight gradients of the backwards run inside (a stage's I runs in one), to be applied by
    `apply_queued_weight_grads`. Outside any such block a deferring layer accumulates its weight gradient
    at once, as plain autograd does. ``mode="discard"`` drops them (shape inference)."""
    _MODE.append(mode)
    try:
        yield
    finally:
        _MODE.pop()
        _SHARED.clear()  # the backward's graphs have run: their shared copies live on in the queue only
        _COMPACT.clear()


def _collecting_backward(stage: Any, method: Any) -> Any:
    def backward_maybe_with_nosync(*args: Any, **kwargs: Any) -> Any:
        builder = getattr(stage, "dw_builder", None)
        if isinstance(builder, _Builder) and builder.measure:
            bwd_kwargs = args[1] if len(args) > 1 else kwargs.get("bwd_kwargs", {})
            builder.note_output_grads(bwd_kwargs.get("output_grads"))
        with collecting():
            return method(*args, **kwargs)

    backward_maybe_with_nosync._pp_offload_collecting = True  # type: ignore[attr-defined]
    return backward_maybe_with_nosync


class _Builder:
    """The stage's ``dw_builder``: called right after the stage's I (a full backward), it takes what that
    backward queued and returns the runner torch calls at the microbatch's W.

    ``measure`` (off: it costs a pass over the queue per microbatch; the planner's probe turns it on):
    ``queued`` then records the most bytes one microbatch's queue held, each distinct storage once, the
    stage output's gradient left out (it is torch's receive buffer, allocated for the whole run): what
    `pp_offload.plan.memory.queued_bytes` predicts."""

    def __init__(self, stage: Any) -> None:
        self.stage = stage
        self.measure = False
        self.queued = 0
        self._output_grads: set[tuple[Any, int]] = set()

    def note_output_grads(self, grads: Any) -> None:
        tensors = grads if isinstance(grads, (list, tuple)) else [grads]
        self._output_grads = {
            (t.device, t.untyped_storage().data_ptr()) for t in tensors if isinstance(t, torch.Tensor)
        }

    def __call__(self) -> Any:
        entries = _QUEUE[:]
        _QUEUE.clear()
        if self.measure:
            self.queued = max(self.queued, queued_bytes(entries, leave_out=self._output_grads))
        return WeightPass(self.stage.submod, entries)


class WeightPass:
    """One microbatch's W: the queue its I filled, applied to the stage's parameters when torch calls it.

    Between I and W the activation store may hold the queue in host memory (`offload`, `reload`; the
    offload runtime does it where the plan has copies between the chunk's I and its W,
    `pp_offload.runtime.offload`): the queued tensors are then recorded in a store chunk of their own,
    exactly as autograd's saved tensors are (views counted once, tiny tensors left on the device), and this
    object keeps only the store's handles, so the device memory goes with the copy."""

    def __init__(self, module: nn.Module, entries: list[Any]) -> None:
        self.module = module
        self.entries = entries
        self._stored: tuple[Any, Any] | None = None  # (store, key) while the queue is a store chunk

    def offload(self, store: Any, key: Any) -> None:
        """Copy the queue to host memory under store chunk ``key``; device memory freed when it ends. Again
        after `reload` (before W): the device copy is dropped, the host copy being still exact."""
        if self._stored is None:
            with store.capture(key):
                self.entries = [
                    (weight, save_in_capture(x), save_in_capture(dy), transposed)
                    for weight, x, dy, transposed in self.entries
                ]
            self._stored = (store, key)
        store.offload(key)

    def reload(self) -> None:
        """Copy the queue back to the device (before W)."""
        if self._stored is None:
            raise RuntimeError("a deferred-W queue was reloaded before it was offloaded")
        store, key = self._stored
        store.reload(key)

    @property
    def stored_key(self) -> Any:
        """The store chunk holding the queue, None while it is on the device as I left it."""
        return None if self._stored is None else self._stored[1]

    def __call__(self) -> None:
        entries, self.entries = self.entries, []
        stored, self._stored = self._stored, None
        try:
            if stored is not None:
                entries = [(w, x.get(), dy.get(), t) for w, x, dy, t in entries]
            apply_queued_weight_grads(self.module.parameters(), entries)
        finally:
            if stored is not None:
                stored[0].release(stored[1])


@contextlib.contextmanager
def own_forwards(root: nn.Module) -> Iterator[None]:
    """Run ``root``'s deferring layers with their own forward inside (plain autograd: weight gradients in
    the same backward), e.g. to time a layer's I and W the way torch splits them; restored after."""
    patched = [(m, type(m)) for m in root.modules() if _is_deferring(m)]
    for module, cls in patched:
        module.__class__ = cls._pp_offload_base
    try:
        yield
    finally:
        for module, cls in patched:
            module.__class__ = cls


def _unpatch_layers(root: nn.Module) -> None:
    for module in root.modules():
        if _is_deferring(module):
            module.__class__ = module._pp_offload_base


def all_deferring(stages: Iterable[Any]) -> bool:
    """Whether every one of ``stages`` runs deferred W (I a full backward, W the queued GEMMs)."""
    stages = list(stages)
    return bool(stages) and all(isinstance(getattr(s, "dw_builder", None), _Builder) for s in stages)


def defer_weight_grads(stages: Iterable[Any], enabled: bool = True) -> list[Any]:
    """Make each stage's split backward defer its linear-like weight gradients to W (module doc).

    Installs torch's ``dw_builder`` hook on every stage and routes its trainable linear-like layers
    through the deferring op (a stage without any then computes all its gradients in I and nothing in W,
    so that every stage of a pipeline runs the order as written). A stage module that splits its own
    backward (``_pp_offload_own_split = True``, e.g. `pp_offload.emulate`'s sleeping stages) keeps torch's
    retained-graph split. Idempotent. Returns the stages that defer. Call before the schedule's first
    step. ``enabled=False`` gives the layers their own forward back (a layer left deferring under torch's
    split would give its weight no gradient in W) and removes the hook."""
    deferring = []
    for stage in stages:
        submod = getattr(stage, "submod", None)
        if not isinstance(submod, nn.Module):
            continue  # torch's mock stages (offline order inspection)
        if not enabled:
            _unpatch_layers(submod)
            if isinstance(getattr(stage, "dw_builder", None), _Builder):
                stage.dw_builder = None
            if getattr(stage.backward_maybe_with_nosync, "_pp_offload_collecting", False):
                vars(stage).pop("backward_maybe_with_nosync", None)
            continue
        if getattr(submod, "_pp_offload_own_split", False):
            continue
        _patch_layers(submod)
        if not isinstance(getattr(stage, "dw_builder", None), _Builder):
            stage.dw_builder = _Builder(stage)
        if not getattr(stage.backward_maybe_with_nosync, "_pp_offload_collecting", False):
            stage.backward_maybe_with_nosync = _collecting_backward(stage, stage.backward_maybe_with_nosync)
        compat.wrap_shape_inference_backward(stage, functools.partial(collecting, "discard"))
        deferring.append(stage)
    return deferring


# --- refusing what would run a compiled backward twice ---------------------------------------------------


def compiled_modules(root: nn.Module) -> list[str]:
    """Qualified names of the modules under ``root`` that are compiled: ``torch.compile(module)`` wrappers
    and modules compiled in place with ``module.compile()``."""
    found = []
    for name, module in root.named_modules():
        if compat.is_compiled_module(module):
            found.append(name or type(module).__name__)
    return found


def refuse_compiled_split(stages: Iterable[Any], schedule_name: str) -> None:
    """Stop before the first step when a stage that keeps torch's retained-graph split (no deferred W) holds
    a compiled module: its backward would run in both I and W, which gives wrong gradients or a crash."""
    for stage in stages:
        submod = getattr(stage, "submod", None)
        if not isinstance(submod, nn.Module) or isinstance(getattr(stage, "dw_builder", None), _Builder):
            continue
        names = compiled_modules(submod)
        if names:
            raise ValueError(
                f"{schedule_name}: stage {getattr(stage, 'stage_index', '?')} holds compiled module "
                f"{names[0]!r} but splits its backward with torch's retained graph, which runs a compiled "
                "backward twice (wrong gradients); keep deferred_w=True (the default) and give the stage a "
                "trainable nn.Linear, or use a schedule without split backward (ScheduleInterleaved1F1B)"
            )
