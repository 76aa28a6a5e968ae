"""Building blocks: one microbatch's passes on all ranks at fixed relative slots, repeated.

The controllable-memory paper's framework: a schedule is a *building block* (the start slot of every
pass of one microbatch on every rank) repeated every ``period`` slots. The lifespan of a chunk (its F
start to its W end) divided by the period bounds how many microbatches of that chunk are alive at once,
so the block's offsets control memory. Here a block only fixes the *per-rank order* of passes; real
durations are applied afterwards by `pp_offload.order.compact.compact`, which squeezes the order with
the real costs and fills warm-up/cool-down gaps.

Slots count unit-cost passes; with 2 chunks x (F, I, W) a rank has 6 passes per microbatch, so the
period is 6 slots. Chunk 0 is stage ``r`` (down the V), chunk 1 is stage ``2d-1-r`` (back up).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pp_offload.order.actions import Action, F, I, Order, W, v_stages

PERIOD = 6


@dataclass(frozen=True)
class VBlock:
    """Start slots of microbatch 0's passes: ``slots[rank][(chunk, kind)]``."""

    num_ranks: int
    slots: tuple[dict[tuple[int, str], int], ...]

    def repeat(self, num_microbatches: int) -> Order:
        """Per-rank order of ``num_microbatches`` copies of the block, copy ``j`` shifted by ``6j``.

        Works for any ``m >= 1``: an order for fewer microbatches than a full steady phase needs is
        exactly the padded order with the padding dropped, since dropping passes keeps the sort.
        """
        # Ties (two passes in one slot) go to the backward side first: it frees memory sooner.
        rank_of_kind = {W: 0, I: 1, F: 2}
        order: Order = {}
        for rank in range(self.num_ranks):
            stages = v_stages(rank, self.num_ranks)
            keyed = []
            for (chunk, kind), slot in self.slots[rank].items():
                for j in range(num_microbatches):
                    key = (slot + PERIOD * j, rank_of_kind[kind], -chunk, j)
                    keyed.append((key, Action(stages[chunk], kind, j)))
            keyed.sort(key=lambda item: item[0])
            order[rank] = [action for _, action in keyed]
        return order


def v_block(
    num_ranks: int,
    *,
    down: Sequence[int],
    up: int = 1,
    backward_delay: int = 1,
    turn_f: int = 1,
    turn_b: int = 1,
) -> VBlock:
    """A V-shaped block from its offsets.

    ``down[i]`` is the slot offset between rank i's and rank i+1's pass on the way down (used for
    both the forward of chunk 0 and the input-gradient of chunk 1); ``up`` the offset on the way back up.
    ``turn_f``/``turn_b`` are the gaps where the V turns on the last rank, ``backward_delay`` the gap
    between rank 0's last forward (chunk 1, whose output is the loss) and its first input-gradient pass.
    W passes take the free slots after their I passes (see `_place_weight_passes`).
    """
    d = num_ranks
    if len(down) != d - 1:
        raise ValueError(f"need {d - 1} down offsets for {d} ranks, got {len(down)}")
    f0 = [0] * d
    for i in range(1, d):
        f0[i] = f0[i - 1] + down[i - 1]
    f1 = [0] * d
    f1[d - 1] = f0[d - 1] + turn_f
    for i in range(d - 2, -1, -1):
        f1[i] = f1[i + 1] + up
    i1 = [0] * d
    i1[0] = f1[0] + backward_delay
    for i in range(1, d):
        i1[i] = i1[i - 1] + down[i - 1]
    i0 = [0] * d
    i0[d - 1] = i1[d - 1] + turn_b
    for i in range(d - 2, -1, -1):
        i0[i] = i0[i + 1] + up
    slots = []
    for r in range(d):
        rank_slots = {(0, F): f0[r], (1, F): f1[r], (1, I): i1[r], (0, I): i0[r]}
        rank_slots.update(_place_weight_passes(rank_slots))
        slots.append(rank_slots)
    return VBlock(d, tuple(slots))


def _place_weight_passes(slots: dict[tuple[int, str], int]) -> dict[tuple[int, str], int]:
    """Put each chunk's W in a free slot (mod the period) after its I, keeping lifespans short.

    Two W passes and the residues left free by F/f/I/i: try both assignments and keep the one whose
    longer-lived chunk ends earliest (that is what bounds memory), then the shorter total. If the four
    other passes already collide, each W simply follows its I.
    """
    used = {slot % PERIOD for slot in slots.values()}
    free = [res for res in range(PERIOD) if res not in used]

    def first_after(slot: int, residue: int) -> int:
        return slot + 1 + (residue - (slot + 1)) % PERIOD

    if len(free) < 2:
        return {(c, W): slots[(c, I)] + 1 for c in (0, 1)}
    best = None
    for r0, r1 in ((free[0], free[1]), (free[1], free[0])):
        w0, w1 = first_after(slots[(0, I)], r0), first_after(slots[(1, I)], r1)
        spans = sorted((w0 - slots[(0, F)], w1 - slots[(1, F)]), reverse=True)
        key = (spans, w0 + w1)
        if best is None or key < best[0]:
            best = (key, {(0, W): w0, (1, W): w1})
    return best[1]
