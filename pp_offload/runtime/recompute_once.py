"""Checkpointing that recomputes a layer once per microbatch under split backward, keeping what the
input-gradient pass (I) recomputed for the weight-gradient pass (W).

Why: zero-bubble schedules run a stage's backward as two autograd calls, I then W, often far apart.
``torch.utils.checkpoint`` (non-reentrant) recomputes a checkpointed layer in each of them: the layer runs
three times per microbatch (F, I, W). Its recomputed tensors are released as soon as each is unpacked,
and W cannot reuse I's: two backward calls that unpack the same saved tensor are refused inside one
``GraphExecGroup``. `checkpoint_once` recomputes at the first unpack, in I, and keeps every recomputed
tensor until the backward node that saved it is released (W runs it without ``retain_graph``) or the
graph is: two runs per microbatch (F, I), at the price of holding the layer's activations on the device
from I to W, as a layer without recompute does. A plan chooses it per run with ``+once``
(`pp_offload.recompute_plan`); the planner charges I one recomputation and W none, and counts the layer's
full bytes from I to W.

What it keeps from ``torch.utils.checkpoint``'s contract: the layer's inputs are saved as autograd saved
tensors (so the activation store sees, offloads and reloads them like any activation), the recomputation
runs under the forward's RNG state and autocast settings, ``context_fn`` gives the forward and the
recomputation a context each (selective recompute's dispatch modes, `pp_offload.runtime.recompute`),
the recomputation stops once every saved tensor is back (a trailing op that saves nothing is not re-run),
and a recomputation that saves other tensors than the forward did is an error, never a wrong gradient.
It uses only public torch API (``saved_tensors_hooks``, ``autograd.Function``, ``fork_rng``).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import get_device_states, set_device_states

__all__ = ["RecomputeMismatchError", "checkpoint_once"]


class RecomputeMismatchError(RuntimeError):
    """The recomputation saved other tensors than the forward did (a layer whose ops depend on data or
    global state): its gradients would be wrong, so backward stops."""


class _StopRecomputation(Exception):
    """Raised from the recomputation's pack hook once every tensor backward needs is back."""


class _SaveInputs(torch.autograd.Function):
    """Saves the layer's tensor inputs as autograd saved tensors, under whatever saved-tensor hooks are
    active outside the checkpoint (the activation store's), and returns an empty tensor nobody uses."""

    @staticmethod
    def forward(ctx: Any, dummy: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*tensors)
        return dummy.new_empty(0)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:  # pragma: no cover - its output is never used
        raise RuntimeError("checkpoint_once: the input saver is not part of any backward graph")


class _Holder:
    """What the forward saves in place of a tensor: its index in the forward's order of saves."""

    __slots__ = ("__weakref__", "index")

    def __init__(self, index: int) -> None:
        self.index = index


def _forget(frame_ref: weakref.ReferenceType, index: int) -> Callable[[Any], None]:
    """A weakref callback that forgets one recomputed tensor; it holds the frame weakly, so that a frame
    is never kept alive by its own holders' callbacks."""

    def callback(_: Any) -> None:
        frame = frame_ref()
        if frame is not None and frame.recomputed is not None:
            frame.recomputed.pop(index, None)

    return callback


class _Frame:
    """One checkpointed call: how to recompute it, and what the recomputation produced."""

    def __init__(self, fn: Callable[..., Any], args: tuple, kwargs: dict, recompute_context: Any) -> None:
        self.fn = fn
        self.kwargs = kwargs
        self.recompute_context = recompute_context
        self.layout = [isinstance(a, torch.Tensor) for a in args]
        self.plain = [None if is_tensor else a for a, is_tensor in zip(args, self.layout, strict=True)]
        self.needs_grad = [a.requires_grad for a in args if isinstance(a, torch.Tensor)]
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        dummy = torch.empty(0, requires_grad=True)
        self.saver = _SaveInputs.apply(dummy, *tensors)
        self.cpu_rng = torch.get_rng_state()
        self.device_type = next((t.device.type for t in tensors if t.device.type != "cpu"), "cpu")
        self.devices, self.device_rng = ([], [])
        if self.device_type != "cpu":
            self.devices, self.device_rng = get_device_states(*tensors)
        self.autocast = {
            dt: (torch.is_autocast_enabled(dt), torch.get_autocast_dtype(dt))
            for dt in {"cpu", self.device_type}
            if torch.amp.is_autocast_available(dt)
        }
        self.autocast_cache = torch.is_autocast_cache_enabled()
        self.holders: list[weakref.ReferenceType] = []
        self.shapes: list[tuple[torch.Size, torch.dtype]] = []
        self.recomputed: dict[int, torch.Tensor] | None = None
        self.weak_self = weakref.ref(self)

    # forward ---------------------------------------------------------------------------------------
    def pack(self, tensor: torch.Tensor) -> _Holder:
        holder = _Holder(len(self.holders))
        # when autograd releases the saved tensor (its node ran without retain_graph, or the graph went),
        # the recomputed copy goes too
        self.holders.append(weakref.ref(holder, _forget(self.weak_self, holder.index)))
        self.shapes.append((tensor.shape, tensor.dtype))
        return holder

    def unpack(self, holder: _Holder) -> torch.Tensor:
        if self.recomputed is None:
            self.recompute()
        assert self.recomputed is not None
        return self.recomputed[holder.index]

    # backward --------------------------------------------------------------------------------------
    def _inputs(self) -> list[Any]:
        saved = iter(self.saver.grad_fn.saved_tensors)
        needs_grad = iter(self.needs_grad)
        args = []
        for is_tensor, plain in zip(self.layout, self.plain, strict=True):
            if is_tensor:
                args.append(next(saved).detach().requires_grad_(next(needs_grad)))
            else:
                args.append(plain)
        return args

    def recompute(self) -> None:
        wanted = {h.index for ref in self.holders if (h := ref()) is not None}
        last = len(self.holders)
        shapes = self.shapes
        recomputed: dict[int, torch.Tensor] = {}
        count = 0

        # The hook does not reach the frame: autograd keeps it with whatever the recomputation saved, and
        # a tensor of the recomputation may outlive it in an argument the frame holds (a KV cache gets
        # the recomputed keys and values appended): a cycle through C++ that no collector breaks.
        def pack(x: torch.Tensor) -> torch.Tensor:
            nonlocal count
            index = count
            count += 1
            if index >= last:
                raise RecomputeMismatchError(
                    f"checkpoint_once: the recomputation saved more tensors than the forward ({last}); the "
                    "checkpointed layer must run the same ops in backward as in forward"
                )
            if (x.shape, x.dtype) != shapes[index]:
                raise RecomputeMismatchError(
                    f"checkpoint_once: saved tensor {index} of the recomputation is {tuple(x.shape)} "
                    f"{x.dtype}, the forward's {tuple(shapes[index][0])} {shapes[index][1]}; the "
                    "checkpointed layer must run the same ops in backward as in forward"
                )
            # detached: the recomputation's own graph must not hold a tensor whose grad_fn holds this hook
            # (an op that saves its output would make a cycle through C++ that no garbage collector
            # breaks, keeping this frame and every tensor it recomputed alive)
            kept = x.detach() if x.requires_grad else x
            if index in wanted:
                recomputed[index] = kept
            if count == last:
                raise _StopRecomputation
            return kept

        args = self._inputs()
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(devices=self.devices, device_type=self.device_type))
            torch.set_rng_state(self.cpu_rng)
            if self.devices:
                set_device_states(self.devices, self.device_rng, device_type=self.device_type)
            for dt, (enabled, dtype) in self.autocast.items():
                stack.enter_context(
                    torch.autocast(dt, enabled=enabled, dtype=dtype, cache_enabled=self.autocast_cache)
                )
            stack.enter_context(torch.enable_grad())
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, _identity))
            stack.enter_context(self.recompute_context)
            try:
                self.fn(*args, **self.kwargs)
            except _StopRecomputation:
                pass
        if count != last:
            raise RecomputeMismatchError(
                f"checkpoint_once: the recomputation saved {count} tensors, the forward {last}; the "
                "checkpointed layer must run the same ops in backward as in forward"
            )
        self.recomputed = recomputed


def _identity(x: Any) -> Any:
    return x


def checkpoint_once(
    fn: Callable[..., Any],
    *args: Any,
    context_fn: Callable[[], tuple[Any, Any]] | None = None,
    **kwargs: Any,
) -> Any:
    """``fn(*args, **kwargs)``, saving only its inputs; its saved tensors are recomputed once, at the
    first backward call that needs one, and kept for later calls (module doc). ``context_fn``: as
    ``torch.utils.checkpoint.checkpoint``'s, two contexts for the forward and the recomputation.

    Without grad mode it just calls ``fn``, as ``torch.utils.checkpoint`` does."""
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    forward_context, recompute_context = context_fn() if context_fn is not None else (None, None)
    frame = _Frame(fn, args, kwargs, recompute_context or contextlib.nullcontext())
    with torch.autograd.graph.saved_tensors_hooks(frame.pack, frame.unpack):
        with forward_context or contextlib.nullcontext():
            return fn(*args, **kwargs)
