"""The adaptive V search: monotone in the memory limit, within its bounds, its pieces (lean replay, the
cool-down rewrite) exact,. Offline, no processes."""

from __future__ import annotations

from collections import Counter

import pytest

from pp_offload.order import Action, Costs, adaptive_v_order, v_half_order, v_min_order, v_stages, v_zb_order
from pp_offload.order.blocks import v_block
from pp_offload.order.cooldown import diagonal_cooldown
from pp_offload.order.greedy import GreedyPolicy, greedy_v_order
from pp_offload.order.replay import is_v_order, replay, replay_ranks
from pp_offload.order.rhythm import rhythm_v_order
from pp_offload.order.vshape import one_f_one_b_peak, v_half_cap, v_min_cap
from pp_offload.runtime import compat
from pp_offload.sim import OrderDeadlockError, simulate

UNIT = Costs()
SKEWED = Costs(F=3.0, I=4.0, W=2.0)
COMM = Costs(F=1.0, I=1.5, W=0.5, comm=0.3)


def _sample_orders():
    """Orders of every family the search builds, including ones that deadlock."""
    for d, m in ((2, 4), (3, 5), (4, 8), (5, 10)):
        yield f"V-Half d={d}", v_block(d, down=[2] * (d - 1), backward_delay=4, turn_f=1, turn_b=2).repeat(m)
        yield (
            f"mixed d={d}",
            v_block(d, down=[3] + [1] * (d - 2), backward_delay=2, turn_f=1, turn_b=1).repeat(m),
        )
        for trim in (0, d):
            yield f"rhythm d={d} trim={trim}", rhythm_v_order(d, m, trim)
        order = greedy_v_order(
            d, m, costs=SKEWED, memory_cap=d, policy=GreedyPolicy(1, False, True, False, True)
        )
        if order is not None:
            yield f"greedy d={d}", order


SAMPLES = list(_sample_orders())


@pytest.mark.parametrize("costs", [UNIT, SKEWED, COMM], ids=["unit", "3:4:2", "comm"])
def test_replay_agrees_with_the_simulator(costs):
    for name, order in SAMPLES:
        assert is_v_order(order)
        try:
            full = simulate(order, costs)
        except OrderDeadlockError:
            with pytest.raises(OrderDeadlockError):
                replay(order, costs)
            continue
        makespan, peaks = replay_ranks(order, costs)
        assert makespan == pytest.approx(full.makespan, abs=1e-9), name
        assert peaks == [full.peak_memory[r] for r in range(len(order))], name


def test_replay_times_each_stage_with_its_own_costs():
    order = v_min_order(3, 6)
    costs = Costs(stages=[(1.0 + s / 10, 1.0, 0.5 + s / 20) for s in range(6)])
    assert replay(order, costs)[0] == pytest.approx(simulate(order, costs).makespan, abs=1e-9)


def test_is_v_order_rejects_what_replay_does_not_model():
    assert not is_v_order({0: [Action(0, "B", 0)], 1: []})
    assert not is_v_order({0: [Action(1, "F", 0)], 1: []})  # stage 1 lives on rank 1 in V placement


@pytest.mark.parametrize(("name", "order"), SAMPLES, ids=[n for n, _ in SAMPLES])
def test_cooldown_keeps_every_pass_and_lane_order(name, order):
    try:
        replay(order, UNIT)
    except OrderDeadlockError:
        assert diagonal_cooldown(order) is None
        return
    cooled = diagonal_cooldown(order)
    assert cooled is not None
    d = len(order)
    for rank in range(d):
        assert Counter(cooled[rank]) == Counter(order[rank]), name
        for stage in v_stages(rank, d):
            for kind in "FIW":
                lane = [
                    a.microbatch_index
                    for a in cooled[rank]
                    if (a.stage_index, a.computation_type) == (stage, kind)
                ]
                assert lane == sorted(lane), (name, rank, stage, kind)


def test_cooldown_interleaves_the_drain_and_shortens_v_half():
    """V-Half's drain at d=8 (unit costs): the rewrite is where most of the gain over the plain pattern is."""
    d, m = 8, 24
    order = v_block(d, down=[2] * (d - 1), backward_delay=4, turn_f=1, turn_b=2).repeat(m)
    cooled = diagonal_cooldown(order)
    before, after = replay(order, UNIT), replay(cooled, UNIT)
    assert after[0] < before[0]
    assert after[1] <= before[1] + 1  # the drain holds back W passes, at most one more chunk alive
    # the last rank ends on alternating input gradients of its two chunks, weight passes after them
    tail = [a.computation_type for a in cooled[d - 1][-2 * d :]]
    assert tail[-1] == "W"


# --- the search ---------------------------------------------------------------------------------------

GRID = [(2, 4, UNIT), (3, 6, SKEWED), (4, 8, UNIT), (4, 8, SKEWED), (4, 16, COMM)]


@pytest.mark.parametrize(
    ("d", "m", "costs"), GRID, ids=[f"d{d}m{m}-{c.F:g}:{c.I:g}:{c.W:g}" for d, m, c in GRID]
)
def test_bubble_never_grows_with_the_limit(d, m, costs):
    reference = one_f_one_b_peak(d, m)
    last = None
    for cap in range(2, reference + 1):
        order = adaptive_v_order(d, m, cap / reference, costs)
        result = simulate(order, costs)
        assert result.peak <= cap + 1e-9, cap
        if last is not None:
            assert result.makespan <= last + 1e-9, f"limit {cap} is slower than limit {cap - 1}"
        last = result.makespan
    # the named schedules are points on the same curve
    for gen, cap in ((v_min_order, v_min_cap(d)), (v_half_order, v_half_cap(d)), (v_zb_order, 2 * d)):
        order = gen(d, m, costs)
        assert simulate(order, costs).peak <= cap + 1e-9
        if cap <= reference:
            best = simulate(adaptive_v_order(d, m, cap / reference, costs), costs).makespan
            assert simulate(order, costs).makespan == pytest.approx(best)


@pytest.mark.parametrize("limit", [0.375, 0.5, 0.625, 0.875])
def test_adaptive_orders_lower_through_torch(limit):
    d, m = 4, 8
    order = adaptive_v_order(d, m, limit, SKEWED)
    lowered = compat.lower_order_offline(order, m)
    for rank in range(d):
        assert [str(a) for a in lowered[rank] if a.is_compute_op] == [str(a) for a in order[rank]]


# --- disk cache ---------------------------------------------------------------------------------------


def test_disk_cache_returns_the_searched_order(tmp_path, monkeypatch):
    from pp_offload.order import cache, vshape

    monkeypatch.setenv(cache.ENV, str(tmp_path))
    first = adaptive_v_order(3, 6, 0.75, SKEWED)
    assert len(list(tmp_path.glob("v-order-*.json"))) == 1

    def no_search(*args):
        raise AssertionError("the cached order should have been used")

    monkeypatch.setattr(vshape, "_search", no_search)
    assert adaptive_v_order(3, 6, 0.75, SKEWED) == first
    assert adaptive_v_order(3, 6, 0.8, SKEWED) == first  # 4.5 and 4.8 chunk units: the same whole cap
    (next(tmp_path.glob("v-order-*.json"))).write_text("not json")
    with pytest.raises(AssertionError, match="cached order"):  # a bad entry is ignored: searched again
        adaptive_v_order(3, 6, 0.75, SKEWED)


def test_cache_is_on_by_default_and_can_be_moved_or_disabled(tmp_path, monkeypatch):
    from pp_offload.order import cache

    monkeypatch.delenv(cache.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_dir() == tmp_path / "xdg" / "pp_offload" / "orders"
    order = adaptive_v_order(2, 4, 0.75)
    assert len(list((tmp_path / "xdg").rglob("v-order-*.json"))) == 1
    assert cache.load(2, 4, Costs(), 3) == order
    for off in ("off", "0", ""):
        monkeypatch.setenv(cache.ENV, off)
        assert cache.cache_dir() is None
        assert cache.load(2, 4, Costs(), 3) is None
    monkeypatch.setenv(cache.ENV, str(tmp_path / "moved"))
    adaptive_v_order(2, 4, 0.75)
    assert len(list((tmp_path / "moved").glob("v-order-*.json"))) == 1


def test_cache_survives_an_unwritable_directory(tmp_path, monkeypatch):
    from pp_offload.order import cache

    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv(cache.ENV, str(blocker / "orders"))
    assert adaptive_v_order(2, 4, 0.75) == adaptive_v_order(2, 4, 0.75)  # searched, not cached, no error
    assert not list(tmp_path.rglob("*.tmp"))


# --- lengthening an order by its steady phase -------------------------------------------------------


@pytest.mark.parametrize(("d", "short", "m"), [(3, 9, 10), (4, 12, 20), (8, 24, 40)])
def test_extend_repeats_the_steady_phase(d, short, m):
    from pp_offload.order.extend import extend_order

    block = v_block(d, down=[2] * (d - 1), backward_delay=4, turn_f=1, turn_b=2)
    assert extend_order(block.repeat(short), m - short) == block.repeat(m)
    assert extend_order(rhythm_v_order(d, short), m - short) == rhythm_v_order(d, m)
    assert extend_order(block.repeat(short), 0) == block.repeat(short)


def test_extend_refuses_an_order_without_a_steady_phase():
    from pp_offload.order.extend import extend_order

    block = v_block(4, down=[2] * 3, backward_delay=4, turn_f=1, turn_b=2)
    assert extend_order(block.repeat(2), 5) is None  # two microbatches: all warm-up and drain
    with pytest.raises(ValueError, match="extra must be >= 0"):
        extend_order(block.repeat(8), -1)


def test_search_lengthens_compacted_orders_within_the_cap():
    # m = 40 > the compaction horizon: every returned order was lengthened (or rebuilt), never above its cap
    d, m = 4, 40
    reference = one_f_one_b_peak(d, m)
    for cap in (4, 6, 8):
        order = adaptive_v_order(d, m, cap / reference, SKEWED)
        assert sorted(Counter(a.stage_index for a in order[0]).values()) == [3 * m, 3 * m]
        assert simulate(order, SKEWED).peak <= cap


# --- the warm-up rewrite ----------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "order"), SAMPLES, ids=[n for n, _ in SAMPLES])
def test_warmup_keeps_every_pass_and_lane_order(name, order):
    from pp_offload.order.warmup import warmup_rewrite

    warmed = warmup_rewrite(order)
    assert warmed is not None
    d = len(order)
    for rank in range(d):
        assert Counter(warmed[rank]) == Counter(order[rank]), name
        for stage in v_stages(rank, d):
            for kind in "FIW":
                lane = [
                    a.microbatch_index
                    for a in warmed[rank]
                    if (a.stage_index, a.computation_type) == (stage, kind)
                ]
                assert lane == sorted(lane), (name, rank, stage, kind)


def test_warmup_rewrite_reaches_the_reference_at_d4_limit5():
    # issue 14's reference value for d=4, m=16, unit costs, 5 chunk units: 7.7% (8.6% without the rewrite)
    order = adaptive_v_order(4, 16, 5 / 8, UNIT)
    result = simulate(order, UNIT)
    assert result.peak <= 5
    assert round(100 * result.bubble, 1) <= 7.7
