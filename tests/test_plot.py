"""Timeline PNGs from orders (ours and torch's), from recorded events, and side by side; offline, fast."""

from __future__ import annotations

import pytest

from pp_offload.order import Costs, v_half_order
from pp_offload.plot import measured_costs, plot_realized, plot_side_by_side, plot_timeline
from pp_offload.runtime.timing import ActionEvent
from pp_offload.sim import simulate

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _assert_png(path) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC), path
    assert len(data) > 10_000, f"{path}: {len(data)} bytes, suspiciously small for a timeline"


def _fake_events() -> list[ActionEvent]:
    """One V step of d=2, m=2 as ActionTimer would record it (ms-scale times, waits, sends, receives)."""
    per_rank = {
        0: ["0F0", "0SEND_F0", "0F1", "0SEND_F1", "3RECV_F0", "3F0", "3I0", "3SEND_B0", "3W0", "0RECV_B0",
            "0I0", "0W0", "3F1", "3I1", "3W1", "0I1", "0W1"],
        1: ["1RECV_F0", "1F0", "1SEND_F0", "2F0", "2SEND_F0", "1F1", "2F1", "2RECV_B0", "2I0", "2W0",
            "1I0", "1W0", "2I1", "2W1", "1I1", "1W1"],
    }  # fmt: skip
    events = []
    for rank, actions in per_rank.items():
        t = 100.0 + 0.0005 * rank
        for action in actions:
            if "SEND" in action or "RECV" in action:
                events.append(ActionEvent(rank, action, t, t + 0.0002))
                t += 0.0002
                continue
            if action in ("3F0", "1F0"):  # waited for its input
                events.append(ActionEvent(rank, f"wait:{action}", t, t + 0.001))
                t += 0.001
            duration = {"F": 0.001, "I": 0.0012, "W": 0.0009}[action[1]]
            events.append(ActionEvent(rank, action, t, t + duration))
            t += duration
    return events


def test_plot_timeline_of_our_order(tmp_path):
    path = plot_timeline(v_half_order(2, 8), tmp_path / "vhalf.png", title="ScheduleVHalf")
    _assert_png(path)


def test_plot_timeline_of_a_sim_result_without_memory(tmp_path):
    sim = simulate(v_half_order(3, 6), Costs(F=1, I=1.5, W=0.5))
    _assert_png(plot_timeline(sim, tmp_path / "sub" / "sim.png", memory=False))


def test_plot_timeline_of_a_torch_order(tmp_path):
    from torch.distributed.pipelining import ScheduleInterleaved1F1B
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    order = get_schedule_ops(ScheduleInterleaved1F1B, 2, 4, 2)  # a list indexed by rank, with None slots
    _assert_png(plot_timeline(order, tmp_path / "i1f1b.png", costs={"F": 1, "I": 1, "W": 1}))


def test_plot_realized_and_side_by_side(tmp_path):
    events = _fake_events()
    _assert_png(plot_realized(events, tmp_path / "real.png", title="fake"))
    _assert_png(plot_realized([tuple(e) for e in events], tmp_path / "tuples.png"))  # as read from JSON
    costs = measured_costs(events)
    assert costs.F == pytest.approx(1.0) and costs.I == pytest.approx(1.2) and costs.W == pytest.approx(0.9)
    order = {0: [], 1: []}
    for e in events:
        if e.action[1] in "FIW" and not e.action.startswith("wait:"):
            order[e.rank].append(_action(e.action))
    _assert_png(plot_side_by_side(order, events, tmp_path / "both.png", costs, title="fake"))


def _action(name: str):
    from pp_offload.order import Action

    return Action(int(name[0]), name[1], int(name[2:]))


def test_bad_input_is_refused(tmp_path):
    with pytest.raises(TypeError, match="order"):
        plot_timeline(42, tmp_path / "x.png")
    with pytest.raises(ValueError, match="no events"):
        plot_realized([], tmp_path / "x.png")
