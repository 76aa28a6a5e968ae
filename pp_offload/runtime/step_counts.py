"""Counting what a training step does: host-synchronizing ops, and runs of checkpointed layers.

Why: the hot path's costs are invisible in a CPU timing but not in what a step runs. A CPU run cannot feel a
host synchronization, but it can see the op that would cause one on a device:
`SyncCounter` is a dispatch mode that counts the aten ops which read a tensor's value on the host (or whose
output size depends on values, so the host must wait for them). `count_layer_runs` wraps the inner forward of
every checkpointed module (`pp_offload.parallel.activation_checkpointing`), so each forward and each
recomputation of it is counted.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Iterable
from typing import Any

import torch

from pp_offload.runtime.compat import TorchDispatchMode

__all__ = ["SYNCING_OPS", "SyncCounter", "count_layer_runs"]

SYNCING_OPS = frozenset(
    {
        "_local_scalar_dense",  # .item(), int(t), float(t), bool(t)
        "is_nonzero",  # if t:
        "item",
        "equal",  # torch.equal
        "nonzero",  # t.nonzero(), boolean indexing
        "masked_select",
        "_unique2",
        "unique_consecutive",
        "_assert_async",
    }
)


class SyncCounter(TorchDispatchMode):
    """Counts host-synchronizing aten ops (`SYNCING_OPS`) run while active, by op name::

    with SyncCounter() as syncs:
        schedule.step(...)
    assert syncs.total == 0, syncs.counts
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if name in SYNCING_OPS:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def count_layer_runs(modules: Iterable[torch.nn.Module]) -> Counter[str]:
    """Wrap every checkpointed forward under ``modules``; the returned counter grows by one, keyed by the
    module's qualified name, at each forward and each recomputation of it."""
    from pp_offload.parallel.fsdp import _WRAPPERS

    runs: Counter[str] = Counter()
    for root in modules:
        for name, module in root.named_modules():
            forward = vars(module).get("forward")
            if not (isinstance(forward, functools.partial) and forward.func in _WRAPPERS.values()):
                continue
            inner = forward.args[0]

            def counted(*args: Any, _inner: Any = inner, _name: str = name, **kwargs: Any) -> Any:
                runs[_name] += 1
                return _inner(*args, **kwargs)

            module.forward = functools.partial(forward.func, counted)
    return runs
