"""Warm-up rewrite: lay out the passes before a rank's first chunk-0 input gradient in a fixed rhythm.

Why: a repeated block (or a greedy run) starts each rank with whatever its steady phase implies, and at
some memory caps that start is loose: chunk-1 forwards arrive late, so the first input gradients (which
every other rank waits on) do too. The controllable-memory paper's reference scheduler rewrites this
warm-up; this module does the same kind of rewrite, on the order's own passes:

on rank ``r``, with ``P`` the order's peak in chunk units (at most ``2d``), the passes before the first
chunk-0 input gradient (chunk-0 and chunk-1 forwards, chunk-1 input and weight gradients) are put back as

1. up to ``2(d-1-r)`` chunk-0 forwards (the V's fill),
2. ``r + 1`` pairs (chunk-0 forward, chunk-1 forward), at most ``min(r + 1, P // 2)`` chunk-1 forwards
   and ``P`` minus that many chunk-0 forwards in steps 1-2,
3. then triples (chunk-1 input gradient, chunk-1 weight gradient, a forward: chunk 1's while any is
   left, else chunk 0's) until the passes of the original warm-up are used up;

the rest of the order is kept as it is. Only the sequence comes out; the caller replays it with the real
costs (timing, peak, deadlock) and keeps it only where it is faster within the cap. At d=4, m=16, unit
costs and a cap of 5 chunk units this rewrite (with the cool-down rewrite after it) gives 7.7% where the
search without it found 8.6%.
"""

from __future__ import annotations

from pp_offload.order.actions import Action, F, I, Order, W, v_stages


def warmup_rewrite(order: Order) -> Order | None:
    """``order`` with every rank's warm-up laid out as in the module doc, or None when a rank's warm-up
    holds a pass this rewrite does not place (then the order is left to the other variants)."""
    d = len(order)
    num_mb = 1 + max(a.microbatch_index for a in order[0])
    peak = min(_peak(order), 2 * d)
    out: Order = {}
    for rank, actions in order.items():
        rewritten = _rewrite_rank(rank, d, num_mb, peak, actions)
        if rewritten is None:
            return None
        out[rank] = rewritten
    return out


def _peak(order: Order) -> int:
    """Largest number of chunks any rank holds (forwards run, weight passes not yet)."""
    best = 0
    for actions in order.values():
        level = 0
        for a in actions:
            level += a.computation_type == F
            level -= a.computation_type == W
            best = max(best, level)
    return best


def _rewrite_rank(rank: int, d: int, num_mb: int, peak: int, actions: list[Action]) -> list[Action] | None:
    down, up = v_stages(rank, d)
    cut = next(
        (i for i, a in enumerate(actions) if a.computation_type == I and a.stage_index == down), len(actions)
    )
    lanes = {"f0": (down, F), "f1": (up, F), "i1": (up, I), "w1": (up, W)}
    have = {
        name: sum(1 for a in actions[:cut] if (a.stage_index, a.computation_type) == lane)
        for name, lane in lanes.items()
    }
    if sum(have.values()) != cut:
        return None
    f1_cap = min(rank + 1, peak // 2, num_mb)
    f0_cap = min(peak - f1_cap, num_mb)
    used = dict.fromkeys(lanes, 0)
    sequence: list[str] = []

    def put(name: str) -> None:
        sequence.append(name)
        used[name] += 1

    for _ in range(2 * (d - 1 - rank)):
        if used["f0"] < min(f0_cap, have["f0"]):
            put("f0")
    for _ in range(rank + 1):
        if used["f0"] < min(f0_cap, have["f0"]):
            put("f0")
        if used["f1"] < min(f1_cap, have["f1"]):
            put("f1")
    while any(used[name] < have[name] for name in lanes):
        if used["i1"] < have["i1"]:
            put("i1")
        if used["w1"] < have["w1"]:
            put("w1")
        if used["f1"] < have["f1"]:
            put("f1")
        elif used["f0"] < have["f0"]:
            put("f0")
    counters = dict.fromkeys(lanes, 0)
    head = []
    for name in sequence:
        stage, kind = lanes[name]
        head.append(Action(stage, kind, counters[name]))
        counters[name] += 1
    return head + list(actions[cut:])
