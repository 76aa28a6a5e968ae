"""Budgeted, layer-granular offload: the simulator's layered model, the planner of mode 'budget', and
(gloo, 2 ranks) exact losses and gradients when a schedule moves its chunks' earliest layers."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _dist import run_on_ranks
from _reference import sequential_reference
from torch import nn

from pp_offload.order import Action, Costs, v_half_order, v_zb_order
from pp_offload.order.actions import OFFLOAD, RELOAD
from pp_offload.order.offload import OffloadPolicy, plan_offload, resolve_offload
from pp_offload.runtime import compat
from pp_offload.sim import LayeredChunk, flatten, simulate

# --- simulator ------------------------------------------------------------------------------------------

ONE_CHUNK = {
    0: [
        Action(0, "F", 0),
        Action(0, OFFLOAD, 0),
        Action(0, "F", 1),
        Action(0, RELOAD, 0),
        Action(0, "I", 0),
        Action(0, "W", 0),
        Action(0, "I", 1),
        Action(0, "W", 1),
    ]
}


def test_layered_copies_start_per_layer_and_reload_last_layer_first() -> None:
    # one stage of 4 layers on one rank (scale 2): F = 2, one layer's copy = 1 (given)
    result = simulate(ONE_CHUNK, Costs(), layered={(0, 0): LayeredChunk(moved=2, layers=4, layer_copy=1.0)})
    parts = [(str(a), layer, s, e) for a, layer, s, e in result.layer_transfers[0]]
    # layer 0's copy starts when its forward ends (0.5), layer 1's at 1.0 but queues behind it
    assert parts[:2] == [("0OFFLOAD0", 0, 0.5, 1.5), ("0OFFLOAD0", 1, 1.5, 2.5)]
    # the reload is issued when 0F1 ends (t=4): layer 1 first, then layer 0
    assert parts[2:] == [("0RELOAD0", 1, 4.0, 5.0), ("0RELOAD0", 0, 5.0, 6.0)]
    # 0I0 (2 units, 0.5 per layer) runs layers 3, 2 at once, waits for layer 1 (t=5), then layer 0 (t=6)
    timeline = {"".join(map(str, k)): (s, e) for k, s, e in result.timeline[0]}
    assert timeline["0I0"] == (4.0, 6.5)
    assert result.reload_wait[0] == pytest.approx(0.5)
    assert result.busy[0] == pytest.approx(12.0)  # waits are not compute
    assert result.makespan == pytest.approx(12.5)
    # memory: 2 units at 0F0's start, half a unit off at each layer copy's end (1.5, 2.5), 2 more at 0F1's
    # start (2: 3.5), back half a unit at each reload's start (4: 3.5, 5: 4), 0W0 frees 2
    assert dict(result.memory_curve[0])[5.0] == pytest.approx(4.0)
    assert result.peak_memory[0] == pytest.approx(4.0)


def test_layered_copies_take_each_layers_own_time() -> None:
    """Layers saving different bytes (a recompute plan on a share of them): each copy takes its own time,
    out in forward order, back last layer first."""
    layered = {(0, 0): LayeredChunk(moved=2, layers=4, layer_copy=(0.25, 1.0, 2.0, 2.0))}
    result = simulate(ONE_CHUNK, Costs(), layered=layered)
    parts = [(str(a), layer, s, e) for a, layer, s, e in result.layer_transfers[0]]
    assert parts[:2] == [("0OFFLOAD0", 0, 0.5, 0.75), ("0OFFLOAD0", 1, 1.0, 2.0)]
    assert parts[2:] == [("0RELOAD0", 1, 4.0, 5.0), ("0RELOAD0", 0, 5.0, 5.25)]
    with pytest.raises(ValueError, match="3 entries for 4 layers"):
        LayeredChunk(1, 4, layer_copy=(1.0, 1.0, 1.0))


def test_layered_moving_nothing_is_the_plain_replay() -> None:
    plain = simulate({0: [a for a in ONE_CHUNK[0] if a.computation_type not in (OFFLOAD, RELOAD)]})
    moved_nothing = simulate(ONE_CHUNK, layered={(0, 0): LayeredChunk(0, 4)})
    assert moved_nothing.makespan == plain.makespan
    assert moved_nothing.peak_memory == plain.peak_memory


def test_layered_chunk_checks_its_fields() -> None:
    with pytest.raises(ValueError, match="moved must be an int in \\[0, layers=4\\]"):
        LayeredChunk(5, 4)
    with pytest.raises(ValueError, match="layers must be an int >= 1"):
        LayeredChunk(0, 0)


# --- planning -------------------------------------------------------------------------------------------


def _torch(name: str, d: int, m: int) -> dict[int, list]:
    return dict(enumerate(compat.schedule_ops(name, d, m, 2)))


ORDERS = {
    "v-half": lambda: v_half_order(4, 8),
    "v-zb": lambda: v_zb_order(4, 8),
    "interleaved1f1b": lambda: _torch("Interleaved1F1B", 4, 8),
    "zbv": lambda: _torch("ZBVZeroBubble", 4, 8),
}


def test_budget_policy_parsing_and_errors() -> None:
    assert resolve_offload("budget") == OffloadPolicy("budget")
    assert resolve_offload("budget:0.5") == OffloadPolicy("budget", fraction=0.5)
    assert resolve_offload("budget:auto:0.1") == OffloadPolicy("budget", max_slowdown=0.1)
    with pytest.raises(ValueError, match="budget:0.5"):
        resolve_offload("budget:lots")
    with pytest.raises(ValueError, match="not a count"):
        OffloadPolicy("budget", count=2)
    with pytest.raises(ValueError, match="max_slowdown must be"):
        OffloadPolicy("budget", max_slowdown=-1)
    with pytest.raises(ValueError, match="pass layers="):
        plan_offload(v_half_order(2, 4), Costs(transfer=0.5), "budget")
    with pytest.raises(ValueError, match="layers has 2 entries but the order has 4 stages"):
        plan_offload(v_half_order(2, 4), Costs(transfer=0.5), "budget", layers=[2, 2])


@pytest.mark.parametrize("name", sorted(ORDERS))
def test_budget_plans_are_valid_and_move_earliest_layers(name: str) -> None:
    order = ORDERS[name]()
    costs = Costs(transfer=3.0)  # k = 2: whole chunks cannot hide, single layers can
    whole = plan_offload(order, costs, "full")
    plan = plan_offload(order, costs, "budget", layers=4)
    base = simulate(order, costs)
    replay = plan.replay(costs)
    assert replay.makespan == plan.sim.makespan and replay.peak == plan.sim.peak
    for rank, actions in plan.order.items():
        assert flatten(actions) == flatten(order[rank])
        keys = {
            (a.stage_index, a.microbatch_index) for a in actions if a.computation_type in (OFFLOAD, RELOAD)
        }
        assert keys == set(plan.offloaded[rank])
        assert all(plan.layered[k].moved >= 1 for k in keys)
    # the budget stays within its slowdown and lowers the peak where whole chunks cannot
    assert plan.sim.makespan <= base.makespan * 1.03 + 1e-9
    assert plan.sim.peak < base.peak
    assert plan.sim.peak < whole.sim.peak or whole.sim.makespan > base.makespan * 1.03


def test_budget_fraction_is_capped_by_the_window() -> None:
    order = v_half_order(4, 8)
    plan = plan_offload(order, Costs(transfer=3.0), "budget:0.5", layers=4)
    assert {c.moved for c in plan.layered.values()} <= {1, 2} and plan.layered
    # a chunk whose backward follows its forward has no window for a layer copy 3x its forward
    for rank, actions in order.items():
        passes = flatten(actions)
        for (s, kind, j), nxt in zip(passes, passes[1:], strict=False):
            if kind == "F" and nxt[::2] == (s, j):
                assert (s, j) not in plan.layered, (rank, s, j)


def test_budget_auto_with_no_room_moves_nothing() -> None:
    order = v_half_order(2, 4)
    plan = plan_offload(order, Costs(transfer=1000.0), "budget", layers=2)
    assert plan.layered == {} and all(v == [] for v in plan.offloaded.values())
    assert plan.sim.makespan == simulate(order, Costs()).makespan


# --- runtime (gloo) -------------------------------------------------------------------------------------

HIDDEN = 32
ROWS = 48
LAYERS = 3  # per stage
SCHEDULES = (
    ("ScheduleVHalf", "v"),
    ("ScheduleVZB", "v"),
    ("ScheduleZBVZeroBubble", "v"),
    ("ScheduleInterleaved1F1B", "loop"),
)
POLICIES = ("budget:0.67", "budget")


class _Block(nn.Module):
    """A layer whose whole computation is its ``mlp`` submodule (what recompute mode ``mlp`` wraps)."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, HIDDEN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)


def _model(d: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(*[_Block() for _ in range(LAYERS)]) for _ in range(2 * d)])


def _batch(m: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(m * ROWS, HIDDEN, generator=gen), torch.randn(m * ROWS, HIDDEN, generator=gen)


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)


RECOMPUTE_POLICIES = (None, "full", "budget:0.67")  # selective recompute alone and with offload
# recompute plans on a share of each stage's blocks, ceil(0.5 x 3): the first 2; selective on the whole
# block, or on its mlp submodule (here the whole block too: the same bytes)
MIXED = ("selective:0.5", "mlp:0.5", "selective:0.5,mlp")
MIXED_POLICIES = (None, "full", "budget:1")  # budget:1 moves the plain block too
BLOCK_BYTES = ROWS * HIDDEN * 4  # one fp32 activation of a block


_QUEUE_MOVES = {("ScheduleVZB", "budget:0.67"), ("ScheduleVZB", "budget:1")}
"""Where the plans (default costs: a queue the size of a chunk) move W queues between I and W at d = 2, m =
4: V-ZB's W runs late enough after its I. ZBV's does not, and auto budget keeps the drops only where they
lower the peak."""


def _step(rank: int, d: int, m: int, model: nn.Sequential, name: str, placement: str, policy: Any) -> tuple:
    """One step of ``name`` with offload ``policy`` on this rank: (schedule, losses, grads, stage ids)."""
    from torch.distributed.pipelining import PipelineStage

    from pp_offload.runtime.catalog import build_schedule, schedule_info
    from pp_offload.runtime.offload import enable_offload

    x, y = _batch(m)
    ids = (rank, 2 * d - 1 - rank) if placement == "v" else (rank, rank + d)
    model.zero_grad(set_to_none=True)
    stages = [PipelineStage(model[s], s, 2 * d, torch.device("cpu")) for s in ids]
    compat.skip_self_p2p_warmup(stages)  # torch 2.11 + gloo: no warm-up send to the own rank
    kwargs = {"loss_fn": _loss, "scale_grads": False}
    info = schedule_info(name)
    if info.module == "pp_offload.runtime.schedules":
        schedule = build_schedule(info, stages, m, offload=policy, **kwargs)
    else:  # through build_schedule: deferred W for torch's split-backward schedules too
        schedule = build_schedule(info, stages, m, **kwargs)
        enable_offload(schedule, policy)
    losses: list[torch.Tensor] = []
    schedule.step(
        *((x,) if 0 in ids else ()), **({"target": y, "losses": losses} if 2 * d - 1 in ids else {})
    )
    grads = {f"{s}.{n}": p.grad.clone() for s in ids for n, p in model[s].named_parameters()}
    return schedule, [t.detach() for t in losses], grads, ids


def _recompute_run(
    rank: int, d: int, m: int, model: nn.Sequential, name: str, placement: str, policy
) -> dict:
    """One step with the model's checkpointing as it is: losses, grads, what the store captured and how
    many chunks were dropped between I and W."""
    schedule, losses, grads, _ = _step(rank, d, m, model, name, placement, policy)
    runtime = getattr(schedule, "offload", None)  # None: no offload (torch schedules lack it)
    if runtime is not None:
        assert runtime.store.resident_bytes() == 0, "chunks left in the store after a step"
    return {
        "losses": losses,
        "grads": grads,
        "captured": _activations(runtime.store.last_captured) if runtime is not None else {},
        "dropped": 0 if runtime is None else len(runtime.plan.dropped_after_i(rank)),
        "queues": 0 if runtime is None else len(runtime.moved_queues()),
    }


def _activations(captured: dict) -> dict:
    """The store's captures of activations: chunks, or layers (``(stage, microbatch, layer)``), without the
    deferred-W queues a plan moves between I and W (`pp_offload.runtime.offload.queue_key`)."""
    from pp_offload.runtime.offload import is_queue_key

    return {k: v for k, v in captured.items() if not is_queue_key(k)}


def _worker(rank: int, world_size: int, m: int) -> dict:
    from pp_offload.parallel import activation_checkpointing

    d = world_size
    model = _model(d)
    out: dict = {}
    for name, placement in SCHEDULES:
        for policy in POLICIES:
            schedule, losses, grads, ids = _step(rank, d, m, model, name, placement, policy)
            store = schedule.offload.store
            assert store.resident_bytes() == 0, "chunks left in the store after a step"
            captured = _activations(store.last_captured)
            layered = {k: v for k, v in captured.items() if len(k) == 3}
            out[(name, policy)] = {
                "losses": losses,
                "grads": grads,
                "moved_bytes": sum(layered.values()),
                "whole_chunks": len(captured) - len(layered),
                "planned": sum(schedule.offload.moved.values()),
                # the store's layer entries are exactly the planned (stage, microbatch, layer) parts
                "parts_as_planned": set(layered)
                == {(*key, i) for key, n in schedule.offload.moved.items() for i in range(n)},
                # OFFLOADs beyond one per chunk: chunks dropped between I and W
                "dropped": len(schedule.offload.plan.dropped_after_i(rank)),
                "queues": len(schedule.offload.moved_queues()),
            }
    # selective recompute: each block keeps its first Linear's output and recomputes its GELU
    assert activation_checkpointing(dict(enumerate(model)), layers=list, mode="selective") == 2 * d * LAYERS
    for name, placement in SCHEDULES:
        for policy in RECOMPUTE_POLICIES:
            out[("selective", name, policy)] = _recompute_run(rank, d, m, model, name, placement, policy)
    # a recompute plan on a share of each stage's blocks: the first 2 of 3 selective, the last keeps all
    for plan in MIXED:
        assert activation_checkpointing(dict(enumerate(model)), layers=list, mode="none") == 0
        per_stage_count = 3 if plan.endswith(",mlp") else 2
        assert (
            activation_checkpointing(dict(enumerate(model)), layers=list, mode=plan)
            == 2 * d * per_stage_count
        )
        wrapped = [("forward" in vars(b), "forward" in vars(b.mlp)) for stage in model for b in stage]
        last = (False, plan.endswith(",mlp"))  # the third block: plain, or its mlp (then the same bytes)
        per_stage = [(plan.startswith("selective"), plan.startswith("mlp"))] * 2 + [last]
        assert wrapped == per_stage * len(model)
        for name, placement in SCHEDULES:
            for policy in MIXED_POLICIES:
                out[(plan, name, policy)] = _recompute_run(rank, d, m, model, name, placement, policy)
    return out


def _reference(d: int, m: int) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    return sequential_reference(_model(d), *_batch(m), m, _loss)


@functools.cache
def _run(d: int) -> list[dict]:
    return run_on_ranks(_worker, d, 2 * d, timeout=180)


def test_budget_offload_keeps_losses_and_grads() -> None:
    d, m = 2, 4
    ref_losses, ref_grads = _reference(d, m)
    results = _run(d)
    for name, _ in SCHEDULES:
        for policy in POLICIES:
            got = [r[(name, policy)] for r in results]
            losses = [t for g in got for t in g["losses"]]
            torch.testing.assert_close(losses, ref_losses, msg=f"{name} {policy}: losses")
            grads = {k: v for g in got for k, v in g["grads"].items()}
            assert grads.keys() == ref_grads.keys()
            for key, grad in grads.items():
                torch.testing.assert_close(grad, ref_grads[key], msg=f"{name} {policy}: {key}")
            assert sum(g["planned"] for g in got) > 0, f"{name} {policy}: the plan moves no layer"
            assert sum(g["moved_bytes"] for g in got) > 0, f"{name} {policy}: no layer's bytes moved"
            assert all(g["whole_chunks"] == 0 for g in got), f"{name} {policy}: a whole chunk was captured"
            assert all(g["parts_as_planned"] for g in got), (
                f"{name} {policy}: moved layers differ from the plan"
            )
            # deferred W: each chunk dropped between I and W had its W queue moved to host memory and back
            assert [g["queues"] for g in got] == [g["dropped"] for g in got], f"{name} {policy}"
            if (name, policy) in _QUEUE_MOVES:
                assert sum(g["dropped"] for g in got) > 0, f"{name} {policy}: no queue moved between I and W"


@pytest.mark.parametrize(
    ("tag", "policies", "per_layer"),
    [("selective", RECOMPUTE_POLICIES, (1, 2, 2))]
    + [(plan, MIXED_POLICIES, (1, 2, 2) if plan.endswith(",mlp") else (1, 2, 3)) for plan in MIXED],
)
def test_recompute_with_offload_keeps_losses_and_grads(tag: str, policies: tuple, per_layer: tuple) -> None:
    """Selective recompute of every block, and recompute plans on a share of them (``selective:0.5``: each
    stage's first 2 blocks, the third keeps everything; ``mlp:0.5``: the same on the blocks' ``mlp``;
    ``selective:0.5,mlp``: the third on its ``mlp``), alone, with whole-chunk and with budget offload:
    exact, and the cached Linear outputs went through the store. A selective block keeps its first
    Linear's output (its second is the block's last op, which a recomputation never reaches, so it is
    not kept) and, past the stage's first block, its input (the stage input stays in place); a plain
    block the inputs of its Linear, GELU and second Linear. So a moved layer holds ``per_layer`` blocks
    and a whole chunk their sum. Without the cache in the store a selective chunk would hold only block
    inputs."""
    d, m = 2, 4
    ref_losses, ref_grads = _reference(d, m)
    results = _run(d)
    for name, _ in SCHEDULES:
        for policy in policies:
            what = f"{tag} recompute, {name} offload={policy}"
            got = [r[(tag, name, policy)] for r in results]
            torch.testing.assert_close([t for g in got for t in g["losses"]], ref_losses, msg=what)
            grads = {k: v for g in got for k, v in g["grads"].items()}
            assert grads.keys() == ref_grads.keys()
            for key, grad in grads.items():
                torch.testing.assert_close(grad, ref_grads[key], msg=f"{what}: {key}")
            captured = {k: v for g in got for k, v in g["captured"].items()}
            if policy is None:
                assert not captured
                continue
            assert captured, f"{what}: nothing captured"
            for key, nbytes in captured.items():
                want = (sum(per_layer) if len(key) == 2 else per_layer[key[2]]) * BLOCK_BYTES
                assert nbytes == want, f"{what}: {key} captured {nbytes} bytes, expected {want}"
            assert all(len(k) == (2 if policy == "full" else 3) for k in captured), what
            if policy == "budget:1":
                assert {k[2] for k in captured} == {0, 1, 2}, f"{what}: not every layer moved"
            assert [g["queues"] for g in got] == [g["dropped"] for g in got], what
            if (name, policy) in _QUEUE_MOVES:  # recomputed once, in I; its queue moved to host and back
                assert sum(g["dropped"] for g in got) > 0, f"{what}: no queue moved between I and W"


def test_offload_after_reload_drops_without_a_copy() -> None:
    # chunk 0 reloaded for I, dropped after I (no copy: its host copy is exact), reloaded again for W
    order = {
        0: [
            Action(0, "F", 0),
            Action(0, OFFLOAD, 0),
            Action(0, "F", 1),
            Action(0, RELOAD, 0),
            Action(0, "I", 0),
            Action(0, OFFLOAD, 0),
            Action(0, "I", 1),
            Action(0, RELOAD, 0),
            Action(0, "W", 0),
            Action(0, "W", 1),
        ]
    }
    whole = simulate(order, Costs(transfer=0.5))
    kinds = [(str(a), s, e) for a, s, e in whole.transfers[0]]
    # passes take 2 (scale 2), copies 1: 0I0 waits for its reload until 5 and ends at 7
    assert kinds[2] == ("0OFFLOAD0", 7.0, 7.0)  # issued when 0I0 ends, frees at once
    assert kinds[3] == ("0RELOAD0", 9.0, 10.0)  # issued when 0I1 ends: 0W0 waits 1 for it
    assert whole.reload_wait[0] == pytest.approx(2.0)
    assert dict(whole.memory_curve[0])[7.0] == pytest.approx(2.0)  # 0F1's 2 units only
    layered = simulate(order, Costs(), layered={(0, 0): LayeredChunk(2, 4, layer_copy=0.25)})
    drops = [(layer, s, e) for a, layer, s, e in layered.layer_transfers[0] if s == e]
    assert drops == [(0, 6.0, 6.0), (1, 6.0, 6.0)]


@pytest.mark.parametrize("name", ["v-zb", "zbv"])
def test_budget_drops_chunks_between_i_and_w_on_zero_bubble_orders(name: str) -> None:
    order = ORDERS[name]()
    costs = Costs(transfer=0.5)
    with_drop = plan_offload(order, costs, "budget:1", layers=2)
    without = plan_offload(order, costs, {"mode": "budget", "fraction": 1.0, "drop_after_i": False}, layers=2)
    twice = 0
    for rank, actions in with_drop.order.items():
        for key in with_drop.offloaded[rank]:
            kinds = [a.computation_type for a in actions if (a.stage_index, a.microbatch_index) == key]
            if kinds.count(OFFLOAD) == 2:  # F OFFLOAD [RELOAD] I OFFLOAD RELOAD W, in that order
                twice += 1
                assert [k for k in kinds if k != RELOAD] == ["F", OFFLOAD, "I", OFFLOAD, "W"]
                assert kinds.index(RELOAD) < kinds.index("I") and kinds[-2:] == [RELOAD, "W"]
    assert twice > 0
    assert with_drop.sim.peak < without.sim.peak
    assert with_drop.replay(costs).peak == with_drop.sim.peak
