"""1F1B-rhythm V orders: a warm-up of forwards, then a strict forward/input-grad/weight-grad cycle.

Why a third family beside building blocks and greedy orders: a rank that, in its steady phase, runs
each chunk's F, I and W back to back (F0 I0 W0 F1 I1 W1, ...) leaves no room for skewed pass costs or
point-to-point latency to open gaps, because every pass it hands to a neighbour is ready in the same
rhythm the neighbour consumes it. This is the structure of the zero-bubble V schedule (torch's
``ScheduleZBVZeroBubble``); block and greedy orders match it at unit costs without latency, but fall
2-4% behind once comm > 0 or F:I:W = 3:4:2. The search in `pp_offload.order.vshape` judges all
families with the real costs.

Rank r (chunk 0 = stage r, chunk 1 = stage 2d-1-r) runs, with every count capped by what is left:

1. ``2(d-r)-1-trim`` chunk-0 forwards (at least one): the pipeline's fill;
2. ``r`` pairs (chunk-1 forward, chunk-0 forward) while the V turns;
3. ``d-r`` triples (chunk-1 F, I, W): the first microbatches' backward starts on chunk 1;
4. the cycle F0 I0 W0 F1 I1 W1, skipping kinds that are exhausted or not yet runnable on this rank;
5. once every forward ran: the remaining input gradients, then the remaining weight gradients.

``trim`` shortens the fill, lowering the peak by about one chunk per unit, so the family also offers
candidates below 1F1B's memory. Cross-rank validity is not assumed: the search replays every order and
drops the ones that deadlock.
"""

from __future__ import annotations

from pp_offload.order.actions import Action, F, I, Order, W, v_stages


def rhythm_v_order(num_ranks: int, num_microbatches: int, trim: int = 0) -> Order:
    """The 1F1B-rhythm V order for ``d`` ranks and ``m`` microbatches (see the module doc)."""
    d, m = num_ranks, num_microbatches
    return {r: _rank_order(r, d, m, trim) for r in range(d)}


def _rank_order(rank: int, d: int, m: int, trim: int) -> list[Action]:
    stages = v_stages(rank, d)
    done = {(c, k): 0 for c in (0, 1) for k in (F, I, W)}  # passes run so far, per (chunk, kind)
    out: list[Action] = []

    def run(chunk: int, kind: str) -> bool:
        """Run the next pass of (chunk, kind) if this rank can: not exhausted, F before I before W."""
        n = done[(chunk, kind)]
        prerequisite = {F: None, I: (chunk, F), W: (chunk, I)}[kind]
        if n >= m or (prerequisite is not None and done[prerequisite] <= n):
            return False
        out.append(Action(stages[chunk], kind, n))
        done[(chunk, kind)] = n + 1
        return True

    for _ in range(max(1, 2 * (d - rank) - 1 - trim)):
        run(0, F)
    for _ in range(rank):
        run(1, F)
        run(0, F)
    for _ in range(d - rank):
        for kind in (F, I, W):
            run(1, kind)
    cycle = ((0, F), (0, I), (0, W), (1, F), (1, I), (1, W))
    while done[(0, F)] < m or done[(1, F)] < m:
        for chunk, kind in cycle:
            run(chunk, kind)
    # Cool-down: the input gradients are the other ranks' critical path; W passes go last (compaction
    # pulls them back into whatever gaps the I passes leave).
    while done[(0, I)] < m or done[(1, I)] < m:
        for chunk in (0, 1):
            run(chunk, I)
    while done[(0, W)] < done[(0, I)] or done[(1, W)] < done[(1, I)]:
        for chunk in (0, 1):
            run(chunk, W)
    return out
