"""Offload policies and plans: parsing and errors, auto mode from k, and OFFLOAD/RELOAD placement on our
V orders and torch's orders (one of each per offloaded chunk, in valid positions, replayable)."""

from __future__ import annotations

import pytest

from pp_offload.order import Action, Costs, v_half_order, v_min_order, v_zb_order
from pp_offload.order.actions import OFFLOAD, RELOAD
from pp_offload.order.baselines import one_f_one_b_order
from pp_offload.order.offload import (
    OffloadPlan,
    OffloadPolicy,
    auto_from_measurements,
    auto_offload,
    plan_offload,
    resolve_offload,
    transfer_compute_ratio,
)
from pp_offload.runtime import compat
from pp_offload.sim import OffloadOrderError, flatten, simulate

COSTS = Costs(transfer=0.5)


def _torch(name: str, d: int, m: int) -> dict[int, list]:
    return dict(enumerate(compat.schedule_ops(name, d, m, 2)))


ORDERS = {
    "v-min": lambda: v_min_order(4, 8),
    "v-half": lambda: v_half_order(4, 8),
    "v-zb": lambda: v_zb_order(3, 6),
    "1f1b": lambda: one_f_one_b_order(4, 8),
    "interleaved1f1b": lambda: _torch("Interleaved1F1B", 4, 8),
    "zbv": lambda: _torch("ZBVZeroBubble", 4, 8),
    "dualpipev": lambda: _torch("DualPipeV", 4, 8),
}


def _kind(a) -> str:
    return str(getattr(a.computation_type, "value", a.computation_type))


def _check_plan(source, plan: OffloadPlan) -> None:
    """Every offloaded chunk has one OFFLOAD right after its F and one RELOAD after that OFFLOAD and before
    the chunk's first backward, and, where its W runs well after its I (drop_after_i), a second OFFLOAD
    right after the I and a second RELOAD between it and the W; nothing else is transferred; compute
    passes keep their order."""
    for rank, actions in plan.order.items():
        assert flatten(actions) == flatten(source[rank])  # compute untouched
        chosen = set(plan.offloaded[rank])
        assert len(chosen) == len(plan.offloaded[rank])
        transfers = [(i, a) for i, a in enumerate(actions) if a.computation_type in (OFFLOAD, RELOAD)]
        keys = [(a.stage_index, a.microbatch_index) for _, a in transfers]
        assert set(keys) == chosen
        for stage, mb in chosen:
            pos = {i: a for i, a in enumerate(actions) if (a.stage_index, a.microbatch_index) == (stage, mb)}
            kinds = [(i, a.computation_type) for i, a in sorted(pos.items())]
            offloads = [i for i, k in kinds if k == OFFLOAD]
            reloads = [i for i, k in kinds if k == RELOAD]
            assert len(offloads) == len(reloads) and len(offloads) in (1, 2), (stage, mb, kinds)
            f_index = next(i for i, k in kinds if k == "F")
            first_backward = next(i for i, k in kinds if k in ("I", "B", "W"))
            assert offloads[0] == f_index + 1  # right after its F
            assert offloads[0] < reloads[0] < first_backward
            if len(offloads) == 2:  # dropped after I, reloaded for W
                i_index = next(i for i, k in kinds if k == "I")
                w_index = next(i for i, k in kinds if k == "W")
                assert offloads[1] == i_index + 1 and offloads[1] < reloads[1] < w_index, (stage, mb, kinds)


@pytest.mark.parametrize("name", sorted(ORDERS))
@pytest.mark.parametrize("policy", ["full", "selective:0.5", {"mode": "selective", "count": 3}, "auto"])
def test_plans_are_valid_on_every_order(name, policy):
    source = ORDERS[name]()
    plan = plan_offload(source, COSTS, policy)
    source = dict(enumerate(source)) if isinstance(source, list) else source
    _check_plan(source, plan)
    assert any(plan.offloaded.values())
    replay = simulate(plan.order, COSTS, copy_lanes=plan.policy.lanes)  # no deadlock, no misplaced copy
    assert replay.makespan == plan.sim.makespan
    base = simulate(source, COSTS)
    # transfer = 0.5 F hides behind compute: no slower, and never more device memory
    assert replay.makespan <= base.makespan * 1.02
    assert replay.peak <= base.peak


@pytest.mark.parametrize("name", ["v-half", "v-min-6", "interleaved1f1b", "zbv", "1f1b"])
def test_full_offload_lowers_the_device_peak(name):
    source = v_min_order(6, 12) if name == "v-min-6" else ORDERS[name]()  # V-Min on 4 ranks holds 4 already
    plan = plan_offload(source, COSTS, "full")
    base = simulate(dict(enumerate(source)) if isinstance(source, list) else source, COSTS)
    assert plan.sim.peak < base.peak
    assert plan.sim.total_reload_wait == 0.0


def test_full_offload_on_interleaved_1f1b_stays_at_four_chunks():
    source = _torch("Interleaved1F1B", 8, 16)
    plan = plan_offload(source, COSTS, "full")
    assert simulate(source, COSTS).peak == 23.0
    assert plan.sim.peak <= 4.0
    assert plan.sim.makespan == simulate(source, COSTS).makespan


@pytest.mark.parametrize("policy", ["none", None, 0.0, "selective:0", {"count": 0}])
def test_nothing_offloaded_means_no_actions(policy):
    source = v_half_order(3, 6)
    plan = plan_offload(source, COSTS, policy)
    assert plan.order == source
    assert plan.offloaded == {r: [] for r in source}
    assert plan.sim.peak == simulate(source, COSTS).peak


def test_fraction_counts_chunks_per_rank():
    source = v_half_order(3, 6)  # 12 chunks per rank
    plan = plan_offload(source, COSTS, "selective:0.25")
    eligible = plan_offload(source, COSTS, "full").offloaded
    for rank in source:
        assert len(plan.offloaded[rank]) == min(3, len(eligible[rank]))
    plan = plan_offload(source, COSTS, {"count": 2})
    assert all(len(chunks) == 2 for chunks in plan.offloaded.values())


def _lifespans(order, costs) -> dict[int, dict[tuple[int, int], float]]:
    result = simulate(order, costs)
    out: dict[int, dict[tuple[int, int], float]] = {}
    for rank, entries in result.timeline.items():
        start, end = {}, {}
        for (stage, kind, mb), s, e in entries:
            if kind == "F":
                start[(stage, mb)] = s
            if kind in ("W", "B"):
                end[(stage, mb)] = e
        out[rank] = {key: end[key] - start[key] for key in start}
    return out


def test_lifespan_rule_takes_the_longest_lived_first():
    source = _torch("Interleaved1F1B", 4, 8)
    lifespans = _lifespans(source, COSTS)
    plan = plan_offload(source, COSTS, {"mode": "selective", "count": 4, "choose": "lifespan"})
    for rank, chosen in plan.offloaded.items():
        spans = sorted(lifespans[rank].values(), reverse=True)
        assert sorted((lifespans[rank][c] for c in chosen), reverse=True) == spans[:4]


def test_peak_rule_lowers_the_peak_better_than_linear_on_interleaved_1f1b():
    source = _torch("Interleaved1F1B", 8, 32)
    base = simulate(source, COSTS).peak
    half = plan_offload(source, COSTS, "selective:0.5").sim.peak
    assert half < base / 2  # 23 -> 11: half the chunks offloaded, more than half the peak gone
    peaks = [plan_offload(source, COSTS, f).sim.peak for f in (0.125, 0.25, 0.5, 0.75)]
    assert peaks == sorted(peaks, reverse=True)
    lifespan_rule = plan_offload(source, COSTS, {"fraction": 0.25, "choose": "lifespan"}).sim.peak
    assert peaks[1] <= lifespan_rule


def test_short_lived_chunks_are_skipped():
    source = v_half_order(3, 6)
    assert not any(plan_offload(source, COSTS, {"mode": "full", "min_lifespan": 1e6}).offloaded.values())
    # the last stage's F is followed by its own I: no window to copy anything
    plan = plan_offload(source, COSTS, "full")
    assert all(stage != 5 for stage, _ in plan.offloaded[0])


def test_reload_lead_counts_compute_passes():
    source = v_half_order(3, 6)
    plan = plan_offload(source, COSTS, {"mode": "full", "reload_lead": 0})
    for actions in plan.order.values():
        for i, a in enumerate(actions):
            if a.computation_type == RELOAD:
                nxt = actions[i + 1 :]
                first = next(b for b in nxt if b.computation_type not in (OFFLOAD, RELOAD))
                if (first.stage_index, first.microbatch_index) != (a.stage_index, a.microbatch_index):
                    # only when the window is too short: then the reload sits right after its offload
                    assert actions[i - 1] == Action(a.stage_index, OFFLOAD, a.microbatch_index)


def test_default_reload_keeps_a_backward_of_margin():
    source = v_half_order(4, 8)
    plan = plan_offload(source, COSTS, "full")
    second = 0
    for rank, transfers in plan.sim.transfers.items():
        starts = {(s, mb): (b, e) for (s, k, mb), b, e in plan.sim.timeline[rank] if k in ("I", "B")}
        w_starts = {(s, mb): (b, e) for (s, k, mb), b, e in plan.sim.timeline[rank] if k == "W"}
        seen = set()
        for action, _, end in transfers:
            if action.computation_type == RELOAD:
                key = (action.stage_index, action.microbatch_index)
                # the first RELOAD is for the chunk's I (or B); a second one, after a drop, for its W
                b_start, b_end = (w_starts if key in seen else starts)[key]
                second += key in seen
                seen.add(key)
                assert end <= b_start - (b_end - b_start) + 1e-9
    assert second > 0  # V-Half's cool-down keeps chunks from I to W: some are dropped and reloaded


def test_removed_reload_fails_naming_the_chunk():
    plan = plan_offload(v_half_order(3, 6), COSTS, "full")
    rank, (stage, mb) = next((r, c[0]) for r, c in plan.offloaded.items() if c)
    broken = dict(plan.order)
    broken[rank] = [a for a in plan.order[rank] if a != Action(stage, RELOAD, mb)]
    with pytest.raises(OffloadOrderError, match=f"stage {stage}, microbatch {mb}"):
        simulate(broken, COSTS)


def test_plan_refuses_an_order_with_transfers():
    plan = plan_offload(v_half_order(3, 6), COSTS, "full")
    with pytest.raises(ValueError, match="compute-only order"):
        plan_offload(plan.order, COSTS, "full")


def test_shared_lane_plans_replay_with_a_shared_lane():
    source = _torch("Interleaved1F1B", 4, 8)
    plan = plan_offload(source, Costs(transfer=1.0), {"mode": "full", "lanes": "shared"})
    assert plan.policy.lanes == "shared"
    assert simulate(plan.order, Costs(transfer=1.0), copy_lanes="shared").makespan == plan.sim.makespan


# --- policies ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "mode", "fraction", "count"),
    [
        (None, "none", None, None),
        (False, "none", None, None),
        ("none", "none", None, None),
        (True, "full", None, None),
        ("full", "full", None, None),
        ("FULL", "full", None, None),
        ("selective", "selective", 0.5, None),
        ("selective:0.25", "selective", 0.25, None),
        (0.75, "selective", 0.75, None),
        ({"count": 2}, "selective", None, 2),
        ({"fraction": 0.3}, "selective", 0.3, None),
        ({"mode": "full", "lanes": "shared"}, "full", None, None),
        ("auto", "auto", None, None),
    ],
)
def test_resolve_offload(value, mode, fraction, count):
    policy = resolve_offload(value)
    assert (policy.mode, policy.fraction, policy.count) == (mode, fraction, count)
    assert resolve_offload(policy) is policy


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (1.5, ValueError, r"fraction must be a number in \[0, 1\].*got 1.5"),
        (-0.1, ValueError, r"fraction must be a number in \[0, 1\]"),
        ("selective:2", ValueError, r"fraction must be a number in \[0, 1\]"),
        ("selective:abc", ValueError, "cannot read the fraction"),
        ("sometimes", ValueError, "unknown offload setting 'sometimes'"),
        (3, TypeError, "ambiguous.*'count': 3"),
        ([0.5], TypeError, "offload must be"),
        ({"count": -1}, ValueError, "count must be an integer >= 0"),
        ({"count": 1.5}, ValueError, "count must be an integer >= 0"),
        ({"fraction": 0.5, "count": 2}, ValueError, "either an offload fraction or a count, not both"),
        ({"mode": "full", "fraction": 0.5}, ValueError, "takes no fraction or count"),
        ({"mode": "often"}, ValueError, "unknown offload mode 'often'"),
        ({"mode": "full", "lanes": "simplex"}, ValueError, "lanes must be 'duplex'.*'shared'"),
        ({"mode": "full", "reload_lead": -1}, ValueError, "reload_lead must be an integer >= 0"),
        ({"mode": "full", "reload_margin": -1}, ValueError, "reload_margin must be a number >= 0"),
        ({"mode": "full", "min_lifespan": -2}, ValueError, "min_lifespan must be a number >= 0"),
        ({"mode": "full", "choose": "random"}, ValueError, "choose must be 'peak'"),
        ({"mode": "full", "k": 1.0}, ValueError, "belongs to mode='auto'"),
        ({"mode": "auto", "fraction": 0.5}, ValueError, "derives the fraction from k"),
        ({"mode": "auto", "count": 2}, ValueError, "use mode='selective' to give a count"),
        ({"colour": "red"}, ValueError, r"unknown offload policy keys \['colour'\]"),
    ],
)
def test_bad_policies_are_clear_errors(value, error, match):
    with pytest.raises(error, match=match):
        resolve_offload(value)


# --- auto ---------------------------------------------------------------------------------------------


def test_transfer_compute_ratio_matches_the_paper():
    # h=8192, s=4096 on an A100 (220 TFLOP/s, 15 GB/s): k = 0.92
    assert transfer_compute_ratio(8192, 4096, 220e12, 15e9) == pytest.approx(0.918, abs=1e-3)
    with pytest.raises(ValueError, match="host_bandwidth_bytes_per_s must be a finite number > 0"):
        transfer_compute_ratio(8192, 4096, 220e12, 0)


@pytest.mark.parametrize(("k", "fraction"), [(0.0, 1.0), (0.5, 1.0), (1.0, 1.0), (2.0, 0.5), (4.0, 0.25)])
def test_auto_share_from_k(k, fraction):
    policy = auto_offload(k)
    assert (policy.mode, policy.k, policy.fraction) == ("auto", k, fraction)


def test_auto_shared_lane_counts_k_double():
    assert auto_offload(0.5, lanes="shared").fraction == 1.0
    assert auto_offload(1.0, lanes="shared").fraction == 0.5


def test_auto_from_measurements():
    assert auto_from_measurements(0.001, 0.010).fraction == 1.0  # k = 0.2
    policy = auto_from_measurements(0.030, 0.020)  # k = 3
    assert policy.k == pytest.approx(3.0) and policy.fraction == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="compute_s_per_chunk must be a finite number > 0"):
        auto_from_measurements(0.01, 0)


def test_auto_plan_derives_k_from_costs():
    source = _torch("Interleaved1F1B", 4, 8)
    small = plan_offload(source, Costs(transfer=0.5), "auto")  # k = 2 * 0.5 / 3
    assert small.policy.k == pytest.approx(1 / 3) and small.policy.fraction == 1.0
    assert small.offloaded == plan_offload(source, Costs(transfer=0.5), "full").offloaded
    large = plan_offload(source, Costs(transfer=6.0), "auto")  # k = 4
    assert large.policy.k == pytest.approx(4.0) and large.policy.fraction == pytest.approx(0.25)
    assert 0 < sum(map(len, large.offloaded.values())) < sum(map(len, small.offloaded.values()))


def test_policy_is_frozen_and_documented():
    policy = OffloadPolicy("full")
    with pytest.raises(AttributeError):
        policy.mode = "none"  # type: ignore[misc]
    assert "longest-lived" in OffloadPolicy.__doc__


def test_selective_share_counts_the_gap_a_drop_after_i_opens():
    """V-ZB keeps every chunk from its I to its W: half the chunks offloaded only up to I cut nothing
    (the peak sits in that span), while the peak-first choice that also counts each chunk's second gap
    (dropped after I, reloaded for W) cuts it by a quarter, at the same makespan."""
    source = v_zb_order(4, 16)
    base = simulate(source, COSTS)
    kept = plan_offload(source, COSTS, {"mode": "selective", "fraction": 0.5, "drop_after_i": False})
    dropped = plan_offload(source, COSTS, "selective:0.5")
    assert kept.sim.peak == base.peak == 8.0
    assert dropped.sim.peak <= 6.0 and dropped.sim.makespan == base.makespan
    _check_plan(source, dropped)
