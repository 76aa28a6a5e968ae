"""Budget offload's fast placement replays (`pp_offload.order.offload_replay`) give exactly what writing each
placement into its order and replaying it with `simulate` gives, and the search places exactly as it did."""

from __future__ import annotations

import random
from dataclasses import asdict

import pytest

from pp_offload.order import Costs, v_half_order, v_zb_order
from pp_offload.order.offload import plan_offload, resolve_offload
from pp_offload.order.offload_placement import (
    _chunks,
    _compute_order,
    _insert,
    _layered_slot,
    _move_late_layered,
    _w_slot,
)
from pp_offload.order.offload_replay import STATS, PlacementReplay, reference_replays
from pp_offload.sim import LayeredChunk, simulate

COSTS = Costs(F=1.0, I=1.0, W=1.0, transfer=3.0)


def _as_dict(result) -> dict:
    return asdict(result)


@pytest.mark.parametrize("drop", [False, True])
@pytest.mark.parametrize("gen", [v_zb_order, v_half_order])
def test_placement_replay_is_simulate_of_the_written_order(gen, drop: bool) -> None:
    """Random placements (layers moved per chunk, RELOAD slots, drops after I) and their refinement rounds
    (each replayed again from where it changed): every field of each replay equals `simulate` of the order
    `_insert` writes."""
    compute = _compute_order(gen(4, 8, COSTS))
    policy = resolve_offload("budget")
    base = simulate(compute, COSTS)
    replays = PlacementReplay(compute, COSTS, policy.lanes)
    rng = random.Random(7)
    for trial in range(3):
        reloads, moved = {}, {}
        for rank in compute:
            timeline = base.timeline[rank]
            w_of = {(s, j): i for i, ((s, kind, j), _, _) in enumerate(timeline) if kind == "W"}
            reloads[rank] = {}
            for c in _chunks(timeline).values():
                c.layers, c.layer_copy, c.shares = 4, 0.75, (0.25,) * 4
                c.back_duration = timeline[c.back_index][2] - timeline[c.back_index][1]
                c.moved = rng.randint(0, 4)
                if c.moved == 0:
                    continue
                if timeline[c.back_index][0][1] == "I" and c.key in w_of:
                    c.i_index, c.w_index = c.back_index, w_of[c.key]
                moved[c.key] = LayeredChunk(c.moved, 4, 0.75)
                c.slot = _layered_slot(c, timeline, policy)
                c.w_slot = _w_slot(c, timeline, policy.reload_margin) if drop else -1
                reloads[rank][c.key] = c
        fast = replays.run(reloads, moved)
        for _ in range(6):  # the placement, then replayed again from where the refinement moved it
            written = simulate(_insert(compute, reloads), COSTS, layered=moved)
            assert _as_dict(replays.kept(fast)) == _as_dict(written), trial
            if not _move_late_layered(fast, reloads, policy.reload_margin):
                break
            last = _as_dict(fast)
            again = replays.rerun(reloads)
            assert _as_dict(fast) == last  # the last replay's result is left as it was
            fast = again


def test_placement_replay_of_nothing_placed_is_the_plain_replay() -> None:
    compute = _compute_order(v_zb_order(2, 4, COSTS))
    replays = PlacementReplay(compute, COSTS, "duplex")
    nothing = replays.kept(replays.run({}, {}))
    assert _as_dict(nothing) == _as_dict(simulate(compute, COSTS))


@pytest.mark.parametrize("policy", ["budget", "budget:auto:0.1", "budget:close-w", "budget:0.5"])
@pytest.mark.parametrize("gen", [v_zb_order, v_half_order])
def test_budget_placement_is_the_reference_searchs(gen, policy: str) -> None:
    """The fast search places exactly as the reference one (every placement written into its order and
    replayed by `simulate`, nothing remembered)."""
    order = gen(2, 4, COSTS)
    fast = plan_offload(order, COSTS, policy, layers=4)
    with reference_replays():
        slow = plan_offload(order, COSTS, policy, layers=4)
    assert fast.order == slow.order
    assert fast.offloaded == slow.offloaded and fast.pulled == slow.pulled
    assert fast.layered == slow.layered
    assert _as_dict(fast.sim) == _as_dict(slow.sim)


# V-ZB at d=4, m=8, 4 layers a stage, a chunk's copy 3x its forward: the layers each chunk of each stage
# moves (microbatches 0..7) and the plan's (makespan, peak in chunk units), as the search placed them before
# its replays were made fast (every policy reaches the same plan here; the raise phase gives stages 0-3 a
# second layer).
PINNED_MOVED = {0: "22222222", 1: "22222222", 2: "22222222", 3: "22222222"}
PINNED_MOVED |= {4: "11111111", 5: "11111111", 6: "11111111"}


@pytest.mark.parametrize("policy", ["budget", "budget:auto:0.1", "budget:close-w"])
def test_budget_placement_is_unchanged(policy: str) -> None:
    plan = plan_offload(v_zb_order(4, 8, COSTS), COSTS, policy, layers=4)
    moved: dict[int, list[int]] = {}
    for (stage, mb), chunk in sorted(plan.layered.items()):
        moved.setdefault(stage, [0] * 8)[mb] = chunk.moved
    assert {s: "".join(map(str, v)) for s, v in moved.items()} == PINNED_MOVED
    assert (plan.sim.makespan, max(plan.sim.peak_memory.values())) == (52.25, 6.25)


def test_repeated_trials_are_answered_once_and_plans_stay_apart() -> None:
    """``budget:auto:0.1`` compares its plan with the default limit's, which ``budget`` just searched: those
    trials are not run again; the two plans share no container a caller could change."""
    order = v_zb_order(2, 4, COSTS)
    first = plan_offload(order, COSTS, "budget", layers=4)
    STATS.clear()
    again = plan_offload(order, COSTS, "budget", layers=4)
    assert STATS["trials"] == 0 and STATS["repeats"] > 0 and STATS["replays"] == 0
    assert again.order == first.order and again.layered == first.layered
    assert again.order is not first.order and again.offloaded is not first.offloaded
    again.offloaded[0].clear()
    assert first.offloaded[0]
    with reference_replays():
        loose = plan_offload(order, COSTS, "budget:auto:0.1", layers=4)
    assert plan_offload(order, COSTS, "budget:auto:0.1", layers=4).order == loose.order


def test_memo_keeps_a_bounded_number_of_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Trials beyond the memo's budget of passes are run again, and plan as before."""
    from pp_offload.order import offload_replay

    order = v_zb_order(2, 4, COSTS)
    passes = sum(len(actions) for actions in order.values())
    monkeypatch.setattr(offload_replay, "_MEMO_PASSES", 3 * passes)
    offload_replay._MEMO.clear()
    first = plan_offload(order, COSTS, "budget", layers=4)
    assert sum(len(m) for m in offload_replay._MEMO.values()) == 3
    STATS.clear()
    again = plan_offload(order, COSTS, "budget", layers=4)
    assert STATS["repeats"] > 0 and STATS["trials"] > 0
    assert again.order == first.order and again.layered == first.layered


def _without_clock(data):
    if isinstance(data, dict):
        return {k: _without_clock(v) for k, v in data.items() if k != "order_seconds"}
    if isinstance(data, list):
        return [_without_clock(v) for v in data]
    return data


def test_plan_in_worker_processes_is_the_one_process_plan() -> None:
    """The planner's worker pool, shared by every recompute mode (`pp_offload.plan.sweep`), and the budget
    memo in each worker give the plan one process gives."""
    from pp_offload.plan import plan

    kw = {
        "seq_len": 512,
        "microbatch_size": 1,
        "num_microbatches": 4,
        "pp": 2,
        "schedules": ["ScheduleVHalf", "ScheduleZBVZeroBubble", "Schedule1F1B"],
        "offload": ["none", "budget", "budget:auto:0.1"],
        "recompute": ["none", "selective"],
        "gpu_memory_gib": 40.0,
        "suggest": False,
        "evaluate_dominated": True,
    }
    one = plan("llama-3.2-1b", jobs=1, **kw)
    two = plan("llama-3.2-1b", jobs=2, **kw)
    assert _without_clock(two.to_dict()) == _without_clock(one.to_dict())
    assert any(c.offload.startswith("budget") and c.evaluated for c in one.candidates)
