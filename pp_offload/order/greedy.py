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

from pp_offload.order.actions import Action, Costs, F, I, Order, W, v_stages
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
    def __init__(self, d: int, m: int, costs: Costs, cap: float, policy: GreedyPolicy) -> None:
        self.d, self.m, self.costs, self.cap, self.policy = d, m, costs, cap, policy
        self.stages = [v_stages(r, d) for r in range(d)]
        self.next_f = [[0, 0] for _ in range(d)]  # next microbatch to forward, per chunk
        self.next_i = [[0, 0] for _ in range(d)]
        self.pending_w: list[list[tuple[int, int]]] = [[] for _ in range(d)]  # (chunk, mb), I order
        self.clock = [0.0] * d
        self.live = [0] * d
        self.end: dict[tuple[int, str, int], tuple[float, int]] = {}
        self.order: Order = {r: [] for r in range(d)}
        self.chunk_order = (1, 0) if policy.chunk1_first else (0, 1)

    def run(self) -> Order | None:
        remaining = 6 * self.d * self.m
        unfinished = set(range(self.d))
        waiting: set[int] = set()  # ranks with nothing to do until another rank places a pass
        while remaining:
            active = unfinished - waiting
            if not active:
                return None  # stalled: the memory cap is too tight for this policy
            clock = self.clock
            rank = min(active, key=lambda r: (clock[r], r))
            choice, next_ready = self._decide(rank)
            if choice is None:
                now = self.clock[rank]
                later = [self.clock[r] for r in active if self.clock[r] > now + _EPS]
                known = [t for t in (next_ready, min(later, default=None)) if t is not None]
                if known:
                    self.clock[rank] = min(known)
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
        dep = dependency(self.stages[rank][chunk], kind, mb, 2 * self.d)
        if dep is None:
            return 0.0
        if dep not in self.end:
            return None
        finish, producer = self.end[dep]
        return finish + (self.costs.comm if producer != rank else 0.0)

    def _decide(self, rank: int) -> tuple[tuple[int, str, int] | None, float | None]:
        """The pass ``rank`` runs now, and the earliest known time a not-yet-ready pass becomes ready."""
        now = self.clock[rank]
        future: list[float] = []

        def ready_now(chunk: int, kind: str, mb: int) -> bool:
            ready = self._ready_at(rank, chunk, kind, mb)
            if ready is not None and ready > now + _EPS:
                future.append(ready)
            return ready is not None and ready <= now + _EPS

        history = self.order[rank]
        if self.policy.eager_w and history and history[-1].computation_type == I:
            chunk, mb = self.pending_w[rank][-1]
            return (chunk, W, mb), None

        def input_grad():
            ready = [
                (self.next_i[rank][c], -c, c)
                for c in (0, 1)
                if self.next_i[rank][c] < self.next_f[rank][c] and ready_now(c, I, self.next_i[rank][c])
            ]
            if not ready:
                return None
            _, _, chunk = min(ready)
            return chunk, I, self.next_i[rank][chunk]

        def forward():
            for chunk in self.chunk_order:
                mb = self.next_f[rank][chunk]
                room = self.cap - (self.policy.reserve if chunk == 0 else 0)
                if mb < self.m and self.live[rank] + 1 <= room + _EPS and ready_now(chunk, F, mb):
                    return chunk, F, mb
            return None

        after_backward = bool(history) and history[-1].computation_type != F
        pickers = (forward, input_grad) if self.policy.alternate and after_backward else (input_grad, forward)
        for picker in pickers:
            choice = picker()
            if choice is not None:
                return choice, None
        next_ready = min(future, default=None)
        if self.pending_w[rank]:
            waits = (
                self.policy.wait_for_input_grad
                and next_ready is not None
                and next_ready < now + self.costs.W - _EPS
            )
            if not waits:
                chunk, mb = self.pending_w[rank][0]
                return (chunk, W, mb), None
        return None, next_ready

    def _place(self, rank: int, chunk: int, kind: str, mb: int) -> None:
        stage = self.stages[rank][chunk]
        start = self.clock[rank]
        self.clock[rank] = start + self.costs.of(kind)
        self.end[(stage, kind, mb)] = (self.clock[rank], rank)
        self.order[rank].append(Action(stage, kind, mb))
        if kind == F:
            self.next_f[rank][chunk] += 1
            self.live[rank] += 1
        elif kind == I:
            self.next_i[rank][chunk] += 1
            self.pending_w[rank].append((chunk, mb))
        else:
            self.pending_w[rank].remove((chunk, mb))
            self.live[rank] -= 1
