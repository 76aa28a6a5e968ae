"""Offline checks of the V schedule classes: torch builds them with mock stages, no processes needed."""

from __future__ import annotations

import json
import re
from collections import Counter
from types import SimpleNamespace

import pytest
from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

from pp_offload import Costs, ScheduleVAdaptive, ScheduleVHalf, ScheduleVMin, ScheduleVZB
from pp_offload.order import v_half_order, v_min_order, v_stages, v_zb_order
from pp_offload.runtime import compat
from pp_offload.runtime.timing import ActionEvent, action_category, chrome_trace, realized_bubble


class _AdaptiveFull(ScheduleVAdaptive):
    """get_schedule_ops passes only (stages, n_microbatches): fix the required memory_limit."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, memory_limit=1.0, **kwargs)


CLASSES = [ScheduleVMin, ScheduleVHalf, ScheduleVZB, _AdaptiveFull]
GENERATORS = {ScheduleVMin: v_min_order, ScheduleVHalf: v_half_order, ScheduleVZB: v_zb_order}
SIZES = [(d, m) for d in (2, 3, 4, 5) for m in (1, d + 1, 2 * d)]  # d + 1 < 2d: a partial steady phase


def _stages(
    d: int, rank: int = 0, indices: tuple[int, ...] | None = None, num_stages: int | None = None
) -> list:
    """Stand-ins with the attributes the constructor reads before handing them to torch."""
    indices = v_stages(rank, d) if indices is None else indices
    return [
        SimpleNamespace(
            group_size=d,
            group_rank=rank,
            num_stages=2 * d if num_stages is None else num_stages,
            stage_index=i,
        )
        for i in indices
    ]


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
@pytest.mark.parametrize(("d", "m"), SIZES)
def test_compute_order_runs_every_pass_once_on_its_v_rank(cls, d, m):
    ops = get_schedule_ops(cls, d, m, 2)
    assert len(ops) == d
    for rank, actions in enumerate(ops):
        expected = Counter((s, kind, j) for s in v_stages(rank, d) for kind in "FIW" for j in range(m))
        got = Counter((a.stage_index, a.computation_type.value, a.microbatch_index) for a in actions)
        assert got == expected, f"rank {rank}"
    if cls in GENERATORS:  # the class hands torch exactly its generator's order
        order = GENERATORS[cls](d, m)
        assert [[str(a) for a in actions] for actions in ops] == [
            [str(a) for a in order[r]] for r in range(d)
        ]


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
@pytest.mark.parametrize(("d", "m"), SIZES)
def test_lowering_with_comms(cls, d, m):
    compute_only = get_schedule_ops(cls, d, m, 2)
    lowered = get_schedule_ops(cls, d, m, 2, with_comms=True)
    kinds = Counter()
    for rank in range(d):
        assert [a for a in lowered[rank] if a.is_compute_op] == compute_only[rank]
        kinds.update(a.computation_type.value for a in lowered[rank])
        # The V turn (stage d-1 -> d) stays on rank d-1: no send or receive for it.
        turn = {"SEND_F", "RECV_B"} & {
            a.computation_type.value for a in lowered[rank] if a.stage_index == d - 1
        }
        assert not turn
    # Every stage boundary but the turn crosses ranks, once per microbatch and direction.
    for kind in ("SEND_F", "RECV_F", "SEND_B", "RECV_B"):
        assert kinds[kind] == (2 * d - 2) * m, kind


@pytest.mark.parametrize("d", [2, 3])
def test_defer_pp_recv_lowering(d):
    if not compat.supports_defer_pp_recv():
        pytest.skip("this torch has no defer_pp_recv")
    eager = get_schedule_ops(ScheduleVHalf, d, 2 * d, 2, with_comms=True)
    deferred = get_schedule_ops(ScheduleVHalf, d, 2 * d, 2, with_comms=True, defer_pp_recv=True)
    for rank in range(d):  # the same actions, receives moved later
        assert Counter(map(str, deferred[rank])) == Counter(map(str, eager[rank]))
    assert deferred != eager


def test_costs_reach_the_generator():
    costs = Costs(F=1.0, I=2.0, W=0.5)
    schedule = ScheduleVHalf(_mock_stages(3), 6, costs={"F": 1.0, "I": 2.0, "W": 0.5})
    assert schedule.costs == costs
    expected = v_half_order(3, 6, costs)
    assert {r: [str(a) for a in acts] for r, acts in schedule.pipeline_order.items()} == {
        r: [str(a) for a in acts] for r, acts in expected.items()
    }


def _mock_stages(d: int) -> list:
    """torch's own mock stages, as get_schedule_ops makes them (rank 0, no real stage_index)."""
    from unittest import mock

    from torch.distributed.pipelining.stage import PipelineStage

    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank, stage.group_size, stage.num_stages, stage.submod = 0, d, 2 * d, None
    return [stage, stage]


# --- construction errors ---------------------------------------------------------------------------


@pytest.mark.parametrize("count", [1, 3])
def test_needs_two_stages_per_rank(count):
    stages = _stages(2, indices=(0, 3, 1)[:count])
    with pytest.raises(ValueError, match=rf"exactly 2 stages on this rank.*got {count}"):
        ScheduleVHalf(stages, 4)


def test_needs_two_stages_per_rank_in_total():
    with pytest.raises(ValueError, match=r"num_stages must be 2 \* pipeline size = 4, got 6"):
        ScheduleVMin(_stages(2, num_stages=6), 4)


@pytest.mark.parametrize(("rank", "indices"), [(0, (0, 1)), (1, (1, 3)), (0, (2, 3))])
def test_needs_v_placement(rank, indices):
    message = (
        f"rank {rank} holds stages {sorted(indices)}, but V placement needs stages {list(v_stages(rank, 2))}"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        ScheduleVZB(_stages(2, rank=rank, indices=indices), 4)


@pytest.mark.parametrize("m", [0, -1, 2.5, True])
def test_needs_microbatches(m):
    with pytest.raises(ValueError, match="n_microbatches"):
        ScheduleVHalf(_stages(2), m)


@pytest.mark.parametrize("costs", [{"F": -1.0}, {"X": 1.0}, {"comm": -0.5}, "fast", 3])
def test_invalid_costs(costs):
    with pytest.raises(ValueError, match="invalid costs"):
        ScheduleVHalf(_stages(2), 4, costs=costs)


def test_adaptive_needs_memory_limit():
    with pytest.raises(TypeError, match="memory_limit"):
        ScheduleVAdaptive(_stages(2), 4)


@pytest.mark.parametrize("limit", [0, 0.0, -0.5, 1.5, "0.5", True, None])
def test_adaptive_memory_limit_range(limit):
    with pytest.raises(ValueError, match=r"memory_limit must be"):
        ScheduleVAdaptive(_stages(2), 4, memory_limit=limit)


def test_adaptive_infeasible_limit_is_the_generators_error():
    with pytest.raises(ValueError, match="memory_limit"):
        ScheduleVAdaptive(_mock_stages(4), 8, memory_limit=0.05)


def test_adaptive_keeps_its_limit():
    schedule = ScheduleVAdaptive(_mock_stages(3), 6, memory_limit=0.7, costs=Costs(F=1, I=1, W=1))
    assert schedule.memory_limit == 0.7


# --- compat -----------------------------------------------------------------------------------------


def test_actions_convert_to_torch():
    from pp_offload.order import Action

    converted = compat.to_torch_action(Action(7, "I", 3))
    assert str(converted) == "7I3" and converted.is_compute_op
    assert compat.to_torch_action(Action(0, "W", 1)).computation_type is compat.action_kind("W")


def test_new_action_kinds_print_and_dispatch():
    offload = compat.make_action(3, "OFFLOAD", 1)
    assert str(offload) == "3OFFLOAD1" and not offload.is_compute_op
    assert compat.action_kind("OFFLOAD") is offload.computation_type
    with pytest.raises(ValueError, match="upper-case"):
        compat.action_kind("offload")
    schedule = ScheduleVHalf(_mock_stages(2), 4)
    seen = []
    compat.install_action_handler(schedule, "OFFLOAD", lambda action, ctx: seen.append(str(action)))
    handler = schedule._comp_type_to_function_map[offload.computation_type]
    handler(offload, None)
    assert seen == ["3OFFLOAD1"]


def test_runtime_kwargs_follow_the_installed_torch():
    if compat.supports_defer_pp_recv():
        assert compat.runtime_init_kwargs(defer_pp_recv=True) == {"defer_pp_recv": True}
    else:
        assert compat.runtime_init_kwargs() == {}
        with pytest.raises(ValueError, match="defer_pp_recv"):
            compat.runtime_init_kwargs(defer_pp_recv=True)


# --- timing helpers on synthetic events -----------------------------------------------------------


def test_action_categories():
    assert [action_category(a) for a in ("0F1", "5I0", "1W12", "2B3")] == ["compute"] * 4
    assert [action_category(a) for a in ("0SEND_F1", "3RECV_B0")] == ["comm"] * 2
    assert action_category("wait:3F1") == "wait"
    assert action_category("0REDUCE_GRAD") == "other"
    assert action_category("3OFFLOAD1") == action_category("3RELOAD1") == "copy"
    assert action_category("(0F1;3B0)OVERLAP_F_B") == "compute"


def test_realized_bubble_and_trace(tmp_path):
    events = [
        ActionEvent(0, "0F0", 0.0, 1.0),
        ActionEvent(0, "0SEND_F0", 1.0, 1.1),
        ActionEvent(0, "0W0", 3.0, 4.0),
        ActionEvent(1, "wait:1F0", 0.0, 1.2),
        ActionEvent(1, "1F0", 1.2, 2.2),
        ActionEvent(1, "1I0", 2.2, 3.0),
    ]
    # rank 0 computes 2.0, rank 1 1.8 (its wait does not count); makespan 4.0
    assert realized_bubble(events) == pytest.approx(1 - 2.0 / 4.0)
    trace = chrome_trace(events)
    json.loads(json.dumps(trace))
    slices = [t for t in trace["traceEvents"] if t["ph"] == "X"]
    assert {t["cat"] for t in slices} == {"compute", "comm", "wait"}
    assert {(t["pid"], t["tid"]) for t in slices} == {(0, 0), (1, 1)}
    with pytest.raises(ValueError, match="compute"):
        realized_bubble([ActionEvent(0, "0SEND_F0", 0.0, 1.0)])


def test_timer_needs_a_runtime_schedule():
    from pp_offload import ActionTimer

    with pytest.raises(TypeError, match="_PipelineScheduleRuntime"):
        ActionTimer(object())
