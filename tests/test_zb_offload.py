"""Offload-aware zero-bubble orders (W moved right after I, `pp_offload.order.zb_offload`): the
transformation keeps every pass, every dependency and the memory cap and passes torch's lowering; the
``close_w`` budget search never returns a higher peak than plain budget within the same limit; and (gloo,
2 ranks) the runtime runs the transformed order with budget offload exactly: same losses and grads as one
process."""

from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch
from _dist import run_on_ranks
from _reference import sequential_reference
from test_offload_budget import _batch, _loss, _model  # the same 2d-stage model of 3-block stages

from pp_offload.order import Costs, v_zb_order
from pp_offload.order.actions import I, W
from pp_offload.order.offload import OffloadPolicy, plan_offload, resolve_offload
from pp_offload.order.zb_offload import pull_weight_passes, separated_weight_passes
from pp_offload.runtime import compat
from pp_offload.sim import as_executed_by_torch, flatten, simulate


def _torch(name: str, d: int, m: int) -> dict[int, list]:
    return as_executed_by_torch(dict(enumerate(compat.schedule_ops(name, d, m, 2))))


ORDERS = {
    "v-zb": lambda: v_zb_order(4, 8, Costs(F=1.0, I=1.0, W=2.0)),
    "zbv": lambda: _torch("ZBVZeroBubble", 4, 8),
    "interleaved-zb": lambda: _torch("InterleavedZeroBubble", 4, 8),
}


@pytest.mark.parametrize("name", sorted(ORDERS))
def test_pulling_w_keeps_passes_dependencies_and_memory_and_lowers_in_torch(name: str) -> None:
    order = ORDERS[name]()
    separated = separated_weight_passes(order)
    chunks = [key for keys in separated.values() for key in keys]
    assert chunks, f"{name}: no W held back from its I"
    pulled = pull_weight_passes(order, chunks)
    assert separated_weight_passes(pulled) == {r: [] for r in order}
    for rank in order:
        before, after = flatten(order[rank]), flatten(pulled[rank])
        assert Counter(before) == Counter(after)
        assert [p for p in after if p[1] != W] == [p for p in before if p[1] != W]  # only W moved
        for k, (stage, kind, mb) in enumerate(after):
            if kind == W and (stage, mb) in set(chunks):
                assert after[k - 1] == (stage, I, mb)
    base, new = simulate(order), simulate(pulled)  # no deadlock; memory never rises on any rank
    assert all(new.peak_memory[r] <= base.peak_memory[r] + 1e-9 for r in order)
    m = 1 + max(mb for acts in order.values() for _, _, mb in flatten(acts))
    compat.lower_order_offline(pulled, m)  # torch validates it and adds its comms


def test_pulling_refuses_a_chunk_without_split_backward() -> None:
    order = _torch("InterleavedZeroBubble", 2, 4)  # stage 0 runs a full B as torch executes it
    with pytest.raises(ValueError, match="no rank runs both an I and a W"):
        pull_weight_passes(order, [(0, 1)])


def test_pulling_torch_actions_keeps_their_type_and_slots() -> None:
    raw = dict(enumerate(compat.schedule_ops("InterleavedZeroBubble", 2, 4, 2)))
    chunks = [key for keys in separated_weight_passes(raw).values() for key in keys if key[0] != 0]
    pulled = pull_weight_passes(raw, chunks)
    for rank, actions in raw.items():
        assert len(pulled[rank]) == len(actions)
        assert {id(a) for a in pulled[rank]} == {id(a) for a in actions}  # the same objects, None slots too


def test_close_w_policy_parsing_and_errors() -> None:
    assert resolve_offload("budget:close-w") == OffloadPolicy("budget", close_w=True)
    assert resolve_offload("budget:auto:0.1:close-w") == OffloadPolicy(
        "budget", max_slowdown=0.1, close_w=True
    )
    with pytest.raises(ValueError, match="without a fraction"):
        resolve_offload("budget:0.5:close-w")
    with pytest.raises(ValueError, match="close_w"):
        OffloadPolicy("full", close_w=True)


@pytest.mark.parametrize("transfer", [2.0, 4.0])
def test_close_w_lowers_the_peak_within_the_limit_and_replays_as_planned(transfer: float) -> None:
    order = _torch("InterleavedZeroBubble", 2, 6)
    costs = Costs(transfer=transfer)  # a slow link: budget offload alone moves little
    plain = plan_offload(order, costs, "budget", layers=3)
    close = plan_offload(order, costs, "budget:close-w", layers=3)
    assert close.pulled, "no W moved"
    assert close.sim.peak < plain.sim.peak - 1e-9
    assert close.sim.makespan <= simulate(order, costs).makespan * 1.03 + 1e-9
    # the plan's compute sequence is the input with exactly the pulled W passes moved
    pulled = pull_weight_passes(order, [key for keys in close.pulled.values() for key in keys])
    assert {r: flatten(a) for r, a in close.order.items()} == {r: flatten(a) for r, a in pulled.items()}
    assert close.replay(costs).makespan == pytest.approx(close.sim.makespan)
    assert close.replay(costs).peak == pytest.approx(close.sim.peak)


def test_close_w_is_plain_budget_where_pulling_cannot_help() -> None:
    order = _torch("InterleavedZeroBubble", 4, 8)
    costs = Costs(transfer=1.0)  # the default 3% limit: losing the bubble filling costs more than that
    plain = plan_offload(order, costs, "budget", layers=3)
    close = plan_offload(order, costs, "budget:close-w", layers=3)
    assert close.pulled == {}
    assert close.order == plain.order and close.layered == plain.layered


# --- runtime (gloo) -------------------------------------------------------------------------------------

POLICY = {"mode": "budget", "close_w": True, "max_slowdown": 0.2}
COSTS = {"transfer": 2.0}  # a slow link: pulling W lowers rank 1's peak (see the offline test above)


def _worker(rank: int, world_size: int, m: int) -> dict:
    import torch.distributed.pipelining as tp
    from torch.distributed.pipelining import PipelineStage

    from pp_offload.runtime.offload import enable_offload

    d = world_size
    model = _model(d)
    x, y = _batch(m)
    ids = (rank, rank + d)
    stages = [PipelineStage(model[s], s, 2 * d, torch.device("cpu")) for s in ids]
    compat.skip_self_p2p_warmup(stages)
    schedule = tp.ScheduleInterleavedZeroBubble(stages, m, loss_fn=_loss, scale_grads=False)
    runtime = enable_offload(schedule, POLICY, costs=COSTS)
    losses: list[torch.Tensor] = []
    schedule.step(
        *((x,) if 0 in ids else ()), **({"target": y, "losses": losses} if 2 * d - 1 in ids else {})
    )
    lowered = [
        (a.stage_index, str(getattr(a.computation_type, "value", a.computation_type)), a.microbatch_index)
        for a in compat.lowered_order(schedule)[rank]
    ]
    compute = [p for p in lowered if p[1] in ("F", "I", "W", "B")]
    return {
        "losses": [t.detach() for t in losses],
        "grads": {f"{s}.{n}": p.grad.clone() for s in ids for n, p in model[s].named_parameters()},
        "pulled": runtime.plan.pulled.get(rank, []),
        # in the executed order, each pulled W runs right after its I
        "adjacent": all(
            compute[compute.index((s, "W", j)) - 1] == (s, "I", j)
            for s, j in runtime.plan.pulled.get(rank, [])
        ),
        "moved": sum(runtime.moved.values()),
        "left": runtime.store.resident_bytes(),
        "offloads": sum(p[1] == "OFFLOAD" for p in lowered),
    }


@functools.cache
def _run(d: int, m: int) -> list[dict]:
    return run_on_ranks(_worker, d, m, timeout=180)


def test_offload_aware_order_keeps_losses_and_grads() -> None:
    d, m = 2, 4
    ref_losses, ref_grads = sequential_reference(_model(d), *_batch(m), m, _loss)
    got = _run(d, m)
    torch.testing.assert_close([t for g in got for t in g["losses"]], ref_losses)
    grads = {k: v for g in got for k, v in g["grads"].items()}
    assert grads.keys() == ref_grads.keys()
    for key, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[key], msg=key)
    assert sum(len(g["pulled"]) for g in got) > 0, "the plan moved no W next to its I"
    assert all(g["adjacent"] for g in got), "the runtime did not run the plan's sequence"
    assert sum(g["moved"] for g in got) > 0 and sum(g["offloads"] for g in got) > 0, "nothing offloaded"
    assert all(g["left"] == 0 for g in got), "chunks left in the store after the step"


# --- planner --------------------------------------------------------------------------------------------


def test_planner_labels_close_w_and_flags_it_when_it_moves_no_w() -> None:
    from pp_offload.plan.planner import DEFAULT_OFFLOAD, Candidate, _policies
    from pp_offload.plan.ranking import _mark_useless

    assert "budget:close-w" in DEFAULT_OFFLOAD
    labels = [label for label, _ in _policies(["budget", "budget:close-w", "budget:auto:0.1:close-w"])]
    assert labels == ["budget", "budget:close-w", "budget:auto:0.1:close-w"]
    plain = Candidate("ScheduleVZB", "none", step_time=1.0, activation=[10])
    same = Candidate("ScheduleVZB", "budget:close-w", step_time=1.02, activation=[9], offloaded_share=0.5)
    pulled = Candidate(
        "ScheduleInterleavedZeroBubble", "budget:close-w", step_time=1.02, activation=[8], offloaded_share=0.5
    )
    pulled.pulled_w = 12
    other = Candidate("ScheduleInterleavedZeroBubble", "none", step_time=1.0, activation=[10])
    _mark_useless([plain, same, other, pulled])
    assert same.useless and "no W" in same.useless
    assert pulled.useless is None
