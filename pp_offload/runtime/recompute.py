"""Selective recompute: keep the outputs of matmuls and attention kernels, recompute everything else.

A checkpointed layer (``torch.utils.checkpoint``, non-reentrant) saves only its inputs and recomputes its
whole forward in backward. Selective recompute keeps what is expensive to recompute and cheap to keep (the
outputs of the ops in `SAVED_OPS`: projections, MLP matmuls, the attention kernel) and recomputes what is
cheap to recompute and costly to keep (norms and their fp32 copies, rotary embeddings, activation
functions, elementwise products, dropout masks). For an HF Llama layer in bf16 that halves the bytes an
offload moves per layer (43.6 -> 20.1 bytes per token per hidden unit; GPT-2 56.1 -> 20.1:
bench/bench_recompute.py).

`selective_checkpoint_context` is a ``context_fn`` for ``torch.utils.checkpoint.checkpoint``: a forward
dispatch mode that caches the outputs of the saved ops, and a recompute mode that hands them back instead
of running those ops again. It is written for pipelines, where torch's own
``create_selective_checkpoint_contexts`` falls short twice:

- Split backward (zero-bubble schedules run I, then W, as two autograd calls) recomputes a layer once per
  pass. torch marks each cached output consumed after its first use, so the W pass fails ("Trying to
  backward an extra time"). Here the cache keeps its entries for every recomputation; they are freed with
  the checkpoint's autograd graph (after W, or after a full backward B).
- Offload: torch's cache holds the outputs outside autograd's saved tensors, where the activation store
  cannot see them, so they would stay on the device while the store moves the rest. Here, when the
  layer's forward ends, each kept output goes to the chunk being captured
  (`pp_offload.runtime.store.save_in_capture`): it moves to host memory at OFFLOAD and comes back at
  RELOAD with the chunk, counted in the store's stats. Outside a capture the cache holds the tensors.

A layer's trailing matmul (only ops whose backward saves nothing after it, `NON_SAVING_OPS`) is not kept:
checkpointing stops a recomputation once every tensor backward needs is back, before reaching it. An op
that saves its inputs after computing its output (an autograd.Function, like deferred W's linear,
`pp_offload.runtime.deferred_w`) is reached all the same; the recomputation then gets zeros of its
output's shape instead of running it: nothing after it saves a tensor, so its values reach no gradient.

Recomputation is matched to the forward by the order of the saved ops' calls (the n-th ``mm`` of the
recompute takes the n-th ``mm`` output of the forward); other ops are not counted, so the extra
``detach`` calls that checkpointing inserts change nothing. A cached output changed in place after the
forward is an error, never a silently wrong gradient (checked at each use, and by the store). Outputs
are returned to autograd as fresh detached tensors on each recomputation, so the I and W recomputations
build independent graphs.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.utils.checkpoint
from torch.utils._pytree import tree_flatten, tree_map

from pp_offload.runtime import compat, deferred_w  # noqa: F401  (deferred_w registers its op)
from pp_offload.runtime.store import SavedInCapture, save_in_capture

__all__ = [
    "NON_SAVING_OPS",
    "SAVED_OPS",
    "compiled_selective_policy",
    "saved_op_packets",
    "selective_checkpoint_context",
    "selective_context",
]

SAVED_OPS: tuple[str, ...] = (
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "linear",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_attention_math",
    "_flash_attention_forward",
    "_efficient_attention_forward",
    "linear_dw_queued",
)
"""aten ops whose outputs selective recompute keeps (any overload), and ``linear_dw_queued``, the linear of
deferred weight gradients (`pp_offload.runtime.deferred_w`; a dispatch mode sees it as one op). Matmuls
cost O(n^3) to recompute for O(n^2) bytes; the attention kernels more. Ops a torch build lacks are skipped.
Composite ops (``linear``, ``matmul``) reach a dispatch mode already decomposed into
``mm``/``addmm``/``bmm``; eager attention (``attn_implementation="eager"``) computes its scores with
``matmul``, so they are kept too (seq x seq per head: prefer ``sdpa``, whose kernel keeps only its
output and log-sum-exp)."""


_OUTPUT_SAVING = frozenset(n for n in SAVED_OPS if "attention" in n)
"""Saved ops whose own backward needs their outputs: the recomputation always reaches them."""

NON_SAVING_OPS: tuple[str, ...] = (
    "add",
    "sub",
    "neg",
    "view",
    "_unsafe_view",
    "reshape",
    "_reshape_alias",
    "expand",
    "transpose",
    "permute",
    "t",
    "slice",
    "select",
    "split",
    "split_with_sizes",
    "unsqueeze",
    "squeeze",
    "alias",
    "detach",
    "as_strided",
    "_to_copy",
    "clone",
    "copy_",
)
"""aten ops whose backward saves no tensor. Why it matters: checkpointing stops a recomputation as soon as
every tensor the backward needs is back, so a matmul followed, up to the end of the layer, only by these
ops (Llama's down projection, GPT-2's MLP output projection: only the residual sum follows) is never
reached by the recomputation, and keeping its output would only add bytes to move. Such trailing matmul
outputs are not kept. An op missing from this list only makes the cache keep more; a kept output the
recomputation never reads costs bytes, and one it does read but was not kept is recomputed (the op runs
again), so the list affects bytes and time, never results."""


@functools.cache
def saved_op_packets(names: tuple[str, ...] = SAVED_OPS) -> frozenset[Any]:
    """The op packets of ``names`` this torch has (``torch.ops.aten``, then pp_offload's own ops)."""
    namespaces = (torch.ops.aten, torch.ops.pp_offload)
    return frozenset(getattr(ns, n) for n in names for ns in namespaces if hasattr(ns, n))


class _Plain:
    """A cached output outside any capture: the tensor, and its version to check at each use."""

    __slots__ = ("tensor", "version")

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor = t
        self.version = t._version

    def get(self) -> torch.Tensor:
        if self.tensor._version != self.version:
            raise RuntimeError(
                "a tensor cached by selective recompute was modified in place after its forward (version "
                f"{self.version}, now {self.tensor._version}); use the out-of-place op in the checkpointed "
                "layer"
            )
        return self.tensor


def _detached(x: Any) -> Any:
    """A fresh tensor for autograd to own (no reference to the forward's graph, none shared between the
    I and W recomputations). Only differentiable dtypes: an integer output (an attention kernel's RNG
    seed and offset) never gets autograd history, and a detached view of one would carry view metadata
    that a dispatch mode must not return (torch's own selective checkpointing does the same)."""
    if isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex()):
        return x.detach()
    return x


_RUN = object()
"""A cache entry the recomputation re-runs instead of reading (a trailing op whose output is not a tensor)."""


class _Trailing:
    """The cache entry of a trailing matmul (see NON_SAVING_OPS): its output's layout. A recomputation that
    reaches it gets zeros: only ops that save nothing follow it, so no gradient reads its values (measured:
    deferred W's linear reaches it, and the down projection ran again in every recomputation of a Llama
    layer, a quarter of the layer's matmul time)."""

    __slots__ = ("device", "dtype", "shape", "stride")

    def __init__(self, out: torch.Tensor) -> None:
        self.shape, self.stride, self.dtype, self.device = out.shape, out.stride(), out.dtype, out.device

    def zeros(self) -> torch.Tensor:
        return torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device).zero_()


_PASS, _OTHER, _KEEP, _KEEP_READ = range(4)
"""What an op is to the cache (`_OpKinds`): an op whose backward saves nothing (`NON_SAVING_OPS`), any
other op, a saved op, a saved op whose own backward reads its output (an attention kernel)."""


class _OpKinds(dict[Any, int]):
    """What each op is to the cache, found once per op overload (on first sight, ``__missing__``), then a
    plain dict lookup. Why: the modes see every aten op of a checkpointed layer's forward and
    recomputation; finding the op's packet (a Python property) and hashing it (a Python ``__hash__``)
    twice on every call was a measurable part of their per-op cost."""

    def __init__(self, saved: frozenset[Any], non_saving: frozenset[Any]) -> None:
        super().__init__()
        self.saved = saved
        self.non_saving = non_saving

    def __missing__(self, func: Any) -> int:
        packet = getattr(func, "overloadpacket", None)
        if packet in self.non_saving:
            kind = _PASS
        elif packet not in self.saved:
            kind = _OTHER
        else:
            kind = _KEEP_READ if packet.__name__ in _OUTPUT_SAVING else _KEEP
        self[func] = kind
        return kind


class _Cache:
    """The saved ops' outputs of one checkpointed call, in call order per op.

    During the forward the outputs are held here (``pending``); when the forward ends, the ones the
    recomputation will read go to the capture running on this thread (the store) or stay here, and the
    trailing matmul is dropped."""

    def __init__(self, kinds: _OpKinds) -> None:
        self.saved = kinds.saved
        self.non_saving = kinds.non_saving
        self.kinds = kinds
        self.entries: dict[Any, list[Any]] = defaultdict(list)
        self.replayed: dict[Any, int] = defaultdict(int)
        # forward: (func, its outputs, their versions) per saved op
        self.pending: list[list[Any]] = []
        # the pending entry after which only ops that save nothing ran, if any. At most one: every saved
        # op may save a tensor, so it ends the trailing run of the one before it
        self.trailing: int | None = None

    def record(self, func: Any, out: Any) -> None:
        """Forward: one op ran. A saved op's outputs are held; any op that may save a tensor for backward
        (a matmul saves its inputs) means every pending matmul output before it will be read."""
        kind = self.kinds[func]
        if kind == _PASS:
            return
        self.trailing = None
        if kind == _OTHER:
            return
        with compat.views_share_version():
            if isinstance(out, torch.Tensor):  # most saved ops: one tensor, no pytree walk
                held = _detached(out)
                versions = [held._version]
            else:
                held = tree_map(_detached, out)
                versions = [x._version for x in tree_flatten(held)[0] if isinstance(x, torch.Tensor)]
        self.pending.append([func, held, versions])
        if kind == _KEEP:
            self.trailing = len(self.pending) - 1

    def finish(self) -> None:
        """Forward ended: keep what the recomputation will read (in the store when a capture runs)."""
        for i, (func, held, versions) in enumerate(self.pending):
            if i == self.trailing:
                self.entries[func].append(_Trailing(held) if isinstance(held, torch.Tensor) else _RUN)
                continue
            one = isinstance(held, torch.Tensor)
            tensors = [held] if one else [x for x in tree_flatten(held)[0] if isinstance(x, torch.Tensor)]
            if [x._version for x in tensors] != versions:
                raise RuntimeError(
                    f"selective recompute: the output of {func} was modified in place later in the same "
                    "checkpointed layer; its recomputation would read the modified values. Use the "
                    "out-of-place op, or full checkpointing for this layer"
                )
            with compat.views_share_version():
                self.entries[func].append(_hold(held) if one else tree_map(_hold, held))
        self.pending = []
        self.trailing = None

    def take(self, func: Any, args: Any, kwargs: Any) -> Any:
        n = self.replayed[func]
        outputs = self.entries.get(func, [])
        if n >= len(outputs):
            raise RuntimeError(
                f"selective recompute: the recomputation called {func} {n + 1} times, its forward "
                f"{len(outputs)}; the checkpointed layer must run the same ops in backward as in forward "
                "(no data-dependent control flow or changed global state)"
            )
        self.replayed[func] = n + 1
        entry = outputs[n]
        if entry is _RUN:
            return func(*args, **kwargs)
        if isinstance(entry, _Trailing):
            return entry.zeros()
        with compat.views_share_version():
            if isinstance(entry, (_Plain, SavedInCapture)):  # one tensor: no pytree walk
                return _detached(entry.get())
            return tree_map(_give, entry)


def _hold(x: Any) -> Any:
    """A kept output as the cache holds it: recorded in the running capture, or plain."""
    if not isinstance(x, torch.Tensor):
        return x
    saved = save_in_capture(x)
    return saved if saved is not None else _Plain(x)


def _give(x: Any) -> Any:
    """A kept output as the recomputation gets it (`_hold` undone), detached afresh."""
    return _detached(x.get()) if isinstance(x, (_Plain, SavedInCapture)) else x


class _CacheOutputs(compat.TorchDispatchMode):
    """Forward: run every op, hold the saved ops' outputs; hand them over when the forward ends."""

    def __init__(self, cache: _Cache) -> None:
        super().__init__()
        self._cache = cache
        self._kinds = cache.kinds

    def __exit__(self, *exc: Any) -> Any:
        result = super().__exit__(*exc)
        if exc[0] is None:
            self._cache.finish()
        return result

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **kwargs) if kwargs else func(*args)
        if self._kinds[func] != _PASS:  # most ops are views and adds: nothing to record
            self._cache.record(func, out)
        return out


class _ReplayOutputs(compat.TorchDispatchMode):
    """Recomputation: the saved ops return their cached outputs, every other op runs. Entered once per
    recomputation (I and W each recompute), so it rewinds the cache on entry."""

    def __init__(self, cache: _Cache) -> None:
        super().__init__()
        self._cache = cache
        self._kinds = cache.kinds

    def __enter__(self) -> Any:
        self._cache.replayed.clear()
        return super().__enter__()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self._kinds[func] >= _KEEP:
            return self._cache.take(func, args, kwargs or {})
        return func(*args, **kwargs) if kwargs else func(*args)


def selective_checkpoint_context(
    saved_ops: Iterable[str] = SAVED_OPS,
) -> Callable[[], tuple[_CacheOutputs, _ReplayOutputs]]:
    """A ``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: keep the
    outputs of ``saved_ops`` (aten op names, default `SAVED_OPS`), recompute the rest.

    Each call of the returned function makes the two modes of one checkpointed call, sharing one cache.
    """
    names = tuple(saved_ops)
    unknown = [n for n in names if not isinstance(n, str)]
    if unknown or not names:
        raise ValueError(f"saved_ops must be a non-empty list of aten op names like 'mm', got {names!r}")
    saved = saved_op_packets(names)
    if not saved:
        raise ValueError(f"none of saved_ops={names!r} is an aten op of this torch; see SAVED_OPS")
    non_saving = saved_op_packets(NON_SAVING_OPS)
    both = sorted(p.__name__ for p in saved & non_saving)
    if both:
        raise ValueError(
            f"saved_ops={names!r} names ops whose backward saves nothing ({both}, see NON_SAVING_OPS): the "
            "cache never keeps their outputs; leave them out"
        )
    kinds = _OpKinds(saved, non_saving)

    def context_fn() -> tuple[_CacheOutputs, _ReplayOutputs]:
        cache = _Cache(kinds)
        return _CacheOutputs(cache), _ReplayOutputs(cache)

    return context_fn


def compiled_selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """torch's selective-checkpoint policy for the same choice under ``torch.compile``: the outputs of
    `SAVED_OPS` must be saved, every other op is recomputed.

    Under compile the dispatch modes above cannot run (dynamo does not trace a ``context_fn`` it does not
    know); torch's own ``create_selective_checkpoint_contexts`` is the one it does. AOT autograd then tags
    each node of the layer's graph with this policy and its partitioner saves the tagged outputs the
    backward graph reads and recomputes the rest inside the compiled backward. What the partitioner never
    saves is an output the backward does not read, the trailing matmul `NON_SAVING_OPS` describes: the
    same choice as the eager cache, made by the graph (measured equal in tests/test_compile.py). The
    compiled function saves its tensors as autograd saved tensors, so the activation store sees them."""
    from torch.utils.checkpoint import CheckpointPolicy

    if getattr(op, "overloadpacket", None) in saved_op_packets():
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


_EAGER_CONTEXT = selective_checkpoint_context()
_COMPILED_CONTEXT = functools.partial(
    torch.utils.checkpoint.create_selective_checkpoint_contexts, compiled_selective_policy
)


def selective_context() -> Callable[[], Any]:
    """The ``context_fn`` of selective recompute: `selective_checkpoint_context`'s modes in eager, torch's
    selective-checkpoint contexts with `compiled_selective_policy` while dynamo traces (a compiled layer).

    Why two: in eager, torch's contexts hold the kept outputs outside autograd's saved tensors (the
    activation store could not move them under offload), keep the trailing matmul's output the
    recomputation never reads, and refuse a second recomputation (torch's retained-graph split, ``+once``
    off); under compile the partitioner turns the same policy into saved graph outputs, which the store
    sees, and the compiled backward recomputes once per backward."""
    if torch.compiler.is_compiling():
        return _COMPILED_CONTEXT
    return _EAGER_CONTEXT
