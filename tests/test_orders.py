"""The order generators: complete, replayable, accepted by torch's lowering, within their memory bounds,
cost-aware, and strict about their inputs. Pure Python plus torch's offline lowering: no processes."""

from __future__ import annotations

import re
from collections import Counter
from functools import cache

import pytest

from pp_offload.order import (
    Action,
    Costs,
    adaptive_v_order,
    v_half_order,
    v_min_order,
    v_stages,
    v_zb_order,
)
from pp_offload.order.baselines import one_f_one_b_order
from pp_offload.order.blocks import v_block
from pp_offload.order.compact import compact
from pp_offload.order.greedy import GreedyPolicy, greedy_v_order
from pp_offload.order.vshape import one_f_one_b_peak, v_half_cap, v_min_cap
from pp_offload.runtime import compat
from pp_offload.sim import flatten, simulate

UNIT = Costs()
SKEWED = Costs(F=3.0, I=4.0, W=2.0)
GENERATORS = {
    "V-Min": v_min_order,
    "V-Half": v_half_order,
    "V-ZB": v_zb_order,
    "adaptive@1.0": lambda d, m, costs=None: adaptive_v_order(d, m, 1.0, costs),
}
SIZES = [(d, m) for d in range(2, 7) for m in sorted({1, 3, d, 2 * d, 3 * d})]


@cache
def _order(name: str, d: int, m: int, costs: Costs = UNIT):
    return GENERATORS[name](d, m, costs)


def _bound(name: str, d: int, m: int) -> float:
    return {
        "V-Min": v_min_cap(d),
        "V-Half": v_half_cap(d),
        "V-ZB": 2 * d,
        "adaptive@1.0": one_f_one_b_peak(d, m),
    }[name]


def _lane(actions, lane: tuple[int, str]) -> list[int]:
    """Microbatches of one (stage, kind) in the order a rank runs them."""
    return [a.microbatch_index for a in actions if (a.stage_index, a.computation_type) == lane]


def _strs(order) -> dict[int, list[str]]:
    return {r: [str(a) for a in actions] for r, actions in order.items()}


# --- every generator, every size ------------------------------------------------------------------


@pytest.mark.parametrize("name", GENERATORS)
@pytest.mark.parametrize(("d", "m"), SIZES)
def test_order_is_complete_replayable_and_within_bounds(name, d, m):
    order = _order(name, d, m)
    assert sorted(order) == list(range(d))
    for rank, actions in order.items():
        stages = v_stages(rank, d)
        expected = Counter(Action(s, kind, j) for s in stages for kind in "FIW" for j in range(m))
        assert Counter(actions) == expected, f"rank {rank}: not every (stage, kind, mb) exactly once"
        # per (stage, kind) microbatches run in order, which torch's runtime expects
        for s in stages:
            for kind in "FIW":
                mbs = [
                    a.microbatch_index for a in actions if (a.stage_index, a.computation_type) == (s, kind)
                ]
                assert mbs == sorted(mbs), f"rank {rank}: {s}{kind} out of order"
    result = simulate(order)  # raises OrderDeadlockError on a deadlock
    assert result.peak <= _bound(name, d, m) + 1e-9
    assert result.peak <= one_f_one_b_peak(d, m) + 1e-9


@pytest.mark.parametrize("name", GENERATORS)
@pytest.mark.parametrize(("d", "m"), [(2, 1), (2, 4), (3, 3), (3, 6), (4, 8), (5, 10), (6, 12)])
def test_torch_lowering_accepts_the_order(name, d, m):
    lowered = compat.lower_order_offline(_order(name, d, m), m)
    for rank in range(d):
        compute = [a for a in lowered[rank] if a.is_compute_op]
        assert [str(a) for a in compute] == [str(a) for a in _order(name, d, m)[rank]]
    sends = Counter(a.computation_type.value for r in range(d) for a in lowered[r])
    # every stage boundary but the V turn (stage d-1 -> d, on rank d-1) crosses ranks
    assert sends["SEND_F"] == sends["RECV_F"] == sends["SEND_B"] == sends["RECV_B"] == (2 * d - 2) * m


@pytest.mark.parametrize("cls_name", ["ScheduleVMin", "ScheduleVHalf", "ScheduleVZB"])
def test_schedule_classes_lower_through_torchs_visualizer(cls_name):
    import pp_offload

    cls = getattr(pp_offload, cls_name)
    lowered = compat.schedule_ops(cls, 3, 6, 2, with_comms=True)
    assert sum(a.is_compute_op for rank in lowered for a in rank) == 6 * 3 * 6


def test_skewed_cost_orders_lower_and_stay_within_bounds():
    for name in GENERATORS:
        order = _order(name, 4, 8, SKEWED)
        compat.lower_order_offline(order, 8)
        assert simulate(order, SKEWED).peak <= _bound(name, 4, 8) + 1e-9


# --- adaptive ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("d", "m"), [(3, 6), (4, 8)])
@pytest.mark.parametrize("costs", [UNIT, SKEWED], ids=["unit", "3:4:2"])
def test_adaptive_respects_its_limit(d, m, costs):
    reference = one_f_one_b_peak(d, m)
    makespans = []
    for limit in (0.4, 0.5, 0.625, 0.75, 1.0):
        order = adaptive_v_order(d, m, limit, costs)
        result = simulate(order, costs)
        assert result.peak <= limit * reference + 1e-9, limit
        makespans.append(result.makespan)
    # more memory never makes the best order slower
    assert makespans == sorted(makespans, reverse=True)


def _named_limit(d: int, m: int, limit: float, costs: Costs) -> float:
    with pytest.raises(ValueError, match="memory_limit") as info:
        adaptive_v_order(d, m, limit, costs)
    numbers = re.findall(r"memory_limit >= ([0-9]*\.?[0-9]+)", str(info.value))
    assert numbers, f"the error names no smallest feasible memory_limit: {info.value}"
    return float(numbers[0])


@pytest.mark.parametrize(("d", "m", "limit"), [(2, 4, 0.1), (3, 6, 0.3), (4, 8, 0.1), (6, 3, 0.05)])
def test_adaptive_infeasible_limit_names_a_feasible_one(d, m, limit):
    named = _named_limit(d, m, limit, UNIT)
    assert limit < named <= 1.0
    adaptive_v_order(d, m, named)  # what the message suggests must work


@pytest.mark.parametrize(("d", "m"), [(2, 4), (3, 6), (4, 8), (5, 3)])
def test_adaptive_infeasible_limit_names_the_smallest(d, m):
    reference = one_f_one_b_peak(d, m)
    named_peak = round(_named_limit(d, m, 0.01, UNIT) * reference)
    assert named_peak == 2  # see test_two_chunk_units_is_the_floor
    with pytest.raises(ValueError):
        adaptive_v_order(d, m, (named_peak - 1) / reference)


def test_two_chunk_units_is_the_floor():
    """Rank 0 holds both chunks of a microbatch (its F of stage 0 and of stage 2d-1) at once."""
    d, m = 4, 8
    order = adaptive_v_order(d, m, 2 / one_f_one_b_peak(d, m))
    assert simulate(order).peak == 2.0
    with pytest.raises(ValueError, match="memory_limit"):
        adaptive_v_order(d, m, 1.9 / one_f_one_b_peak(d, m))


# --- costs ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("d", "m"), [(3, 6), (4, 8)])
def test_costs_change_the_order_and_never_hurt(d, m):
    differs = []
    for name in ("V-Min", "V-Half", "V-ZB"):
        unit_order, skewed_order = _order(name, d, m, UNIT), _order(name, d, m, SKEWED)
        differs.append(_strs(unit_order) != _strs(skewed_order))
        aware = simulate(skewed_order, SKEWED).makespan
        blind = simulate(unit_order, SKEWED).makespan
        assert aware <= blind + 1e-9, f"{name}: cost-aware {aware} > unit-cost order's {blind} at 3:4:2"
    assert any(differs)


def test_costs_as_mapping_equal_costs_object():
    assert _strs(v_half_order(3, 6, {"F": 3, "I": 4, "W": 2})) == _strs(_order("V-Half", 3, 6, SKEWED))


# --- bad input ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("gen", [v_min_order, v_half_order, v_zb_order])
@pytest.mark.parametrize(("d", "m"), [(1, 4), (0, 4), (4, 0), (4, -1), (2.5, 4), (4, 2.5), (True, 4)])
def test_bad_sizes(gen, d, m):
    with pytest.raises(ValueError):
        gen(d, m)


@pytest.mark.parametrize(("d", "m"), [(1, 4), (4, 0)])
def test_adaptive_bad_sizes(d, m):
    with pytest.raises(ValueError):
        adaptive_v_order(d, m, 0.5)


@pytest.mark.parametrize("limit", [0, 0.0, -0.5, 1.5, "x", None, True])
def test_bad_memory_limit(limit):
    with pytest.raises((TypeError, ValueError), match="memory_limit"):
        adaptive_v_order(3, 6, limit)


@pytest.mark.parametrize(
    ("costs", "message"),
    [
        ({"F": -1.0}, "must be > 0"),
        ({"I": 0}, "must be > 0"),
        ({"comm": -0.5}, "comm"),
        ({"X": 1.0}, "unknown cost keys"),
        ({"F": 1, "B": 2}, "unknown cost keys"),
    ],
)
@pytest.mark.parametrize("gen", [v_half_order, lambda d, m, c: adaptive_v_order(d, m, 0.5, c)])
def test_bad_costs(gen, costs, message):
    with pytest.raises(ValueError, match=message):
        gen(3, 6, costs)


def test_costs_must_be_a_mapping():
    with pytest.raises(TypeError):
        v_half_order(3, 6, "fast")


# --- 1F1B baseline ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("d", "m"), [(1, 3), (2, 1), (3, 2), (4, 4), (4, 9)])
def test_one_f_one_b_order(d, m):
    order = one_f_one_b_order(d, m)
    for rank, actions in order.items():
        assert Counter(actions) == Counter(Action(rank, k, j) for k in "FB" for j in range(m))
        forwards = min(d - rank, m)  # warm-up plus the first steady-phase forward
        assert [a.computation_type for a in actions[: forwards + 1]] == ["F"] * forwards + ["B"]
        assert actions[forwards] == Action(rank, "B", 0)
    if d > 1:
        compat.lower_order_offline(order, m)
    assert simulate(order).peak == 2 * min(d, m)


def test_one_f_one_b_matches_torch_except_its_misnumbered_last_rank():
    d, m = 4, 8
    torch_ops = compat.schedule_ops("1F1B", d, m)
    ours = one_f_one_b_order(d, m)
    for rank in range(d - 1):
        assert [str(a) for a in torch_ops[rank] if a is not None and a.is_compute_op] == [
            str(a) for a in ours[rank]
        ]
    assert [str(a) for a in ours[d - 1][:2]] == ["3F0", "3B0"]


@pytest.mark.parametrize(("d", "m"), [(0, 2), (2, 0), (2.0, 2)])
def test_one_f_one_b_bad_sizes(d, m):
    with pytest.raises(ValueError):
        one_f_one_b_order(d, m)


# --- compaction -------------------------------------------------------------------------------------


def _torch_as_ours(name: str, d: int, m: int) -> dict[int, list[Action]]:
    ops = compat.schedule_ops(name, d, m, 2)
    return {r: [Action(*p) for p in flatten(actions)] for r, actions in enumerate(ops)}


def _compaction_cases():
    d, m = 4, 8
    # the paper's V-Min (offsets 1/1) and V-Half (2/1) building blocks, repeated but not squeezed
    yield "block 1/1", v_block(d, down=[1] * (d - 1), backward_delay=1, turn_f=1, turn_b=1).repeat(m)
    yield "block 2/1", v_block(d, down=[2] * (d - 1), backward_delay=4, turn_f=1, turn_b=2).repeat(m)
    yield "greedy", greedy_v_order(3, 6, costs=UNIT, memory_cap=4, policy=GreedyPolicy())
    yield "1F1B", one_f_one_b_order(d, m)
    yield "torch ZBV", _torch_as_ours("ZBVZeroBubble", 3, 6)
    # a deliberately lazy order: every rank saves its W passes for the end (valid, nothing waits on W)
    lazy = v_half_order(3, 6)
    yield (
        "lazy W",
        {
            r: [a for a in acts if a.computation_type != "W"] + [a for a in acts if a.computation_type == "W"]
            for r, acts in lazy.items()
        },
    )


_COMPACTION_CASES = list(_compaction_cases())


@pytest.mark.parametrize("costs", [UNIT, SKEWED, Costs(comm=0.5)], ids=["unit", "3:4:2", "comm"])
@pytest.mark.parametrize("order", [o for _, o in _COMPACTION_CASES], ids=[n for n, _ in _COMPACTION_CASES])
def test_compaction_never_slower_never_bigger(order, costs):
    before = simulate(order, costs)
    packed = compact(order, costs)
    after = simulate(packed, costs)
    assert after.makespan <= before.makespan + 1e-9
    for rank in order:
        assert after.peak_memory[rank] <= before.peak_memory[rank] + 1e-9, rank
        assert Counter(packed[rank]) == Counter(order[rank])
        for lane in {(a.stage_index, a.computation_type) for a in order[rank]}:
            assert _lane(packed[rank], lane) == _lane(order[rank], lane)


def test_compaction_fills_gaps():
    """The lazy-W order leaves W passes idle at the end: compaction must pull some into gaps."""
    order = dict(_COMPACTION_CASES)["lazy W"]
    assert simulate(compact(order, UNIT), UNIT).makespan < simulate(order, UNIT).makespan
