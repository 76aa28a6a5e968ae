"""Greedy V orders under a memory cap, driven by costs (the zero-bubble way of building V-ZB).

A discrete-event simulation: the rank with the earliest free time decides what to run next from the
passes that are ready then. Processing ranks in time order makes every decision exact: any pass that
could have become ready by then has already been placed. The policy, in priority order:

0. with ``eager_w``, a W right after its I (a strict F-I-W rhythm that skewed costs cannot disturb);
1. an input-gradient pass (I), which other ranks wait on; with ``alternate``, a forward goes first
   when the rank's last pass was a backward (the 1F1B rhythm that keeps the V fed);
2. a forward, if the rank stays within its memory cap (keeping ``reserve`` chunk units free for chunk-1
   forwards, which lead to the loss, so chunk-0 forwards cannot fill memory and stall the V);
3. a weight-gradient pass (W), which only frees memory and fills what would be a bubble; with
   ``wait_for_input_grad`` it is skipped when an I will be ready before the W could end;
4. else wait for the next pass to become ready.

`pp_offload.order.vshape` tries the policy variants; the simulator picks the best.
"""

from __future__ import annotations

from dataclasses import dataclass

from pp_offload.order.actions import Action, Costs, F, I, Order, W, v_rank_of_stage, v_stages
from pp_offload.sim import dependency

_EPS = 1e-9


@dataclass(frozen=True)
class GreedyPolicy:
    reserve: int = 1
    wait_for_input_grad: bool = False
    chunk1_first: bool = True
    eager_w: bool = False
    alternate: bool = False


def greedy_v_order(
    num_ranks: int, num_microbatches: int, *, costs: Costs, memory_cap: float, policy: GreedyPolicy
) -> Order | None:
    """A V order built greedily under ``memory_cap`` chunk units per rank, or None if it stalls."""
    return _Greedy(num_ranks, num_microbatches, costs, memory_cap, policy).run()


class _Greedy:
    """The simulation's state. Hot loop of the search (one run per policy and cap): ready times are read
    from per-(stage, kind) arrays and each pass's dependency is looked up in a table built once."""

    def __init__(self, d: int, m: int, costs: Costs, cap: float, policy: GreedyPolicy) -> None:
        self.d, self.m, self.costs, self.cap, self.policy = d, m, costs, cap, policy
        self.stages = [v_stages(r, d) for r in range(d)]
        self.next_f = [[0, 0] for _ in range(d)]  # next microbatch to forward, per chunk
        self.next_i = [[0, 0] for _ in range(d)]
        self.pending_w: list[list[tuple[int, int]]] = [[] for _ in range(d)]  # (chunk, mb), I order
        self.clock = [0.0] * d
        self.live = [0] * d
        self.last_kind: list[str | None] = [None] * d
        self.order: Order = {r: [] for r in range(d)}
        self.chunk_order = (1, 0) if policy.chunk1_first else (0, 1)
        # end[stage][kind] -> finish time per microbatch (None: not run yet)
        self.end = {(s, k): [None] * m for s in range(2 * d) for k in (F, I, W)}
        # (rank, chunk, kind) -> (the end array of the pass it waits on, latency added) or None
        self.deps = {}
        for r in range(d):
            for chunk in (0, 1):
                for kind in (F, I, W):
                    dep = dependency(self.stages[r][chunk], kind, 0, 2 * d)
                    if dep is None:
                        self.deps[(r, chunk, kind)] = None
                    else:
                        latency = costs.comm if v_rank_of_stage(dep[0], d) != r else 0.0
                        self.deps[(r, chunk, kind)] = (self.end[(dep[0], dep[1])], latency)
        self.duration = {F: costs.F, I: costs.I, W: costs.W}

    def run(self) -> Order | None:
        remaining = 6 * self.d * self.m
        unfinished = set(range(self.d))
        waiting: set[int] = set()  # ranks with nothing to do until another rank places a pass
        clock = self.clock
        while remaining:
            rank, first = None, 0.0  # the earliest free rank, the lowest on ties
            for r in unfinished:
                if r in waiting:
                    continue
                t = clock[r]
                if rank is None or t < first or (t == first and r < rank):
                    rank, first = r, t
            if rank is None:
                return None  # stalled: the memory cap is too tight for this policy
            choice, next_ready = self._decide(rank)
            if choice is None:
                now = clock[rank]
                later = None
                for r in unfinished:
                    if r not in waiting and clock[r] > now + _EPS and (later is None or clock[r] < later):
                        later = clock[r]
                known = [t for t in (next_ready, later) if t is not None]
                if known:
                    clock[rank] = min(known)
                else:
                    waiting.add(rank)
                continue
            waiting.clear()
            self._place(rank, *choice)
            remaining -= 1
            if len(self.order[rank]) == 6 * self.m:
                unfinished.discard(rank)
        return self.order

    def _ready_at(self, rank: int, chunk: int, kind: str, mb: int) -> float | None:
        dep = self.deps[(rank, chunk, kind)]
        if dep is None:
            return 0.0
        finish = dep[0][mb]
        return None if finish is None else finish + dep[1]

    def _decide(self, rank: int) -> tuple[tuple[int, str, int] | None, float | None]:
        """The pass ``rank`` runs now, and the earliest known time a not-yet-ready pass becomes ready."""
        now = self.clock[rank]
        policy = self.policy
        last = self.last_kind[rank]
        if policy.eager_w and last == I:
            chunk, mb = self.pending_w[rank][-1]
            return (chunk, W, mb), None
        next_ready = None
        # input gradients: the lowest microbatch that is ready, chunk 1 first on ties
        next_i, next_f = self.next_i[rank], self.next_f[rank]
        grad = None
        for c in (1, 0):
            mb = next_i[c]
            if mb < next_f[c]:
                ready = self._ready_at(rank, c, I, mb)
                if ready is None:
                    continue
                if ready <= now + _EPS:
                    if grad is None or mb < grad[2]:
                        grad = (c, I, mb)
                elif next_ready is None or ready < next_ready:
                    next_ready = ready
        # forwards: the first chunk in policy order that is ready and fits the memory cap
        fwd = None
        for c in self.chunk_order:
            mb = next_f[c]
            room = self.cap - (policy.reserve if c == 0 else 0)
            if mb < self.m and self.live[rank] + 1 <= room + _EPS:
                ready = self._ready_at(rank, c, F, mb)
                if ready is None:
                    continue
                if ready <= now + _EPS:
                    fwd = (c, F, mb)
                    break
                if next_ready is None or ready < next_ready:
                    next_ready = ready
        forward_first = policy.alternate and last is not None and last != F
        first, second = (fwd, grad) if forward_first else (grad, fwd)
        if first is not None:
            return first, None
        if second is not None:
            return second, None
        if self.pending_w[rank]:
            soon = next_ready is not None and next_ready < now + self.costs.W - _EPS
            if not (policy.wait_for_input_grad and soon):
                chunk, mb = self.pending_w[rank][0]
                return (chunk, W, mb), None
        return None, next_ready

    def _place(self, rank: int, chunk: int, kind: str, mb: int) -> None:
        stage = self.stages[rank][chunk]
        start = self.clock[rank]
        self.clock[rank] = start + self.duration[kind]
        self.end[(stage, kind)][mb] = self.clock[rank]
        self.order[rank].append(Action(stage, kind, mb))
        self.last_kind[rank] = kind
        if kind == F:
            self.next_f[rank][chunk] += 1
            self.live[rank] += 1
        elif kind == I:
            self.next_i[rank][chunk] += 1
            self.pending_w[rank].append((chunk, mb))
        else:
            self.pending_w[rank].remove((chunk, mb))
            self.live[rank] -= 1
