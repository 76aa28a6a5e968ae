"""The simulator on orders small enough to replay by hand: makespan, bubble, memory, comm, deadlocks."""

from __future__ import annotations

import pytest

from pp_offload.order import Action, Costs
from pp_offload.order.baselines import one_f_one_b_order
from pp_offload.runtime import compat
from pp_offload.sim import OrderDeadlockError, flatten, simulate


def _actions(text: str) -> list[Action]:
    """``"0F0 3F0 3I0"`` -> actions."""
    out = []
    for token in text.split():
        kind = next(k for k in "FIWB" if k in token)
        stage, mb = token.split(kind)
        out.append(Action(int(stage), kind, int(mb)))
    return out


def _order(*ranks: str) -> dict[int, list[Action]]:
    return {rank: _actions(text) for rank, text in enumerate(ranks)}


# One stage per rank on 2 ranks: each stage is 2 chunks, so F/I/W take 2 and hold 2 chunk units.
TWO_STAGES = _order("0F0 0I0 0W0", "1F0 1I0 1W0")
# V placement on 2 ranks: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2; one chunk per stage.
V_ONE_MB = _order("0F0 3F0 3I0 3W0 0I0 0W0", "1F0 2F0 2I0 2W0 1I0 1W0")


def test_two_ranks_one_microbatch_by_hand():
    # 0F0 [0,2] 1F0 [2,4] 1I0 [4,6] 1W0 [6,8] 0I0 [6,8] 0W0 [8,10]
    result = simulate(TWO_STAGES)
    assert result.makespan == 10.0
    assert result.busy == {0: 6.0, 1: 6.0}
    assert result.bubble == pytest.approx(1 - 6 / 10)
    assert result.peak_memory == {0: 2.0, 1: 2.0}
    assert result.peak == 2.0
    assert [(str(Action(*p)), s, e) for p, s, e in result.timeline[0]] == [
        ("0F0", 0.0, 2.0),
        ("0I0", 6.0, 8.0),
        ("0W0", 8.0, 10.0),
    ]
    assert result.memory_curve[0] == [(0.0, 0.0), (0.0, 2.0), (10.0, 0.0)]


def test_v_order_one_microbatch_by_hand():
    # rank 0: 0F0 [0,1] 3F0 [3,4] 3I0 [4,5] 3W0 [5,6] 0I0 [8,9] 0W0 [9,10]
    # rank 1: 1F0 [1,2] 2F0 [2,3] 2I0 [5,6] 2W0 [6,7] 1I0 [7,8] 1W0 [8,9]
    result = simulate(V_ONE_MB)
    assert result.makespan == 10.0
    assert result.busy == {0: 6.0, 1: 6.0}
    assert result.peak_memory == {0: 2.0, 1: 2.0}
    starts = {str(Action(*p)): s for r in (0, 1) for p, s, _ in result.timeline[r]}
    assert starts == {
        "0F0": 0.0,
        "3F0": 3.0,
        "3I0": 4.0,
        "3W0": 5.0,
        "0I0": 8.0,
        "0W0": 9.0,
        "1F0": 1.0,
        "2F0": 2.0,
        "2I0": 5.0,
        "2W0": 6.0,
        "1I0": 7.0,
        "1W0": 8.0,
    }
    # rank 0 holds stage 0 from 0 to 10 and stage 3 from 3 to 6
    assert result.memory_curve[0] == [(0.0, 0.0), (0.0, 1.0), (3.0, 2.0), (6.0, 1.0), (10.0, 0.0)]


def test_costs_scale_each_kind():
    # F=1, I=3, W=2 per chunk, x2 per stage: 0F0 [0,2] 1F0 [2,4] 1I0 [4,10] 1W0 [10,14]
    # 0I0 [10,16] 0W0 [16,20]
    result = simulate(TWO_STAGES, {"F": 1, "I": 3, "W": 2})
    assert result.makespan == 20.0
    assert result.busy == {0: 12.0, 1: 12.0}


def test_comm_latency_only_between_ranks():
    # comm 0.5 on each cross-rank dependency: 0F0 [0,2] 1F0 [2.5,4.5] 1I0 [4.5,6.5] (same rank: no
    # latency) 1W0 [6.5,8.5] 0I0 [7,9] 0W0 [9,11]
    result = simulate(TWO_STAGES, Costs(comm=0.5))
    assert result.makespan == 11.0
    assert {str(Action(*p)): s for p, s, _ in result.timeline[1]} == {"1F0": 2.5, "1I0": 4.5, "1W0": 6.5}
    # On the V order the turn (stage 1 -> 2 and 2 -> 1) stays on rank 1: 4 crossings x 0.5
    assert simulate(V_ONE_MB, Costs(comm=0.5)).makespan == 12.0


def test_full_backward_frees_at_its_end():
    # 1F1B, d=2, m=2, one stage per rank (F=2, B=I+W=4):
    # rank 0: 0F0 [0,2] 0F1 [2,4] 0B0 [8,12] 0B1 [14,18]; rank 1: 1F0 [2,4] 1B0 [4,8] 1F1 [8,10] 1B1 [10,14]
    result = simulate(one_f_one_b_order(2, 2))
    assert result.makespan == 18.0
    assert result.busy == {0: 12.0, 1: 12.0}
    assert result.bubble == pytest.approx(1 / 3)
    # rank 0 holds both microbatches; rank 1 frees 1F0's memory at 8, the instant 1F1 starts: frees
    # count before allocations at the same time.
    assert result.peak_memory == {0: 4.0, 1: 2.0}
    assert result.memory_curve[1] == [(0.0, 0.0), (2.0, 2.0), (8.0, 0.0), (8.0, 2.0), (14.0, 0.0)]


def test_b_satisfies_the_upstream_input_gradient():
    # A B on stage 1 is what 0I0 waits for (keyed as I), and W of stage 0 waits on 0I0.
    order = _order("0F0 0I0 0W0", "1F0 1B0")
    result = simulate(order)
    # 0F0 [0,2] 1F0 [2,4] 1B0 [4,8] 0I0 [8,10] 0W0 [10,12]
    assert result.makespan == 12.0


@pytest.mark.parametrize("d", [2, 3, 4, 5])
@pytest.mark.parametrize("factor", [0.5, 1, 2, 4])
@pytest.mark.parametrize("costs", [None, {"F": 3, "I": 4, "W": 2}])
def test_one_f_one_b_bubble_formula(d, factor, costs):
    """1F1B's classic bubble (d-1)/(m+d-1), with a stage of 2 chunks (F=2F, B=2(I+W))."""
    m = max(1, int(factor * d))
    c = Costs.coerce(costs)
    result = simulate(one_f_one_b_order(d, m), costs)
    assert result.makespan == pytest.approx((m + d - 1) * 2 * (c.F + c.I + c.W))
    assert result.bubble == pytest.approx((d - 1) / (m + d - 1))
    assert result.peak_memory[0] == 2 * min(d, m)
    assert result.peak == 2 * min(d, m)


def test_torch_actions_replay_like_ours():
    ours = simulate(V_ONE_MB, Costs(F=1, I=2, W=1, comm=0.25))
    torch_order = compat.to_torch_order(V_ONE_MB)
    theirs = simulate(torch_order, Costs(F=1, I=2, W=1, comm=0.25))
    assert theirs.makespan == ours.makespan
    assert theirs.timeline == ours.timeline
    assert theirs.peak_memory == ours.peak_memory


def test_none_and_comm_actions_are_skipped():
    torch_order = compat.to_torch_order(TWO_STAGES)
    torch_order[0] = [None, compat.make_action(0, "UNSHARD"), *torch_order[0], None]
    torch_order[1] = [compat.make_action(1, "RECV_F", 0), *torch_order[1]]
    assert simulate(torch_order).makespan == simulate(TWO_STAGES).makespan


def test_overlap_f_b_runs_its_sub_actions_in_order():
    # rank 1 overlaps the forward of microbatch 1 with the full backward of microbatch 0 (DualPipe
    # style); the simulator runs the sub-actions one after the other, as torch's runtime does.
    plain = _order("0F0 0F1 0B0 0B1", "1F0 1F1 1B0 1B1")
    torch_order = compat.to_torch_order(plain)
    f1, b0 = torch_order[1][1], torch_order[1][2]
    overlap = compat.TorchAction(1, compat.action_kind("OVERLAP_F_B"), None, (f1, b0))
    torch_order[1] = [torch_order[1][0], overlap, torch_order[1][3]]
    assert flatten(torch_order[1]) == [(1, "F", 0), (1, "F", 1), (1, "B", 0), (1, "B", 1)]
    # 0F0 [0,2] 0F1 [2,4]; 1F0 [2,4] 1F1 [4,6] 1B0 [6,10] 1B1 [10,14]; 0B0 [10,14] 0B1 [14,18]
    result = simulate(torch_order)
    assert result.makespan == simulate(plain).makespan == 18.0
    assert result.peak_memory == {0: 4.0, 1: 4.0}


def test_torch_dual_pipe_v_replays():
    ops = compat.schedule_ops("DualPipeV", 2, 4, 2)
    assert any(getattr(a, "sub_actions", None) for rank in ops for a in rank if a is not None)
    result = simulate(dict(enumerate(ops)))
    assert result.busy == {0: 24.0, 1: 24.0}  # 2 stages x 4 microbatches x (F + I + W), unit costs


def test_deadlock_names_the_blocked_actions():
    # 0I0 waits on 1I0, which waits on 1F0, which waits on 0F0: queued on rank 0 after 0I0.
    order = _order("0I0 0F0 0W0", "1F0 1I0 1W0")
    with pytest.raises(OrderDeadlockError, match=r"0I0") as info:
        simulate(order)
    message = str(info.value)
    assert "1F0" in message and "cannot complete" in message
    assert isinstance(info.value, ValueError)


def test_missing_dependency_is_a_deadlock():
    order = _order("0F0 0I0 0W0", "1I0 1W0")  # 1F0 never runs: 1I0 can't start
    with pytest.raises(OrderDeadlockError, match=r"1I0"):
        simulate(order)


def test_empty_order_is_an_error():
    with pytest.raises(ValueError, match="no compute actions"):
        simulate({0: [], 1: []})


def test_costs_are_validated():
    with pytest.raises(ValueError, match="must be > 0"):
        simulate(TWO_STAGES, {"F": -1})
    with pytest.raises(ValueError, match="unknown cost keys"):
        simulate(TWO_STAGES, {"B": 1})


# --- per-stage costs --------------------------------------------------------------------------------------


def _per_stage_like(costs: Costs, num_stages: int) -> Costs:
    return Costs(
        F=costs.F,
        I=costs.I,
        W=costs.W,
        comm=costs.comm,
        transfer=costs.transfer,
        stages=((costs.F, costs.I, costs.W),) * num_stages,
    )


def _num_stages(order) -> int:
    return 1 + max(s for acts in order.values() for s, _, _ in flatten(acts))


def test_per_stage_costs_equal_to_scalar_ones_change_nothing():
    from pp_offload.order.offload import plan_offload
    from pp_offload.order.vshape import v_half_order, v_zb_order
    from pp_offload.sim import as_executed_by_torch

    skewed = Costs(F=1.0, I=1.5, W=0.5, comm=0.25, transfer=0.75)
    offloaded = plan_offload(v_half_order(3, 6, skewed), skewed, "full").order
    assert any(a.computation_type == "OFFLOAD" for acts in offloaded.values() for a in acts)
    orders = {
        "two stages": TWO_STAGES,
        "1f1b": one_f_one_b_order(3, 5),
        "v-zb as torch runs it": as_executed_by_torch(v_zb_order(3, 6, skewed)),
        "v-half with offload": offloaded,
    }
    for name, order in orders.items():
        per_stage = _per_stage_like(skewed, _num_stages(order))
        for lanes in ("duplex", "shared"):
            assert simulate(order, per_stage, copy_lanes=lanes) == simulate(
                order, skewed, copy_lanes=lanes
            ), name


def test_slow_last_stage_lengthens_the_makespan_by_hand():
    # 2 ranks, 2 microbatches, GPipe-like; one stage per rank = 2 chunks, so a pass takes 2 x its chunk cost.
    order = _order("0F0 0F1 0I0 0W0 0I1 0W1", "1F0 1F1 1I0 1W0 1I1 1W1")
    # uniform: 1F0 [2,4] ... 1W1 [12,14], 0I1 [12,14] 0W1 [14,16]
    assert simulate(order).makespan == 16.0
    slow = simulate(order, Costs(stages=((1, 1, 1), (2, 2, 2))))
    # stage 1 passes take 4: 1F0 [2,6] 1F1 [6,10] 1I0 [10,14] 1W0 [14,18] 1I1 [18,22] 1W1 [22,26];
    # stage 0 keeps 2 per pass: 0I0 [14,16] 0W0 [16,18] 0I1 [22,24] 0W1 [24,26]
    assert slow.makespan == 26.0
    assert slow.busy == {0: 12.0, 1: 24.0}
    ends = {str(Action(*p)): e for r in (0, 1) for p, _, e in slow.timeline[r]}
    assert ends["1I1"] == 22.0 and ends["0W1"] == 26.0
    assert slow.peak_memory == simulate(order).peak_memory  # memory is in chunk units, not time


def test_torch_stage_zero_backward_takes_its_own_i_plus_w():
    from pp_offload.sim import as_executed_by_torch

    torch_order = as_executed_by_torch(V_ONE_MB)
    assert [str(a) for a in torch_order[0]][-1] == "0B0"
    costs = Costs(stages=((1, 0.5, 2.5), (1, 1, 1), (1, 1, 1), (1, 1, 1)))
    result = simulate(torch_order, costs)
    (key, start, finish) = result.timeline[0][-1]
    assert key == (0, "B", 0) and finish - start == 3.0  # stage 0's I + W, not the scalar 2
    assert result.makespan == simulate(torch_order).makespan + 1.0


def test_per_stage_costs_validation_and_coercion():
    coerced = Costs.coerce({"F": 2, "stages": [[1, 2, 3], [4, 5, 6]]})
    assert coerced.stages == ((1.0, 2.0, 3.0), (4.0, 5.0, 6.0)) and coerced.F == 2.0
    assert hash(coerced) == hash(Costs(F=2, stages=((1, 2, 3), (4, 5, 6))))
    assert coerced.of_stage(1, "B") == 11.0 and coerced.of_stage(0, "F") == 1.0
    assert Costs(F=3).of_stage(5, "B") == 2.0  # no stages: the scalar costs
    assert Costs(stages=((1, 1e-6, 1),)).stages[0][1] == 1e-6  # tiny is fine (torch's stage 0 I)
    with pytest.raises(ValueError, match=r"stage 1\): I must be"):
        Costs(stages=((1, 1, 1), (1, 0, 1)))
    with pytest.raises(ValueError, match=r"\[0\] must be \[F, I, W\]"):
        Costs(stages=((1, 1),))
    with pytest.raises(ValueError, match="empty"):
        Costs(stages=())
    with pytest.raises(ValueError, match="unknown cost keys"):
        Costs.coerce({"stage": [[1, 1, 1]]})
    with pytest.raises(ValueError, match="2 entries but the order has 4 stages"):
        simulate(V_ONE_MB, Costs(stages=((1, 1, 1), (1, 1, 1))))


def test_order_generators_take_costs_with_stages():
    from pp_offload.order.vshape import adaptive_v_order, v_half_order, v_min_order, v_zb_order

    scalar = Costs(F=1.0, I=1.5, W=0.5)
    same = _per_stage_like(scalar, 6)
    for gen in (v_min_order, v_half_order, v_zb_order):
        assert gen(3, 6, same) == gen(3, 6, scalar)
    imbalanced = Costs(F=1.0, I=1.5, W=0.5, stages=((1, 1.5, 0.5),) * 5 + ((2, 3, 1),))
    for order in (v_zb_order(3, 6, imbalanced), adaptive_v_order(3, 6, 0.5, imbalanced)):
        simulate(order, imbalanced)  # builds and replays
