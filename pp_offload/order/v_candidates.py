"""The candidate families of the V search: offset blocks, 1F1B-rhythm orders and greedy orders.

Why a module of its own: what the search tries (`_generators`: every candidate, each a name and a way to
build its order for any number of microbatches) is independent of how it judges and keeps them
(`pp_offload.order.v_curve`); the census-pruned policy lists and the offset space live here, beside the
families they feed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import lru_cache, partial

from pp_offload.order.actions import Costs, Order
from pp_offload.order.blocks import PERIOD, VBlock, v_block
from pp_offload.order.cooldown import diagonal_cooldown
from pp_offload.order.greedy import GreedyPolicy, greedy_v_order
from pp_offload.order.rhythm import rhythm_v_order
from pp_offload.order.v_caps import one_f_one_b_peak, v_half_cap, v_min_cap

_MAX_DOWN_OFFSET = 4
# Forward turn gaps tried. 2 and 3 (and down offsets of 5) add blocks that rank well squeezed but lose
# after compaction, crowding better candidates out of the shortlist: measured worse at d=8.
_TURN_F = (1,)


@dataclass(frozen=True)
class _Candidate:
    name: str
    block: VBlock


# Greedy variants worth trying; pruned by a census of which variants ever won on a grid of d, m, costs
# and caps (chunk-0-first forwards and unit-cost shaping rarely win, so only their winners stay).
_GREEDY_POLICIES = tuple(
    GreedyPolicy(reserve, wait, True, eager_w, alternate)
    for reserve in (0, 1)
    for wait in (False, True)
    for eager_w in (False, True)
    for alternate in (False, True)
) + (GreedyPolicy(1, False, False, False, False),)
_UNIT_SHAPED_POLICIES = (
    GreedyPolicy(0, False, True, False, False),
    GreedyPolicy(0, False, True, False, True),
    GreedyPolicy(1, False, True, False, False),
    GreedyPolicy(1, False, False, False, False),
)

# Below 1F1B's memory the block family (with its drain rewritten) wins almost everywhere; the greedy
# family is kept with its three most useful policies (all of them below V-Min's cap, where it is the
# only family that fits: it reaches any cap >= 2).
_EVERY_CAP_POLICIES = (
    GreedyPolicy(1, False, True, False, False),
    GreedyPolicy(1, False, True, False, True),
    GreedyPolicy(0, False, True, True, True),
)


# Below V-Min's cap, the policies that won there (census over d in {4, 8, 16}, both cost models).
_LOW_POLICIES = (
    GreedyPolicy(1, False, False, False, False),
    GreedyPolicy(1, False, True, False, False),
    GreedyPolicy(1, False, True, False, True),
    GreedyPolicy(1, True, True, False, False),
    GreedyPolicy(1, True, True, False, True),
)
_DEEP = 8  # beyond this many ranks the search is trimmed to what won there (see `_greedy_caps`)


@dataclass(frozen=True)
class _Generator:
    """One candidate: a name and how to build its order for any number of microbatches."""

    name: str
    canonical: bool
    build: Callable[[int], Order | None]
    extra: bool = False  # a wide-offset block: shortlisted on its own quota (see `v_curve._Curve._grow`)
    cap: int = 0  # built under this memory cap (greedy): joins the search when it reaches that cap
    warm: bool = False  # warm-up rewritten (`warmup_rewrite`): shortlisted on its own quota too


def _greedy_caps(num_ranks: int, max_cap: int) -> list[int]:
    """The memory caps the greedy family is built at (it is the costliest family to build).

    Every cap from V-Min's up for d <= 8; a stride of d/4 beyond, and below V-Min's cap (where only
    this family fits, so it is the floor that keeps every limit >= 2 feasible). The curve between two
    greedy caps is filled by the cap-free families.
    """
    d = num_ranks
    low = min(max_cap, v_min_cap(d))
    stride = max(1, d // 4)
    if d > _DEEP:
        # Beyond d=8 greedy orders never won from V-Min's cap up (blocks with their drain rewritten
        # did, at every cap of the sweep): only the floor below V-Min and 1F1B's memory are kept.
        return sorted(set(range(2, low, stride)) | {max_cap})
    caps = set(range(2, low, stride)) | set(range(low, max_cap + 1, 1 if d <= 8 else stride))
    caps |= {max_cap, low, min(max_cap, v_half_cap(d))}
    return sorted(caps)


def _generators(num_ranks: int, num_microbatches: int, costs: Costs) -> list[_Generator]:
    """Every candidate of the search; none depends on the requested limit (see `v_curve._Curve`)."""
    d = num_ranks
    gens = [_Generator(c.name, c.name in ("V-Min", "V-Half"), c.block.repeat) for c in _candidates(d)]
    if d > 8:
        # Deeper pipelines need larger offsets to reach peaks near 2d (d=16: offsets 5 and 6 fill
        # 24..31). They are many and rank well before compaction but rarely after, so they get their own
        # shortlist quota instead of crowding the others out.
        known = {_block_key(c.block) for c in _candidates(d)}
        gens += [
            _Generator(c.name, False, c.block.repeat, extra=True)
            for c in _candidates(d, _MAX_DOWN_OFFSET + 2)
            if _block_key(c.block) not in known
        ]
    # 1F1B-rhythm orders, full fill (1F1B's memory) down to a one-forward fill.
    gens += [
        _Generator(f"rhythm(trim={t})", False, partial(rhythm_v_order, d, trim=t)) for t in range(2 * d - 1)
    ]
    # Greedy decisions taken with skewed durations can build a worse structure than the same greedy
    # run with unit costs, so both cost models generate candidates; the real costs always judge them.
    unit = Costs(comm=costs.comm)
    shaped = [(costs, p) for p in _GREEDY_POLICIES]
    if unit != costs:
        shaped += [(unit, p) for p in _UNIT_SHAPED_POLICIES]
    max_cap = one_f_one_b_peak(d, num_microbatches)
    for cap in _greedy_caps(d, max_cap):
        policies = [(costs, p) for p in _EVERY_CAP_POLICIES]
        if cap < v_min_cap(d):
            policies = [(shape, p) for shape, p in shaped if p in _LOW_POLICIES]
        elif cap == max_cap and d <= _DEEP:
            policies = shaped
        gens += [
            _Generator(
                f"greedy{policy}@{shape_costs}@cap{cap}",
                False,
                partial(greedy_v_order, d, costs=shape_costs, memory_cap=cap, policy=policy),
                cap=cap,
            )
            for shape_costs, policy in policies
        ]
    return gens


def _with_cooldown(build: Callable[[int], Order | None], num_microbatches: int) -> Order | None:
    order = build(num_microbatches)
    return None if order is None else diagonal_cooldown(order)


@lru_cache(maxsize=32)
def _candidates(num_ranks: int, max_offset: int = _MAX_DOWN_OFFSET) -> tuple[_Candidate, ...]:
    """The offset space: canonical V-Min/V-Half plus two-segment down-offset patterns, offsets up to
    ``max_offset`` (the planner's fast path uses the default; the search goes further for deep pipelines)."""
    d = num_ranks
    found: dict[tuple, _Candidate] = {}

    def add(name: str, block: VBlock) -> None:
        found.setdefault(_block_key(block), _Candidate(name, block))

    x_min = 2 if d % 3 == 0 else 0
    add("V-Min", v_block(d, down=[1] * (d - 1), backward_delay=1 + x_min, turn_f=1, turn_b=1))
    x_half = 3 if d % 2 == 0 else 0
    add("V-Half", v_block(d, down=[2] * (d - 1), backward_delay=1 + x_half, turn_f=1, turn_b=2))
    step = max(1, (d - 1) // 8)
    for a in range(1, max_offset + 1):
        for b in range(1, max_offset + 1):
            splits = [d - 1] if a == b else range(1, d - 1, step)
            for k in splits:
                down = [a] * k + [b] * (d - 1 - k)
                for turns, block in _collision_free_blocks(d, down):
                    add(f"down={a}x{k},{b} turns={turns}", block)
    return tuple(found.values())


def _block_key(block: VBlock) -> tuple:
    return tuple(tuple(sorted(s.items())) for s in block.slots)


def _collision_free_blocks(d: int, down: list[int]) -> Iterable[tuple[str, VBlock]]:
    """Blocks for these down offsets whose F/f/I/i take distinct slots mod the period on every rank.

    Distinct residues mean a rank's stable phase has no two passes competing for one slot. For each
    pair of turn gaps (forward: `_TURN_F`, backward: 1 to 3 slots), the smallest backward delay that
    achieves it (longer delays only lengthen lifespans).
    Yields ``("turn_f/turn_b/delay", block)``.
    """
    for turn_f in _TURN_F:
        for turn_b in (1, 2, 3):
            for delay in range(1, PERIOD + 1):
                block = v_block(d, down=down, backward_delay=delay, turn_f=turn_f, turn_b=turn_b)
                if all(_distinct_residues(slots) for slots in block.slots):
                    yield f"{turn_f}/{turn_b}/{delay}", block
                    break


def _distinct_residues(slots: dict) -> bool:
    residues = [slot % PERIOD for (chunk, kind), slot in slots.items() if kind != "W"]
    return len(set(residues)) == len(residues)
