"""The lowest peak within a step-time allowance (`pp_offload.plan.within`) and the host link's bound on a
target peak (`pp_offload.plan.link_bound`), offline on the planner's Llama-3-8B figures."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pp_offload.plan.evaluate import combine, evaluate_orders, offload_plan
from pp_offload.plan.link_bound import link_bound, most_off_device
from pp_offload.plan.machines import resolve_machine
from pp_offload.plan.shapes import SHAPES
from pp_offload.plan.within import lowest_peak_within, plan_shares
from pp_offload.recompute_plan import parse_recompute
from pp_offload.sim import simulate

LLAMA_8B = SHAPES["llama-3-8b"]
SETTING = {"pp": 2, "seq_len": 4096, "microbatch_size": 1, "num_microbatches": 4, "machine": "H100"}
H100_BW = resolve_machine("H100").host_bandwidth


def test_plan_shares_are_the_distinct_plans_a_split_expresses():
    assert plan_shares("mlp", [4, 4]) == ["mlp"]
    assert plan_shares("selective:S", [4, 4]) == [
        "selective:0.25",
        "selective:0.5",
        "selective:0.75",
        "selective",
    ]
    # stages of 2 and 3 layers: 1/3 and 1/2 both give one layer of 2, two different plans on 3-layer stages
    mixed = plan_shares("selective:S,mlp", [2, 3, 3, 2])
    assert mixed == ["selective:0.333333,mlp", "selective:0.5,mlp", "selective:0.666666,mlp", "selective"]
    modes = [tuple(parse_recompute(p).modes(3)) + tuple(parse_recompute(p).modes(2)) for p in mixed]
    assert len(set(modes)) == len(modes)


def test_most_off_device_is_the_two_lane_maximum():
    # one chunk of 10 bytes ready at 0, needed back by 10, at t = 5 with 1 byte/s: 5 out by t, 5 back by 10
    one = most_off_device(5.0, np.array([10.0]), np.array([0.0]), np.array([10.0]), 1.0, 0.0)
    assert one == pytest.approx(5.0)
    # A (ready 0, due 6) can only be 1 off (1 s of the lane back before 6); B (ready 4) only 1 (1 s out)
    two = most_off_device(5.0, np.array([10.0, 10.0]), np.array([0.0, 4.0]), np.array([6.0, 20.0]), 1.0, 0.0)
    assert two == pytest.approx(2.0)
    # an infinitely fast link: everything live can be off; slack adds time to both lanes
    assert most_off_device(5.0, np.array([10.0, 3.0]), np.zeros(2), np.full(2, 9.0), math.inf, 0.0) == 13.0
    slack = most_off_device(5.0, np.array([10.0]), np.array([0.0]), np.array([10.0]), 1.0, 2.0)
    assert slack == pytest.approx(7.0)


@pytest.mark.parametrize("schedule", ["ScheduleVHalf", "ScheduleInterleaved1F1B"])
def test_link_bound_never_rules_out_a_peak_an_offload_plan_reached(schedule):
    """Soundness on real planner figures: budget offload's achieved peak (within 3% and every layer each
    window hides) is never declared out of reach (need/can <= 1 at that target, with the plan's extra
    step time as slack); a target above the plain peak needs nothing; a target far below it is out of
    reach; a faster link never makes the bound worse."""
    found = lowest_peak_within(
        LLAMA_8B, schedule=schedule, slowdown=0.0, families=("none",), offload=False, **SETTING
    )
    setup, orders = found.setups["none"], found.orders["none"]
    order = orders.orders[orders.sizes[-1]]
    sim = simulate(order, setup.costs)
    stage_bytes = setup.offload_inputs().stage_bytes
    plain_peak = found.base.peak
    for policy in ("budget", "budget:1"):
        reached = combine(evaluate_orders(setup, orders, policy), SETTING["num_microbatches"])
        peak = max(reached["activation"])
        assert peak < plain_peak  # offload moved something
        slack = reached["makespan"] - found.base.step_s
        bound = link_bound(sim, stage_bytes, target=peak, bandwidth=H100_BW, slack=max(slack, 0.0))
        assert bound.ratio <= 1.0 + 1e-9, (policy, bound)
    assert link_bound(sim, stage_bytes, target=plain_peak, bandwidth=H100_BW).ratio == 0.0
    low = link_bound(sim, stage_bytes, target=0.05 * plain_peak, bandwidth=H100_BW, slack=0.01)
    assert low.ratio > 1.0 and low.need == pytest.approx(low.live - 0.05 * plain_peak, abs=1)
    faster = link_bound(sim, stage_bytes, target=0.05 * plain_peak, bandwidth=10 * H100_BW, slack=0.01)
    assert faster.ratio < low.ratio
    # the peak's first chunk cannot have left at its own forward's start: without slack, out of reach
    first = link_bound(sim, stage_bytes, target=0.05 * plain_peak, bandwidth=H100_BW)
    assert first.ratio == math.inf and first.time_s == 0.0
    plan = offload_plan(setup, order, "budget")
    assert plan.sim.makespan >= sim.makespan - 1e-9  # the slack is the plan's own extra time


def test_lowest_peak_within_searches_each_family_and_respects_the_allowance():
    found = lowest_peak_within(LLAMA_8B, schedule="ScheduleVHalf", slowdown=0.10, **SETTING)
    best = found.best
    assert best.step_s <= found.base.step_s * 1.10 * (1 + 1e-9)
    assert all(best.peak <= r.peak for r in found.rows if found.fits(r))
    assert best.peak < found.base.peak
    labels = {r.recompute for r in found.rows}
    # every share of the 16-layer stages' families was replayed alone (stages hold 7 or 8 layers here)
    assert {"mlp", "selective", "selective:0.5,mlp", "full"} <= labels
    # offload trials only with the room a plan leaves, or ruled out by the link bound
    for r in found.rows:
        if r.offload != "none":
            alone = found.alone(r.recompute)
            assert r.room == pytest.approx(found.limit_s / alone.step_s - 1.0)
    for label, ratio in found.pruned.items():
        assert ratio > 1.0 and not any(r.recompute == label and r.offload != "none" for r in found.rows)
    # without pruning, no pruned plan's offload trial gets below the best
    full = lowest_peak_within(LLAMA_8B, schedule="ScheduleVHalf", slowdown=0.10, prune=False, **SETTING)
    assert full.best.peak == best.peak
    with pytest.raises(ValueError, match="slowdown"):
        lowest_peak_within(LLAMA_8B, schedule="ScheduleVHalf", slowdown=-0.1, **SETTING)


def test_cli_within_prints_and_writes_the_search(tmp_path, capsys):
    """``pp-offload plan --within 0.1``: the same search per schedule, its table and JSON."""
    import json

    from pp_offload.__main__ import main

    out = tmp_path / "within.json"
    argv = ["plan", "--model", "llama-3-8b", "--seq-len", "4096", "--microbatches", "4", "--pp", "2"]
    code = main([*argv, "--within", "0.1", "--schedules", "ScheduleVHalf", "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 0 and "ScheduleVHalf lowest activation peak within +10%" in text
    data = json.loads(out.read_text())
    expected = lowest_peak_within(LLAMA_8B, schedule="ScheduleVHalf", slowdown=0.1, **SETTING).best
    best = data["best"]["ScheduleVHalf"]
    assert (best["recompute"], best["offload"], best["activation"]) == (
        expected.recompute,
        expected.offload,
        list(expected.activation),
    )
    assert best["granularity"] == expected.granularity and "units" in text
    assert f"best  {expected.recompute}" in text
    assert main([*argv, "--within", "-1"]) == 2 and "slowdown" in capsys.readouterr().err


def test_offload_trials_try_layer_and_sublayer_units_where_a_plan_has_sub_layer_units():
    """Each offload trial is replayed with whole-layer and with sub-layer units, except for a plan that
    checkpoints every layer as a whole (one unit per layer: the same placement); each row replays as its
    offload label says; ``granularities=("layer",)`` tries whole layers only."""
    families = ("none", "selective")  # "selective" checkpoints each layer whole: one unit per layer
    found = lowest_peak_within(
        LLAMA_8B, schedule="ScheduleVHalf", slowdown=0.20, families=families, prune=False, **SETTING
    )
    trials = {(r.recompute, r.granularity) for r in found.rows if r.offload != "none"}
    tried = {label for label, _ in trials}
    assert ("none", "sublayer") in trials and ("none", "layer") in trials
    split = {label: any(len(u) > 1 for st in found.setups[label].units_bytes for u in st) for label in tried}
    assert set(split.values()) == {True, False}  # plans with and without sub-layer units were tried
    for label, has_units in split.items():
        assert (label, "layer") in trials and ((label, "sublayer") in trials) == has_units
    for r in found.rows:
        assert r.units == ("-" if r.offload == "none" else r.granularity)
        assert r.offload.endswith(":sublayer") == (r.granularity == "sublayer" and r.offload != "none")
    # a row's offload label, replayed, gives the row (the label is what `pp-offload plan` would run)
    row = next(r for r in found.rows if r.granularity == "sublayer" and r.offload != "none")
    setup, orders = found.setups[row.recompute], found.orders[row.recompute]
    again = combine(evaluate_orders(setup, orders, row.offload), SETTING["num_microbatches"])
    assert max(again["activation"]) == row.peak and again["makespan"] == pytest.approx(row.step_s, rel=1e-3)
    layer_only = lowest_peak_within(
        LLAMA_8B,
        schedule="ScheduleVHalf",
        slowdown=0.20,
        families=families,
        granularities=("layer",),
        prune=False,
        **SETTING,
    )
    assert {(r.recompute, r.granularity) for r in layer_only.rows if r.offload != "none"} == {
        (label, "layer") for label in tried
    }
    assert found.best.peak <= layer_only.best.peak
    table = found.table("ScheduleVHalf")
    assert "units" in table.splitlines()[1] and "sublayer" in table
    with pytest.raises(ValueError, match="granularities"):
        lowest_peak_within(
            LLAMA_8B, schedule="ScheduleVHalf", slowdown=0.1, granularities=("half",), **SETTING
        )


def test_gap_splits_a_missed_target_into_placement_and_link_at_the_tightest_moment():
    """`WithinResult.gap`: at the bound's tightest pass, the bytes a budget plan has off the device are
    what `activation_level` counts there (held vs without copies); no placement has more off than the
    bound allows with the plan's room (soundness, as for the peak), and `reach_at` at the bound's moment
    gives the bound's own live bytes and reach."""
    from pp_offload.order.offload_inputs import activation_level, activation_peaks
    from pp_offload.plan.link_bound import reach_at

    found = lowest_peak_within(
        LLAMA_8B, schedule="ScheduleInterleaved1F1B", slowdown=0.10, families=("none",), **SETTING
    )
    row = next(r for r in found.rows if r.offload != "none")
    plan = found.plans[(row.recompute, row.offload)]
    stage_bytes = found.setups["none"].offload_inputs().stage_bytes
    # the level over the replay peaks where activation_peaks says; copies only ever lower it
    for rank, peak in enumerate(activation_peaks(plan.sim, stage_bytes, plan.layered)):
        times = sorted({t for _, s, e in plan.sim.timeline[rank] for t in (s, e)})
        levels = [activation_level(plan.sim, stage_bytes, rank, t, plan.layered) for t in times]
        assert max(h for h, _ in levels) == peak
        assert all(h <= w for h, w in levels) and any(h < w for h, w in levels)
    target = 0.8 * row.peak  # below what the plan reached: a missed target
    gap = found.gap(row, target=target, bandwidth=H100_BW)
    bound = found.bound(found.alone("none"), target=target, bandwidth=H100_BW)
    assert (gap.rank, gap.chunk, gap.need, gap.can) == (bound.rank, bound.chunk, bound.need, bound.can)
    assert 0 < gap.off <= gap.can and gap.can_plain <= gap.can and gap.idle_after >= 0.0
    setup, orders = found.setups["none"], found.orders["none"]
    plain = simulate(orders.orders[orders.sizes[-1]], setup.costs)
    slack = found.limit_s - found.alone("none").step_s
    live, can = reach_at(
        plain, stage_bytes, rank=bound.rank, time_s=bound.time_s, bandwidth=H100_BW, slack=slack
    )
    assert (live, can) == (bound.live, bound.can)
    assert reach_at(plain, stage_bytes, rank=bound.rank, time_s=bound.time_s, bandwidth=H100_BW)[1] == (
        gap.can_plain
    )
