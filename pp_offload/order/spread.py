"""Spread independent pieces of the order search over the ranks that all need its result.

Why: every pipeline rank builds the same order at start-up, and the search (`pp_offload.order.vshape`)
spends its time on many independent tasks (scoring a candidate, compacting a shortlisted one). When the
ranks of a process group search together, each runs its share of a batch of tasks, all results are
exchanged in one all-gather, and every rank continues with the whole batch's results, exactly as if it
had computed them itself. So the order is the serial search's, on every rank, for a fraction of the work.

This module stays free of torch: the exchange is whatever object implements `Gather` (the runtime's
`pp_offload.runtime.search_group.GroupGather` wraps a torch process group). Without one, tasks run in
this process, in order.

Who runs what is decided from the batch alone (task weights, then index), so every rank agrees without
talking. A task that raises on one rank is re-raised on every rank after the exchange, so no rank is left
waiting for a peer that gave up.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from pp_offload.order.actions import Action, Order

T = TypeVar("T")
R = TypeVar("R")


class Gather(Protocol):
    """What the search needs of a group of ranks: who this rank is, and an all-gather of objects."""

    rank: int
    size: int

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order; called by all ranks of the group together."""
        ...


class SpreadTaskError(RuntimeError):
    """A task of a spread batch raised on some rank; raised on every rank so none waits for the others."""


def assign(weights: Sequence[float], size: int, first: int = 0) -> list[int]:
    """The rank that runs each task: heaviest first, each to the least loaded rank (on ties, the first
    from rank ``first`` on, so that batches of few tasks do not all land on the lowest ranks).

    Deterministic in its arguments only, so every rank computes the same assignment.
    """
    owner = [0] * len(weights)
    load = [0.0] * size
    for i in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        r = min(range(size), key=lambda r: (load[r], (r - first) % size))
        owner[i] = r
        load[r] += weights[i]
    return owner


def spread_map(
    gather: Gather | None,
    fn: Callable[[T], R],
    items: Sequence[T],
    weights: Sequence[float] | None = None,
    first: int = 0,
) -> list[R]:
    """``[fn(x) for x in items]``, each ``fn(x)`` computed on one rank of ``gather`` and shared with all.

    ``fn`` must be deterministic and its result picklable; ``weights`` (relative costs, default equal)
    and ``first`` (see `assign`) only balance the ranks' shares. All ranks must call this with the same
    arguments.
    """
    if gather is None or gather.size <= 1 or not items:
        return [fn(x) for x in items]
    owner = assign([1.0] * len(items) if weights is None else list(weights), gather.size, first)
    mine: dict[int, tuple[bool, Any]] = {}
    for i, x in enumerate(items):
        if owner[i] != gather.rank:
            continue
        try:
            mine[i] = (True, fn(x))
        except Exception as e:  # reported to every rank below, so none is left waiting
            mine[i] = (False, f"{type(e).__name__}: {e}")
    merged: dict[int, tuple[bool, Any]] = {}
    for part in gather.all_gather(mine):
        merged.update(part)
    failed = [(i, merged[i][1]) for i in sorted(merged) if not merged[i][0]]
    if failed:
        i, message = failed[0]
        raise SpreadTaskError(f"search task {i} failed on rank {owner[i]}: {message}")
    return [merged[i][1] for i in range(len(items))]


_KINDS = ("F", "I", "W", "B")
_CODE = {kind: code for code, kind in enumerate(_KINDS)}
_MB_BITS = 24  # a pass is one integer: stage, kind (2 bits) and microbatch (24 bits)
_INTERNED: dict[int, Action] = {}  # one Action per code, shared by every unpacked order
_INTERNED_MAX = 1 << 20


class PackedOrder:
    """An order as one byte string per rank, unpacked on first use.

    Why: what the ranks send each other is mostly orders, and most of them are never looked at again by
    the ranks that receive them (only the winner of a cap, or a candidate compacted again). Pickled as
    they are, orders cost more to unpack (one object per pass) than the search spends on them; packed,
    a rank unpacks only the ones it uses, sharing one `Action` per (stage, kind, microbatch).
    """

    __slots__ = ("ranks", "rows")

    def __init__(self, order: Order) -> None:
        self.ranks = tuple(order)
        self.rows = tuple(
            array(
                "q", [(a[0] << (_MB_BITS + 2)) | (_CODE[a[1]] << _MB_BITS) | a[2] for a in order[r]]
            ).tobytes()
            for r in self.ranks
        )

    def __getstate__(self) -> tuple:
        return self.ranks, self.rows

    def __setstate__(self, state: tuple) -> None:
        self.ranks, self.rows = state

    def unpack(self) -> Order:
        if len(_INTERNED) > _INTERNED_MAX:
            _INTERNED.clear()
        out: Order = {}
        for rank, row in zip(self.ranks, self.rows, strict=True):
            codes = array("q")
            codes.frombytes(row)
            actions = []
            for code in codes:
                action = _INTERNED.get(code)
                if action is None:
                    mask = (1 << _MB_BITS) - 1
                    kind = _KINDS[(code >> _MB_BITS) & 3]
                    action = _INTERNED[code] = Action(code >> (_MB_BITS + 2), kind, code & mask)
                actions.append(action)
            out[rank] = actions
        return out
