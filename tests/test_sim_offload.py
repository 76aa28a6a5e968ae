"""The simulator's copy lanes, replayed by hand: OFFLOAD frees at its copy's end, RELOAD allocates at its
start, compute waits for late reloads, shared vs duplex lanes, misplaced transfers, and the no-offload
path unchanged."""

from __future__ import annotations

import pytest

from pp_offload.order import Action, Costs, v_half_order
from pp_offload.order.baselines import one_f_one_b_order
from pp_offload.runtime import compat
from pp_offload.sim import OffloadOrderError, as_executed_by_torch, flatten, simulate


def _actions(text: str) -> list[Action]:
    """``"0F0 0OFFLOAD0 3F0"`` -> actions (kinds F, I, W, B, OFFLOAD, RELOAD)."""
    out = []
    for token in text.split():
        kind = next(k for k in ("OFFLOAD", "RELOAD", "F", "I", "W", "B") if k in token)
        stage, mb = token.split(kind)
        out.append(Action(int(stage), kind, int(mb)))
    return out


def _order(*ranks: str) -> dict[int, list[Action]]:
    return {rank: _actions(text) for rank, text in enumerate(ranks)}


def _starts(result, rank: int) -> dict[str, float]:
    return {str(Action(*p)): s for p, s, _ in result.timeline[rank]}


# V placement on 2 ranks (rank 0: stages 0 and 3, rank 1: stages 1 and 2), one microbatch, unit costs:
# rank 0: 0F0 [0,1] 3F0 [3,4] 3I0 [4,5] 3W0 [5,6] 0I0 [8,9] 0W0 [9,10]
V_PLAIN = _order("0F0 3F0 3I0 3W0 0I0 0W0", "1F0 2F0 2I0 2W0 1I0 1W0")
# stage 0 offloaded after its F and reloaded when 3W0 has ended (issued at 6, before 0I0)
V_OFFLOAD = _order(
    "0F0 0OFFLOAD0 3F0 3I0 3W0 0RELOAD0 0I0 0W0",
    "1F0 2F0 2I0 2W0 1I0 1W0",
)
# One rank holding both stages of a 2-stage model (a chunk per stage, unit costs), two microbatches
# whose offloads and first reload all sit in the warm-up: they contend for a shared lane.
ONE_RANK = _order(
    "0F0 0OFFLOAD0 0F1 0OFFLOAD1 0RELOAD0 1F0 1I0 0I0 1W0 0W0 0RELOAD1 1F1 1I1 0I1 1W1 0W1",
)


def test_offload_frees_at_copy_end_and_reload_allocates_at_start():
    result = simulate(V_OFFLOAD, Costs(transfer=0.5))
    # compute is unchanged: the copies hide behind it
    assert result.timeline == simulate(V_PLAIN).timeline
    assert result.makespan == 10.0
    assert result.reload_wait == {0: 0.0, 1: 0.0}
    assert result.total_reload_wait == 0.0
    assert [(str(a), s, e) for a, s, e in result.transfers[0]] == [
        ("0OFFLOAD0", 1.0, 1.5),  # issued when 0F0 ends
        ("0RELOAD0", 6.0, 6.5),  # issued when 3W0 ends
    ]
    assert result.transfers[1] == []
    # +1 at 0 (0F0), -1 at 1.5 (offload copied), +1 at 3 (3F0), 3W0 frees at 6 before the reload
    # allocates at 6, -1 at 10 (0W0)
    assert result.memory_curve[0] == [
        (0.0, 0.0),
        (0.0, 1.0),
        (1.5, 0.0),
        (3.0, 1.0),
        (6.0, 0.0),
        (6.0, 1.0),
        (10.0, 0.0),
    ]
    assert result.peak_memory[0] == 1.0
    assert simulate(V_PLAIN).peak_memory[0] == 2.0


def test_late_reload_makes_the_backward_wait():
    # transfer 3: offload [1,4], reload issued at 6 runs [6,9]; 0I0 could start at 8 (1I0 ends at 8)
    # but waits for the reload until 9: 0I0 [9,10], 0W0 [10,11]
    result = simulate(V_OFFLOAD, Costs(transfer=3))
    assert [(str(a), s, e) for a, s, e in result.transfers[0]] == [
        ("0OFFLOAD0", 1.0, 4.0),
        ("0RELOAD0", 6.0, 9.0),
    ]
    assert _starts(result, 0)["0I0"] == 9.0
    assert result.makespan == 11.0
    assert result.reload_wait == {0: 1.0, 1: 0.0}
    assert result.total_reload_wait == 1.0


def test_reload_waits_for_its_offload_to_end():
    # reload right after the offload: it can only start when the offload's copy has ended
    order = _order("0F0 0OFFLOAD0 0RELOAD0 3F0 3I0 3W0 0I0 0W0", "1F0 2F0 2I0 2W0 1I0 1W0")
    result = simulate(order, Costs(transfer=2))
    assert [(str(a), s, e) for a, s, e in result.transfers[0]] == [
        ("0OFFLOAD0", 1.0, 3.0),
        ("0RELOAD0", 3.0, 5.0),
    ]
    assert result.makespan == 10.0  # 0I0 starts at 8, long after the reload


def test_duplex_lanes_copy_both_ways_at_once():
    # transfer 1.5: 0F0 [0,1] 0F1 [1,2]; D2H: offload0 [1,2.5], offload1 [2.5,4]; H2D: reload0 issued at
    # 2 starts when offload0 ends: [2.5,4]; 1F0 [2,3] 1I0 [3,4] 0I0 [4,5] (no wait) 1W0 [5,6] 0W0 [6,7];
    # reload1 issued at 7 [7,8.5]; 1F1 [7,8] 1I1 [8,9] 0I1 [9,10] 1W1 [10,11] 0W1 [11,12]
    result = simulate(ONE_RANK, Costs(transfer=1.5))
    assert [(str(a), s, e) for a, s, e in result.transfers[0]] == [
        ("0OFFLOAD0", 1.0, 2.5),
        ("0OFFLOAD1", 2.5, 4.0),
        ("0RELOAD0", 2.5, 4.0),
        ("0RELOAD1", 7.0, 8.5),
    ]
    assert _starts(result, 0)["0I0"] == 4.0
    assert result.makespan == 12.0
    assert result.reload_wait == {0: 0.0}


def test_shared_lane_queues_reload_behind_offload():
    # one lane: reload0 (issued at 2) waits behind offload1 [2.5,4]: [4,5.5]; 0I0 ready at 4 waits 1.5:
    # 0I0 [5.5,6.5] 1W0 [6.5,7.5] 0W0 [7.5,8.5]; reload1 [8.5,10]; 1F1 [8.5,9.5] 1I1 [9.5,10.5]
    # 0I1 [10.5,11.5] 1W1 [11.5,12.5] 0W1 [12.5,13.5]
    result = simulate(ONE_RANK, Costs(transfer=1.5), copy_lanes="shared")
    assert [(str(a), s, e) for a, s, e in result.transfers[0]] == [
        ("0OFFLOAD0", 1.0, 2.5),
        ("0OFFLOAD1", 2.5, 4.0),
        ("0RELOAD0", 4.0, 5.5),
        ("0RELOAD1", 8.5, 10.0),
    ]
    assert _starts(result, 0)["0I0"] == 5.5
    assert result.makespan == 13.5
    assert result.reload_wait == {0: 1.5}


def test_transfer_scales_with_chunks_per_stage():
    # one stage per rank on 2 ranks: a stage is 2 chunks, so F takes 2 and a copy 2 * transfer
    order = _order("0F0 0OFFLOAD0 0RELOAD0 0I0 0W0", "1F0 1I0 1W0")
    result = simulate(order, Costs(transfer=0.5))
    assert [(str(a), s, e) for a, s, e in result.transfers[0]] == [
        ("0OFFLOAD0", 2.0, 3.0),
        ("0RELOAD0", 3.0, 4.0),
    ]
    # the offloaded stage frees its 2 chunk units at 3 and takes them back at 3
    assert result.memory_curve[0] == [(0.0, 0.0), (0.0, 2.0), (3.0, 0.0), (3.0, 2.0), (10.0, 0.0)]


def test_missing_reload_names_the_chunk():
    order = _order("0F0 0OFFLOAD0 3F0 3I0 3W0 0I0 0W0", "1F0 2F0 2I0 2W0 1I0 1W0")
    with pytest.raises(
        OffloadOrderError, match=r"0I0 needs the activations of stage 0, microbatch 0"
    ) as info:
        simulate(order, Costs(transfer=0.5))
    assert "0RELOAD0" in str(info.value)


@pytest.mark.parametrize(
    ("rank0", "message"),
    [
        ("0OFFLOAD0 0F0 3F0 3I0 3W0 0RELOAD0 0I0 0W0", "comes before 0F0"),
        ("0F0 0RELOAD0 3F0 3I0 3W0 0I0 0W0", "not offloaded"),
        ("0F0 0OFFLOAD0 0OFFLOAD0 3F0 3I0 3W0 0RELOAD0 0I0 0W0", "already offloaded"),
        ("0F0 3F0 3I0 3W0 0I0 0W0 0OFFLOAD0", "already freed"),
    ],
)
def test_misplaced_transfers_are_clear_errors(rank0, message):
    order = {0: _actions(rank0), 1: V_PLAIN[1]}
    with pytest.raises(OffloadOrderError, match=message):
        simulate(order, Costs(transfer=0.5))


def test_bad_copy_lanes():
    with pytest.raises(ValueError, match="copy_lanes must be 'duplex' or 'shared'"):
        simulate(V_PLAIN, copy_lanes="simplex")


def test_costs_transfer_validated_and_coerced():
    assert Costs.coerce({"F": 1, "transfer": 0.5}).transfer == 0.5
    assert Costs().transfer == 0.0
    with pytest.raises(ValueError, match="transfer"):
        Costs(transfer=-1)


@pytest.mark.parametrize(
    "order",
    [
        V_PLAIN,
        one_f_one_b_order(3, 6),
        v_half_order(3, 6),
        dict(enumerate(compat.schedule_ops("Interleaved1F1B", 4, 8, 2))),
        dict(enumerate(compat.schedule_ops("ZBVZeroBubble", 4, 8, 2))),
    ],
    ids=["v-by-hand", "1f1b", "v-half", "interleaved1f1b", "zbv"],
)
def test_orders_without_offload_replay_as_before(order):
    result = simulate(order, Costs(F=1, I=1.5, W=0.5, transfer=3))
    assert result.transfers == {r: [] for r in order}
    assert result.reload_wait == {r: 0.0 for r in order}
    # an OFFLOAD immediately followed by its RELOAD with free copies changes nothing at all
    bounced = {}
    for rank, actions in order.items():
        seq = []
        for a in actions:
            if a is None:
                continue
            seq.append(a)
            if str(getattr(a.computation_type, "value", a.computation_type)) == "F":
                seq += [Action(a.stage_index, "OFFLOAD", a.microbatch_index)]
                seq += [Action(a.stage_index, "RELOAD", a.microbatch_index)]
        bounced[rank] = seq
    free = Costs(F=1, I=1.5, W=0.5)
    plain, copied = simulate(order, free), simulate(bounced, free)
    assert copied.timeline == plain.timeline
    assert copied.makespan == plain.makespan
    assert copied.peak_memory == plain.peak_memory
    assert all(len(copied.transfers[r]) == 2 * sum(k == "F" for _, k, _ in flatten(order[r])) for r in order)


def test_known_makespans_and_peaks_unchanged():
    # values of the simulator before it learned transfers
    result = simulate(dict(enumerate(compat.schedule_ops("Interleaved1F1B", 8, 16, 2))))
    assert (result.makespan, result.peak) == (117.0, 23.0)
    result = simulate(v_half_order(4, 8))
    assert (result.makespan, result.peak) == (53.0, 6.0)


def test_torch_actions_with_offload_kinds_replay_like_ours():
    torch_order = {
        rank: [
            compat.make_action(a.stage_index, a.computation_type, a.microbatch_index)
            if a.computation_type in ("OFFLOAD", "RELOAD")
            else compat.to_torch_action(a)
            for a in actions
        ]
        for rank, actions in V_OFFLOAD.items()
    }
    torch_order[1] = [compat.make_action(1, "RECV_F", 0), *torch_order[1]]
    ours, theirs = simulate(V_OFFLOAD, Costs(transfer=3)), simulate(torch_order, Costs(transfer=3))
    assert theirs.timeline == ours.timeline
    assert theirs.memory_curve == ours.memory_curve
    assert [(str(a), s, e) for a, s, e in theirs.transfers[0]] == [
        (str(a), s, e) for a, s, e in ours.transfers[0]
    ]


def test_as_executed_by_torch_keeps_transfers():
    executed = as_executed_by_torch(V_OFFLOAD)
    assert [str(a) for a in executed[0]] == ["0F0", "0OFFLOAD0", "3F0", "3I0", "3W0", "0RELOAD0", "0B0"]
    result = simulate(executed, Costs(transfer=0.5))
    assert result.peak_memory[0] == 1.0
