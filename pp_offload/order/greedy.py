"""Greedy V orders under a memory cap, driven by the real costs (the zero-bubble way of building V-ZB).

A discrete-event simulation: the rank with the earliest free time decides what to run next from the
passes that are ready then. Processing ranks in time order makes every such decision exact (every pass
that could have become ready by then has already been placed). The policy:

1. an input-gradient pass (I), which other ranks wait on;
2. else a forward, if the rank stays within its memory cap (keeping ``reserve`` chunk units free for
   chunk-1 forwards, which lead to the loss, so chunk-0 forwards cannot fill memory and stall the V);
3. else a weight-gradient pass (W), which only frees memory and fills what would be a bubble; with
   ``wait_for_input_grad`` a W is skipped when an I will be ready before the W could end;
4. else wait for the next pass to become ready.

A few policy variants are tried by `pp_offload.order.vshape`; the simulator picks the best.
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


def greedy_v_order(
    num_ranks: int, num_microbatches: int, costs: Costs, memory_cap: float, policy: GreedyPolicy
) -> Order | None:
    """A V order built greedily under ``memory_cap`` chunk units per rank, or None if it stalls."""
    d, m = num_ranks, num_microbatches
    num_stages = 2 * d
    stages = [v_stages(r, d) for r in range(d)]
    next_f = [[0, 0] for _ in range(d)]  # next microbatch to forward, per chunk
    next_i = [[0, 0] for _ in range(d)]
    pending_w: list[list[tuple[int, int]]] = [[] for _ in range(d)]  # (chunk, mb) in I order
    clock = [0.0] * d
    live = [0] * d
    end: dict[tuple[int, str, int], tuple[float, int]] = {}
    order: Order = {r: [] for r in range(d)}
    remaining = 6 * d * m

    def ready_at(rank: int, stage: int, kind: str, mb: int) -> float | None:
        dep = dependency(stage, kind, mb, num_stages)
        if dep is None:
            return 0.0
        if dep not in end:
            return None
        finish, producer = end[dep]
        return finish + (costs.comm if producer != rank else 0.0)

    def run(rank: int, chunk: int, kind: str, mb: int, start: float) -> None:
        stage = stages[rank][chunk]
        finish = start + costs.of(kind)
        end[(stage, kind, mb)] = (finish, rank)
        clock[rank] = finish
        order[rank].append(Action(stage, kind, mb))

    chunk_order = (1, 0) if policy.chunk1_first else (0, 1)
    waiting: set[int] = set()  # ranks with nothing to do until another rank places a pass
    while remaining:
        active = [r for r in range(d) if len(order[r]) < 6 * m and r not in waiting]
        if not active:
            return None  # stalled: memory cap too tight for this policy
        rank = min(active, key=lambda r: (clock[r], r))
        now = clock[rank]
        choice = None
        earliest_future = None

        def consider(chunk: int, kind: str, mb: int) -> float | None:
            nonlocal earliest_future
            ready = ready_at(rank, stages[rank][chunk], kind, mb)
            if ready is not None and ready > now + _EPS:
                earliest_future = ready if earliest_future is None else min(earliest_future, ready)
            return ready

        # 1. input-gradient passes, the oldest first
        ready_inputs = []
        for chunk in (0, 1):
            mb = next_i[rank][chunk]
            if mb < m and mb < next_f[rank][chunk]:
                ready = consider(chunk, I, mb)
                if ready is not None and ready <= now + _EPS:
                    ready_inputs.append((mb, -chunk, chunk))
        if ready_inputs:
            _, _, chunk = min(ready_inputs)
            choice = (chunk, I, next_i[rank][chunk])
        # 2. forwards within the memory cap
        if choice is None:
            for chunk in chunk_order:
                mb = next_f[rank][chunk]
                if mb >= m:
                    continue
                room = memory_cap - (policy.reserve if chunk == 0 else 0)
                if live[rank] + 1 > room + _EPS:
                    continue
                ready = consider(chunk, F, mb)
                if ready is not None and ready <= now + _EPS:
                    choice = (chunk, F, mb)
                    break
        # 3. weight-gradient passes fill the rest
        if choice is None and pending_w[rank]:
            waits = (
                policy.wait_for_input_grad
                and earliest_future is not None
                and earliest_future < now + costs.W - _EPS
            )
            if not waits:
                chunk, mb = pending_w[rank][0]
                choice = (chunk, W, mb)
        if choice is None:
            later = [clock[r] for r in active if clock[r] > now + _EPS]
            candidates = [t for t in (earliest_future, min(later) if later else None) if t is not None]
            if candidates:
                clock[rank] = min(candidates)
            else:
                waiting.add(rank)
            continue
        waiting.clear()
        chunk, kind, mb = choice
        run(rank, chunk, kind, mb, now)
        remaining -= 1
        if kind == F:
            next_f[rank][chunk] += 1
            live[rank] += 1
        elif kind == I:
            next_i[rank][chunk] += 1
            pending_w[rank].append((chunk, mb))
        else:
            pending_w[rank].pop(0)
            live[rank] -= 1
    return order
