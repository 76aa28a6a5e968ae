"""Cool-down rewrite: rebuild the drain after the last forward as a diagonal of input-gradient passes.

Why: once the last microbatch's forward has run, a rank has nothing left but backward passes, and the
order a repeated block (or a greedy run) leaves there is whatever its steady phase produced: on rank
``r`` the chunk-1 input gradients (which flow down the ranks) and the chunk-0 ones (which flow back up)
queue behind weight passes and each other, so the wave of input gradients that every other rank waits
on advances by a pass of W at each step. General gap filling (`pp_offload.order.compact`) cannot repair
this: it only moves passes *earlier* into gaps, while the fix is to move weight passes *later*.

The rewrite, on the order's unit-cost slot grid (its replay with F = I = W = 1):

1. take the last ``ceil(P / 2)`` chunk-0 input gradients of every rank and its last ``min(r + 1,
   P - ceil(P / 2))`` chunk-1 ones (``P``: the order's peak in chunk units), and the trailing weight
   passes (at least one per taken input gradient, per chunk, and at least ``P`` in all);
2. put the chunk-1 passes back on the down-going diagonal ending at slot ``S + 1 + r`` and the chunk-0
   ones on the up-going diagonal ending at ``S + 2d - r``, two slots apart (``S``: rank 0's last
   forward). The two diagonals have opposite parity, so on every rank the two chunks' passes
   interleave, and each pass is ready exactly when its neighbour rank hands it over;
3. put the weight passes back into the free slots after the rank's last remaining weight pass (chunk 1
   first: its input gradients finished first), the rest at the end.

Only the per-rank *sequence* comes out; the real costs then time it (and compaction fills what the
unit grid leaves open). A rewrite that cannot run (a pass before its dependency) is rejected by the
caller's replay, so this never needs to be right for every input, only never silently wrong.
"""

from __future__ import annotations

from pp_offload.order.actions import Action, Costs, F, I, Order, W, v_stages
from pp_offload.order.replay import replay_ranks
from pp_offload.sim import OrderDeadlockError

_UNIT = Costs()


def diagonal_cooldown(order: Order) -> Order | None:
    """``order`` with its drain rewritten (see the module doc), or None when it cannot be replayed."""
    slots: dict[tuple[int, str, int], float] = {}
    try:
        _, peaks = replay_ranks(order, _UNIT, slots)
    except OrderDeadlockError:
        return None
    d = len(order)
    peak = min(max(peaks), 2 * d)
    last_stage = v_stages(0, d)[1]
    last_forward = max(slot for (s, k, _), slot in slots.items() if k == F and s == last_stage)
    num_mb = 1 + max(a.microbatch_index for a in order[0])
    up_count = min((peak + 1) // 2, num_mb)
    out: Order = {}
    for rank, actions in order.items():
        out[rank] = _rewrite_rank(
            rank, d, actions, slots, last_forward, up_count, min(rank + 1, peak - up_count, num_mb), peak
        )
    return out


def _rewrite_rank(
    rank: int,
    d: int,
    actions: list[Action],
    slot_of: dict[tuple[int, str, int], float],
    last_forward: float,
    up_count: int,
    down_count: int,
    peak: int,
) -> list[Action]:
    stages = v_stages(rank, d)
    chunk_of = {stages[0]: 0, stages[1]: 1}
    placed: list[tuple[float, int, int, str]] = []  # (slot, tie, chunk, kind); microbatches set later
    keep = [True] * len(actions)
    # 1. the last input gradients of each chunk
    wanted = {0: up_count, 1: down_count}
    taken = {0: 0, 1: 0}
    for idx in range(len(actions) - 1, -1, -1):
        a = actions[idx]
        if a.computation_type != I:
            continue
        c = chunk_of[a.stage_index]
        if taken[c] < wanted[c]:
            keep[idx] = False
            k = taken[c]
            slot = last_forward - rank + 2 * d - 2 * k if c == 0 else last_forward + 1 + rank - 2 * k
            placed.append((slot, 1, c, I))
            taken[c] += 1
    # ... and enough trailing weight passes to follow them
    held = {0: 0, 1: 0}
    for idx in range(len(actions) - 1, -1, -1):
        if held[0] >= taken[0] and held[1] >= taken[1] and held[0] + held[1] >= peak:
            break
        a = actions[idx]
        if a.computation_type == W:
            keep[idx] = False
            held[chunk_of[a.stage_index]] += 1
    # Everything before the first slot the rewrite touches stays as it is (most of the order): only the
    # tail is re-sorted. A refilled W goes after the last kept W, so that slot bounds the tail too.
    slots = [slot_of[(a.stage_index, a.computation_type, a.microbatch_index)] for a in actions]
    kept_w = [slots[i] for i, a in enumerate(actions) if keep[i] and a.computation_type == W]
    last_w = max(kept_w, default=-1.0)
    cut = min([slots[i] for i in range(len(actions)) if not keep[i]] + [p[0] for p in placed] + [last_w + 1])
    head = 0
    while head < len(actions) and slots[head] < cut:
        head += 1
    pending = {0: 0, 1: 0}
    counters = {(c, k): 0 for c in (0, 1) for k in (F, I, W)}
    for a in actions[:head]:
        c = chunk_of[a.stage_index]
        pending[c] += a.computation_type == I
        pending[c] -= a.computation_type == W
        counters[(c, a.computation_type)] += 1
    for idx in range(head, len(actions)):
        if keep[idx]:
            a = actions[idx]
            placed.append((slots[idx], 0, chunk_of[a.stage_index], a.computation_type))
    # 3. weight passes into free slots after the last kept one, chunk 1 first
    used = {slot for slot, *_ in placed}
    timeline = sorted(placed)
    refill: list[tuple[float, int, int, str]] = []
    cursor = 0
    end = max(used | {slots[head - 1] if head else -1.0}) + held[0] + held[1] + 1
    slot = cut
    while slot <= end and (held[0] or held[1]):
        while cursor < len(timeline) and timeline[cursor][0] <= slot:
            _, _, c, kind = timeline[cursor]
            pending[c] += kind == I
            pending[c] -= kind == W
            cursor += 1
        if slot > last_w and slot not in used:
            for c in (1, 0):
                if held[c] and pending[c] > 0:
                    refill.append((slot, 0, c, W))
                    held[c] -= 1
                    pending[c] -= 1
                    break
        slot += 1.0
    tail = end + 1
    for c in (1, 0):
        for _ in range(held[c]):
            refill.append((tail, 0, c, W))
            tail += 1
    # Per (chunk, kind) lane, microbatches in sequence order (torch's lowering expects it).
    result = actions[:head]
    for _, _, c, kind in sorted(placed + refill):
        result.append(Action(stages[c], kind, counters[(c, kind)]))
        counters[(c, kind)] += 1
    return result
