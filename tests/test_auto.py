"""``schedule: auto``'s library half: `choose` on hand-made measurements (offline, pure) and `measure_step`
on a real 2-rank gloo pipeline of sleep-emulated stages."""

from __future__ import annotations

import dataclasses
import json

import pytest
from _dist import run_on_ranks

from pp_offload.plan.auto import (
    DEFAULT_OFFLOAD,
    PROBE_OFFLOAD,
    PROBE_SCHEDULE,
    AutoDecision,
    AutoError,
    Measurement,
    StageMeasurement,
    choose,
    costs_for,
    measure_step,
)

MiB = 1 << 20
ZERO_BUBBLE = {"ScheduleVZB", "ScheduleZBVZeroBubble", "ScheduleVAdaptive"}


def _measurement(d: int = 2, *, copy_s: float = 0.002, overlap: bool = True) -> Measurement:
    """F = I = W = 10 ms per stage, 4 MiB saved per microbatch, 0.5 ms p2p."""
    return Measurement.uniform(
        d, F=0.010, I=0.010, W=0.010, saved_bytes=4 * MiB, offload=copy_s, comm=0.0005, copies_overlap=overlap
    )


# --- choose: offline ------------------------------------------------------------------------------------


def test_no_budget_picks_a_zero_bubble_schedule() -> None:
    decision = choose(_measurement(4), num_microbatches=8)  # d=4: V-Half and V-Min have real bubbles
    assert decision.schedule in ZERO_BUBBLE
    assert decision.budget_bytes is None
    assert all(c.fits for c in decision.candidates if c.predicted_step_s is not None)
    fastest = min(c.predicted_step_s for c in decision.candidates if c.predicted_step_s is not None)
    assert decision.predicted_step_s <= fastest * 1.01
    assert set(decision.costs) == {"F", "I", "W", "comm", "transfer"}
    assert decision.costs["F"] == pytest.approx(10.0)  # ms
    assert decision.reason.endswith(".") and decision.schedule in decision.reason


def test_budget_is_respected_and_tighter_budgets_cost_time() -> None:
    meas = _measurement(4)
    steps = []
    for limit in (1.0, 0.5, 0.3):
        decision = choose(meas, num_microbatches=8, memory_limit=limit)
        budget = [int(limit * 4 * (4 + 4) * MiB)] * 4  # 1F1B: min(d, m) = 4 microbatches of two 4 MiB stages
        assert decision.budget_bytes == budget
        assert all(p <= b for p, b in zip(decision.peak_bytes, budget, strict=True))
        assert decision.candidates[0].schedule == decision.schedule
        steps.append(decision.predicted_step_s)
    assert steps[0] <= steps[1] <= steps[2]
    assert steps[0] < steps[2]


def test_tight_budget_picks_v_min_or_offload() -> None:
    meas = _measurement(4)
    vmin = choose(meas, num_microbatches=8, schedules=["ScheduleVMin"], offload=["none"])
    decision = choose(meas, num_microbatches=8, activation_budget_bytes=max(vmin.peak_bytes))
    assert decision.schedule in ("ScheduleVMin", "ScheduleVAdaptive") or decision.offload != "none"
    assert max(decision.peak_bytes) <= max(vmin.peak_bytes)
    # below V-Min's peak only offload fits
    below = choose(meas, num_microbatches=8, activation_budget_bytes=max(vmin.peak_bytes) - 1)
    assert below.offload != "none"


def test_slow_copies_mean_no_offload() -> None:
    slow = _measurement(4, copy_s=0.2)  # a copy takes 20 passes: offloading can only stall
    decision = choose(slow, num_microbatches=8)
    assert decision.offload == "none"
    fast = choose(_measurement(4, copy_s=0.0005), num_microbatches=8, memory_limit=0.5)
    sync = choose(_measurement(4, copy_s=0.0005, overlap=False), num_microbatches=8, memory_limit=0.5)
    with_offload = [c for c in sync.candidates if c.offload == "full" and c.schedule == "ScheduleVHalf"]
    same = [c for c in fast.candidates if c.offload == "full" and c.schedule == "ScheduleVHalf"]
    assert with_offload[0].predicted_step_s > same[0].predicted_step_s  # synchronous copies add time


def test_synchronous_copies_free_memory_at_their_action() -> None:
    """On a CPU store an OFFLOAD frees its chunk as soon as it runs (no copy lane to wait for): the
    predicted peak of an offload candidate is lower than with overlapped copies of the same duration, and
    without offload both predictions are the same."""
    # V-Min: with the adaptive search's V-Half order at these sizes no rank's peak falls on a chunk whose
    # copy is still in flight, so both predictions agree there; V-Min's peaks do.
    picks = {"schedules": ["ScheduleVMin"], "num_microbatches": 8}
    lanes = choose(_measurement(4, copy_s=0.004), offload=["full"], **picks)
    inline = choose(_measurement(4, copy_s=0.004, overlap=False), offload=["full"], **picks)
    assert all(a <= b for a, b in zip(inline.peak_bytes, lanes.peak_bytes, strict=True))
    assert sum(inline.peak_bytes) < sum(lanes.peak_bytes)
    plain = [choose(_measurement(4, overlap=o), offload=["none"], **picks).peak_bytes for o in (True, False)]
    assert plain[0] == plain[1]


def test_deterministic_and_json_round_trip() -> None:
    meas = _measurement(2)
    again = Measurement.from_dict(json.loads(json.dumps(meas.to_dict())))
    assert again == meas
    a = choose(meas, num_microbatches=4, memory_limit=0.6)
    b = choose(again, num_microbatches=4, memory_limit=0.6)
    assert a.to_dict() == b.to_dict()
    back = AutoDecision.from_dict(json.loads(json.dumps(a.to_dict())))
    assert back == a
    table = a.table()
    assert a.schedule in table and "fits" in table and "yes" in table
    assert table.splitlines()[1].startswith("reason: ")
    assert all(len(line) <= 100 for line in table.splitlines() if line.startswith(("reason", "note")))
    assert "F ms" in meas.table()
    short = a.table(limit=3).splitlines()
    assert short[-1].strip() == f"... {len(a.candidates) - 3} more candidates"
    assert len(short) == len(table.splitlines()) - len(a.candidates) + 4


def test_ties_prefer_no_offload_then_less_memory_then_ours() -> None:
    for meas in (_measurement(2, copy_s=0.0), _measurement(4), _measurement(4, copy_s=0.004, overlap=False)):
        decision = choose(meas, num_microbatches=8)
        pick, rows = decision.candidates[0], decision.candidates
        fastest = min(c.predicted_step_s for c in rows)
        tied = [c for c in rows if c.predicted_step_s <= fastest * 1.01]
        assert pick in tied
        if any(c.offload == "none" for c in tied):
            assert pick.offload == "none"
            tied = [c for c in tied if c.offload == "none"]
        assert pick.max_peak == min(c.max_peak for c in tied)
    same = choose(
        _measurement(2),
        num_microbatches=4,
        schedules=["ScheduleZBVZeroBubble", "ScheduleVZB"],
        offload=["none"],
    )
    rows = {c.schedule: c for c in same.candidates}
    assert rows["ScheduleVZB"].peak_bytes == rows["ScheduleZBVZeroBubble"].peak_bytes
    assert rows["ScheduleVZB"].predicted_step_s == pytest.approx(
        rows["ScheduleZBVZeroBubble"].predicted_step_s
    )
    assert same.schedule == "ScheduleVZB"  # equal time and memory: ours


def test_nothing_fits_says_by_how_much_and_what_would() -> None:
    with pytest.raises(AutoError) as err:
        choose(_measurement(4), num_microbatches=8, activation_budget_bytes=1 * MiB)
    text = str(err.value)
    assert "activation_budget_bytes=1048576" in text
    assert "over" in text and "smallest achievable activation peak" in text
    assert "activation_budget_bytes >=" in text and "memory_limit >=" in text


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"activation_budget_bytes": -1}, "activation_budget_bytes"),
        ({"memory_limit": 0.0}, r"\(0, 1\]"),
        ({"memory_limit": 1.5}, r"\(0, 1\]"),
        ({"schedules": ["ScheduleNope"]}, "unknown schedule"),
        ({"schedules": ["Schedule1F1B"]}, "one stage per rank"),
        ({"offload": ["sometimes"]}, "offload"),
        ({"num_microbatches": 0}, "num_microbatches"),
    ],
)
def test_bad_arguments(kwargs: dict, match: str) -> None:
    kwargs = {"num_microbatches": 4, **kwargs}
    with pytest.raises(ValueError, match=match):
        choose(_measurement(2), **kwargs)


def _with_stages(d: int, slow: dict[int, float]) -> Measurement:
    """`_measurement(d)` with stage ``s``'s F, I and W multiplied by ``slow[s]``."""
    base = _measurement(d)
    stages = tuple(
        dataclasses.replace(
            st, F=st.F * slow.get(s, 1.0), I=st.I * slow.get(s, 1.0), W=st.W * slow.get(s, 1.0)
        )
        for s, st in enumerate(base.stages)
    )
    return dataclasses.replace(base, stages=stages)


def test_slow_last_stage_is_predicted_per_stage() -> None:
    d, m = 2, 8
    kw = {"num_microbatches": m, "offload": ["none"]}
    slow = _with_stages(d, {2 * d - 1: 2.0})  # LM head + loss: stage 3 (rank 0 in V, rank 1 in loop)
    for name in ("ScheduleVZB", "ScheduleInterleaved1F1B"):
        t_uniform = choose(_measurement(d), schedules=[name], **kw).predicted_step_s
        decision = choose(slow, schedules=[name], **kw)
        assert decision.predicted_step_s > t_uniform * 1.2, name
        assert set(decision.costs) == {"F", "I", "W", "comm", "transfer"}  # scalar keys only
        assert decision.costs["F"] == pytest.approx(15.0)  # busiest rank's (10 + 20) / 2 ms
    # V: rank 0's two stages averaged (15 ms each) give the same scalar costs, hence the same order, but a
    # different pipeline: each stage is timed as measured, not as its rank's average
    averaged = _with_stages(d, {0: 1.5, 2 * d - 1: 1.5})
    assert costs_for(averaged, "ScheduleVZB", num_microbatches=m) == costs_for(
        slow, "ScheduleVZB", num_microbatches=m
    )
    t_slow, t_avg = (choose(x, schedules=["ScheduleVZB"], **kw).predicted_step_s for x in (slow, averaged))
    assert t_slow != pytest.approx(t_avg, rel=1e-3)


def test_measurement_validation() -> None:
    with pytest.raises(ValueError, match="2 \\* num_ranks"):
        Measurement(2, (StageMeasurement(F=1.0, I=1.0, W=1.0, saved_bytes=0),) * 3)
    with pytest.raises(ValueError, match="saved_bytes"):
        StageMeasurement(F=1.0, I=1.0, W=1.0, saved_bytes=-5)
    assert "full" in DEFAULT_OFFLOAD and "none" in DEFAULT_OFFLOAD


# --- measure_step: 2 gloo ranks -------------------------------------------------------------------------

F_S, I_S, W_S = 0.020, 0.030, 0.010
HIDDEN = 48  # the 48x48 weight (2304 floats) is above the store's floor: every stage saves bytes


def _probe_worker(rank: int, world: int, m: int) -> dict:
    import torch

    import pp_offload
    from pp_offload.emulate import PassCosts, build_stages

    stages = build_stages(rank, world, costs=PassCosts(F_S, I_S, W_S), hidden=HIDDEN, microbatch_size=32)
    schedule = getattr(pp_offload, PROBE_SCHEDULE)(
        stages, m, loss_fn=torch.nn.functional.mse_loss, scale_grads=False, offload=PROBE_OFFLOAD
    )
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(m * 32, HIDDEN, generator=gen), torch.randn(m * 32, HIDDEN, generator=gen)

    def step() -> None:
        if rank == 0:
            schedule.step(x, target=y, losses=[])
        else:
            schedule.step()

    offloaded_before = set(schedule.offload.offloaded)
    measured = measure_step(schedule, step, steps=2)
    assert schedule.offload.offloaded == offloaded_before  # the probe's extra captures are undone
    step()  # the schedule still runs after the probe
    return measured.to_dict()


def test_measure_step_on_two_gloo_ranks() -> None:
    results = run_on_ranks(_probe_worker, 2, 4, timeout=120)
    assert results[0] == results[1]  # identical on every rank
    meas = Measurement.from_dict(results[0])
    assert meas.num_ranks == 2 and meas.num_microbatches == 4 and meas.steps == 2
    assert meas.copies_overlap is False and meas.device == "cpu"
    for s, st in enumerate(meas.stages):
        assert st.F == pytest.approx(F_S, rel=0.25, abs=0.004), (s, st)
        assert st.I + st.W == pytest.approx(I_S + W_S, rel=0.25, abs=0.006), (s, st)
        assert st.saved_bytes >= HIDDEN * HIDDEN * 4, (s, st)
    for s in range(1, 4):  # split backward measured directly off stage 0
        assert meas.stages[s].I == pytest.approx(I_S, rel=0.25, abs=0.004)
        assert meas.stages[s].W == pytest.approx(W_S, rel=0.25, abs=0.004)
    assert "split" in meas.first_stage  # torch ran stage 0's backward whole at W
    assert any(st.offload > 0 and not st.copies_estimated for st in meas.stages)
    assert 0 < meas.comm < 0.05
    decision = choose(meas, num_microbatches=4)
    assert decision.costs["F"] == pytest.approx(F_S * 1e3, rel=0.25)


def test_budget_offload_wins_when_whole_chunks_cannot_hide() -> None:
    """Copies of 2 passes per chunk (k = 1.3) and 4 layers per stage: budget offload moves layers where
    whole chunks gain nothing in time, so V-ZB fits 80% of 1F1B's memory with it and beats V-Half."""
    meas = Measurement.uniform(
        4, F=0.010, I=0.010, W=0.010, saved_bytes=4 * MiB, offload=0.02, comm=0.0005, layers=4
    )
    picks = {"num_microbatches": 8, "memory_limit": 0.8, "schedules": ["ScheduleVZB", "ScheduleVHalf"]}
    whole = choose(meas, offload=["none", "selective:0.5", "full"], **picks)
    decision = choose(meas, **picks)  # the defaults include "budget"
    assert "budget" in DEFAULT_OFFLOAD
    assert decision.schedule == "ScheduleVZB" and decision.offload == "budget"
    assert decision.predicted_step_s < whole.predicted_step_s
    # without layer counts, budget offload has nothing to move
    blind = dataclasses.replace(meas, stages=tuple(dataclasses.replace(s, layers=0) for s in meas.stages))
    blind_pick = choose(blind, offload=["budget"], **{**picks, "memory_limit": None})
    assert blind_pick.candidates[0].offloaded_share == 0


# --- two-mode recompute plans --------------------------------------------------------------------------


def _planner_measurement(d: int, m: int, seq: int, *, units: bool = False) -> Measurement:
    """What a probe would measure on an H100 for Llama-3-8B at this setting, as the planner predicts it
    (`pp_offload.plan.probe.predicted_measurement`; ``units``: with layer and sub-layer unit bytes)."""
    from pp_offload.plan.probe import predicted_measurement
    from pp_offload.plan.shapes import SHAPES

    return predicted_measurement(
        SHAPES["llama-3-8b"], pp=d, seq_len=seq, num_microbatches=m, machine="H100", units=units
    )


def test_auto_picks_a_two_mode_recompute_plan_where_it_is_fastest_within_budget() -> None:
    """Llama-3-8B, seq 4096, pp 4, m 8 on the H100 as the planner predicts it, V-Half without offload, 60% of
    1F1B's activation memory (half before the deferred-W queue was counted, which V-Half holds from each
    chunk's I to its W while 1F1B's B holds none): selective recompute of three of each stage's four layers
    with the MLP-only recompute on the fourth fits and is faster than every one-mode plan that fits (selective
    on every layer: ``selective:0.75`` alone keeps too much), by more than auto's 1% tie."""
    from pp_offload.plan.auto import DEFAULT_RECOMPUTE, recompute_options
    from pp_offload.plan.shapes import SHAPES

    measured = _planner_measurement(4, 8, 4096)
    options = recompute_options(SHAPES["llama-3-8b"], seq_len=4096)
    assert [o.label for o in options] == list(DEFAULT_RECOMPUTE)
    assert {"selective:0.5,mlp", "selective:0.75,mlp"} <= set(DEFAULT_RECOMPUTE)
    kw = {"num_microbatches": 8, "memory_limit": 0.6, "schedules": ["ScheduleVHalf"], "offload": ["none"]}
    decision = choose(measured, **kw, recompute=options)
    assert decision.recompute == "selective:0.75,mlp"
    assert all(p <= b for p, b in zip(decision.peak_bytes, decision.budget_bytes, strict=True))
    one_mode = choose(measured, **kw, recompute=[o for o in options if o.rest == "none"])
    assert one_mode.recompute == "selective"  # the two-mode plan's place without it
    # ~1.0% since deferred W moved each recomputation from W into I (it was over 1%)
    assert decision.predicted_step_s < one_mode.predicted_step_s * (1 - 0.005)
    fitting = [c for c in decision.candidates if c.fits]
    assert min(c.predicted_step_s for c in fitting) == decision.predicted_step_s
    # the plan without its second mode does not fit: the MLP-only recompute of the fourth layer buys it
    share = next(c for c in decision.candidates if c.recompute == "selective:0.75")
    assert not share.fits
    assert (
        AutoDecision.from_dict(json.loads(json.dumps(decision.to_dict()))).recompute == "selective:0.75,mlp"
    )


def test_two_mode_option_rescales_each_layer_by_its_mode() -> None:
    """``selective:0.5,mlp`` on 4-layer stages: two layers lose selective's bytes and gain its recompute
    time, the other two the MLP-only recompute's; a two-mode plan is named as the recipe reads it."""
    from pp_offload.plan.auto import RecomputeOption

    measured = Measurement.uniform(2, F=0.010, I=0.012, W=0.008, saved_bytes=64 * MiB, layers=4)
    option = RecomputeOption("selective", 0.45, 0.2, 0.5, "mlp", rest_kept_share=0.7, rest_forward_share=0.05)
    assert option.label == "selective:0.5,mlp"
    st, base = option.apply(measured).stages[1], measured.stages[1]
    per_layer = base.saved_bytes / 4
    assert st.saved_bytes == round(base.saved_bytes - per_layer * (2 * 0.55 + 2 * 0.3))
    assert st.I == pytest.approx(base.I + (0.010 / 4) * (2 * 0.2 + 2 * 0.05))
    with pytest.raises(ValueError, match="share below 1"):
        RecomputeOption("selective", 0.45, 0.2, 1.0, "mlp")
    with pytest.raises(ValueError, match="rest_kept_share"):
        RecomputeOption("selective", 0.45, 0.2, 0.5, "mlp", rest_kept_share=0.0)
