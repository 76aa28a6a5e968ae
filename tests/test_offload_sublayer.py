"""Sub-layer offload units (``granularity="sublayer"``): a decoder layer's attention half, then the rest.

Offline: the policy's parsing and errors, the simulator's per-unit compute shares, the planner's per-unit
bytes against what the runtime's hooks capture per unit on real HF Llama and GPT-2 stages (under recompute
plans too), and that planner and runtime count the same units. Multi-process (gloo, 2 ranks): the same
losses and gradients as one process on V-Half, V-ZB, ZBV and Interleaved1F1B, alone and under a recompute
plan (FSDP: tests/test_fsdp_gloo.py)."""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from _dist import run_on_ranks
from _reference import sequential_reference
from test_offload_budget import BLOCK_BYTES, HIDDEN, ONE_CHUNK, SCHEDULES, _activations, _batch, _loss, _step
from test_recompute_plan import TINY_STAGE
from torch import nn

from pp_offload.order import Costs
from pp_offload.order.offload import OffloadPolicy, resolve_offload
from pp_offload.plan.model import model_spec
from pp_offload.sim import LayeredChunk, simulate

# --- policy and simulator ---------------------------------------------------------------------------------


def test_sublayer_policy_parsing_and_errors() -> None:
    assert resolve_offload("budget:sublayer") == OffloadPolicy("budget", granularity="sublayer")
    assert resolve_offload("budget:0.5:sublayer") == OffloadPolicy(
        "budget", fraction=0.5, granularity="sublayer"
    )
    got = resolve_offload("budget:auto:0.1:close-w:sublayer")
    assert (got.max_slowdown, got.close_w, got.granularity) == (0.1, True, "sublayer")
    assert resolve_offload("budget:sublayer:close-w") == OffloadPolicy(
        "budget", close_w=True, granularity="sublayer"
    )
    assert resolve_offload({"mode": "budget", "granularity": "sublayer"}).granularity == "sublayer"
    assert resolve_offload("budget").granularity == "layer"
    with pytest.raises(ValueError, match="granularity must be 'layer'"):
        OffloadPolicy("budget", granularity="half")
    with pytest.raises(ValueError, match="moves whole chunks"):
        OffloadPolicy("full", granularity="sublayer")
    with pytest.raises(ValueError, match="sublayer"):
        resolve_offload("budget:sublayr")


def test_unit_copies_start_at_their_share_of_the_forward_and_the_backward_waits_per_unit() -> None:
    """Two units of shares 0.25 / 0.75 (an attention half, then an MLP half): the first unit's copy starts a
    quarter into the F pass (scale 2: F takes 2), the second at its end; the reload brings the second back
    first, and the I pass runs the second unit's 0.75 share before it needs the first."""
    spec = LayeredChunk(2, 2, layer_copy=(0.5, 1.5), compute=(0.25, 0.75))
    sim = simulate(ONE_CHUNK, Costs(), layered={(0, 0): spec})
    copies = [(str(a), unit, s, e) for a, unit, s, e in sim.layer_transfers[0]]
    assert copies[:2] == [("0OFFLOAD0", 0, 0.5, 1.0), ("0OFFLOAD0", 1, 2.0, 3.5)]
    assert copies[2:] == [("0RELOAD0", 1, 4.0, 5.5), ("0RELOAD0", 0, 5.5, 6.0)]
    i_pass = next(x for x in sim.timeline[0] if x[0] == (0, "I", 0))
    # unit 1 (1.5 of I) from 5.5 to 7.0; unit 0 (0.5) needs its reload (6.0) and ends at 7.5
    assert i_pass[1:] == (4.0, 7.5)
    even = simulate(ONE_CHUNK, Costs(), layered={(0, 0): LayeredChunk(2, 2, layer_copy=(0.5, 1.5))})
    assert [s for _, _, s, _ in even.layer_transfers[0][:1]] == [1.0]  # equal shares: half-way through F
    for bad in ((0.5,), (0.5, 0.6), (-0.5, 1.5)):
        with pytest.raises(ValueError, match="shares"):
            LayeredChunk(1, 2, compute=bad)


# --- planner bytes == what the runtime's unit hooks capture ------------------------------------------------

TINY_GPT2 = {
    "n_embd": 64,
    "n_inner": 192,
    "n_head": 4,
    "n_layer": 4,
    "vocab_size": 64,
    "resid_pdrop": 0.0,
    "embd_pdrop": 0.0,
    "attn_pdrop": 0.0,
}
SEQ = 96  # every activation above the store's 1024-element floor except norm statistics and the lse


def tiny_stage(family: str, plan: str) -> tuple[Any, torch.Tensor]:
    """A middle stage (4 layers, bf16, sdpa) of a tiny HF model under recompute ``plan`` (its module as a
    pipeline stage's ``submod``) and an input for it."""
    from transformers import AutoModel, GPT2Config, LlamaConfig

    from pp_offload.parallel import activation_checkpointing

    config = (
        LlamaConfig(**TINY_STAGE, attn_implementation="sdpa")
        if family == "llama"
        else GPT2Config(**TINY_GPT2, attn_implementation="sdpa")
    )
    torch.manual_seed(0)
    model = AutoModel.from_config(config).to(torch.bfloat16).train()
    layers = list(model.layers if family == "llama" else model.h)
    if plan != "none":
        activation_checkpointing({0: model}, layers=lambda _: layers, mode=plan)
    x = torch.randn(1, SEQ, config.hidden_size).to(torch.bfloat16).requires_grad_(True)
    return SimpleNamespace(stage_index=0, submod=model), x


def unit_capture(family: str, plan: str, granularity: str = "sublayer") -> tuple[dict, int]:
    """`tiny_stage`'s forward run with the runtime's budget-offload hooks
    (`pp_offload.runtime.offload._hook_units`) moving every unit (sub-layer units, or whole layers): the
    bytes each unit's store entry captured, and the units the runtime counts."""
    from pp_offload.runtime.offload import OffloadRuntime, _hook_units, stage_units, unit_count
    from pp_offload.runtime.store import ActivationStore

    stage, x = tiny_stage(family, plan)
    model = stage.submod
    units = stage_units(stage, granularity)
    runtime = OffloadRuntime(plan=None, store=ActivationStore("cpu"), offloaded=set())  # type: ignore[arg-type]
    _hook_units(stage, runtime, units)
    runtime._active = ((0, 0), unit_count(units), [x])
    out = model(inputs_embeds=x, use_cache=False).last_hidden_state
    runtime._active = None
    store = runtime.store
    assert all(store.state(k) == "offloaded" for k in store.last_captured), "a unit was not offloaded"
    for u in range(unit_count(units) - 1, -1, -1):  # the backward runs on the reloaded units
        store.reload((0, 0, u))
    out.float().pow(2).sum().backward()
    return {k[2]: v for k, v in store.last_captured.items()}, unit_count(units)


@pytest.mark.parametrize(
    ("family", "plan"),
    [
        ("llama", "none"),
        ("llama", "mlp"),
        ("llama", "selective:0.5,mlp"),
        ("llama", "full:0.5"),
        ("gpt2", "none"),
        ("gpt2", "mlp:0.5"),
        ("gpt2", "selective:0.25"),
    ],
)
def test_planner_unit_bytes_equal_what_the_runtime_captures_per_unit(family: str, plan: str) -> None:
    """Per unit, first layer first: the planner's `layers_unit_bytes` equal the runtime hooks' store entries
    exactly (a Llama layer's attention unit also holds the stage's rotary cos/sin, which the planner counts
    once per stage), the units split where the planner splits them (layers checkpointed as a whole stay one
    unit), and the planner's unit count is the runtime's."""
    from pp_offload.plan.memory import layers_activation_bytes, layers_unit_bytes
    from pp_offload.recompute_plan import parse_recompute

    config = TINY_STAGE if family == "llama" else TINY_GPT2
    spec = model_spec({"model_type": family, **config})
    # GPT2Model adds the position embeddings to inputs_embeds: its first layer's input is a new tensor, not
    # the (kept) stage input, as on the embedding's stage
    kw = {"microbatch_size": 1, "seq_len": SEQ, "recompute": plan, "first": family == "gpt2"}
    units = layers_unit_bytes(spec, "bf16", layers=4, **kw)
    assert [sum(u) for u in units] == layers_activation_bytes(spec, "bf16", layers=4, **kw)
    captured, count = unit_capture(family, plan)
    flat = [b for layer in units for b in layer]
    assert count == len(flat)
    modes = parse_recompute(plan).modes(4)
    assert [len(u) for u in units] == [1 if m in ("full", "selective") else 2 for m in modes]
    rotary = 2 * 2 * SEQ * spec.head_dim if family == "llama" else 0
    want, index = [], 0
    for layer, mode in zip(units, modes, strict=True):
        for i, nbytes in enumerate(layer):
            want.append(nbytes + (rotary if i == 0 and mode in ("none", "mlp") else 0))
            index += 1
    assert [captured[u] for u in range(count)] == want
    if plan == "none":  # the attention half is about a quarter of a Llama layer's bytes
        share = units[1][0] / sum(units[1])
        assert 0.15 < share < 0.5, share


def test_planner_inputs_count_units_and_shares() -> None:
    """`Setup.offload_inputs("sublayer")`: per stage two units per layer, copy times in proportion to their
    bytes, compute shares from the FLOPs (the MLP half heavier at seq 4096, attention's share growing with
    the sequence), and a runtime check that refuses inputs of the other granularity."""
    from pp_offload.plan.costs import layer_unit_shares
    from pp_offload.plan.handoff import planner_setup
    from pp_offload.plan.shapes import SHAPES
    from pp_offload.runtime.offload import _check_inputs

    setup = planner_setup(
        SHAPES["llama-3-8b"], schedule="ScheduleVHalf", pp=4, seq_len=4096, microbatch_size=1,
        num_microbatches=8, machine="H100",
    )  # fmt: skip
    layer, units = setup.offload_inputs(), setup.offload_inputs("sublayer")
    assert units.granularity == "sublayer" and units.layers == tuple(2 * n for n in layer.layers)
    s = 1
    copies = units.layer_copy[s]
    per_unit = units.stage_bytes[s].per_layer
    assert copies[0] / copies[1] == pytest.approx(per_unit[0] / per_unit[1])
    assert sum(per_unit) == sum(setup.layers_bytes[s])
    attention, mlp = layer_unit_shares(model_spec(SHAPES["llama-3-8b"]), seq_len=4096)
    assert units.unit_compute[s][:2] == pytest.approx((attention / layer.layers[s], mlp / layer.layers[s]))
    assert 0.2 < attention < 0.5 < mlp
    longer, _ = layer_unit_shares(model_spec(SHAPES["llama-3-8b"]), seq_len=16384)
    assert longer > attention
    assert units.from_dict(units.to_dict()) == units
    with pytest.raises(ValueError, match="granularity"):
        _check_inputs(units, len(units.layers), {0: []}, "layer")


class _Halves(nn.Module):
    """A mock decoder layer with an attention child: two sub-layer units for the runtime."""

    def __init__(self) -> None:
        super().__init__()
        self.self_attn, self.mlp = nn.Identity(), nn.Identity()


@pytest.mark.parametrize("policy", ["budget:sublayer", "budget:0.5:sublayer"])
@pytest.mark.parametrize("name", ["ScheduleVZB", "ScheduleInterleaved1F1B"])
def test_runtime_places_the_planners_sublayer_offload(name: str, policy: str) -> None:
    """With the planner's sub-layer figures the runtime's plan is the planner's, unit for unit and position
    for position (as `test_offload_handoff` checks for layers), on stages whose layers it splits itself;
    stages whose layers it cannot split (no attention child) refuse the figures."""
    from test_offload_handoff import D, _differences, _planner_order, _runtime, _setup

    from pp_offload.plan.evaluate import offload_plan

    setup = _setup(name)
    planned = offload_plan(setup, _planner_order(name), policy)
    assert sum(c.moved for c in planned.layered.values()) > 0, "the planner moves nothing"
    inputs = setup.offload_inputs("sublayer")
    layers = tuple(n // 2 for n in inputs.layers)
    for rank in range(D):
        schedule = _runtime(name, rank, policy, layers, layer=_Halves, inputs=inputs)
        assert _differences(schedule, planned, rank) == [], f"{name} {policy} rank {rank}"
    with pytest.raises(ValueError, match="sub-layer units, inputs say"):
        _runtime(name, 0, policy, layers, inputs=inputs)


# --- runtime (gloo) ---------------------------------------------------------------------------------------

LAYERS = 2  # per stage: 4 units
POLICIES = ("budget:0.75:sublayer", "budget:sublayer")


class _Block(nn.Module):
    """A layer with an attention-like half (``attn``: its input and GELU input saved) and an MLP half."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.GELU())
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, HIDDEN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(x)
        return h + self.mlp(h)


def _model(d: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(*[_Block() for _ in range(LAYERS)]) for _ in range(2 * d)])


def _unit_step(
    rank: int, d: int, m: int, model: nn.Sequential, name: str, placement: str, policy: Any
) -> dict:
    """One step (`test_offload_budget._step`): losses, grads, what the store captured and what was planned."""
    schedule, losses, grads, _ = _step(rank, d, m, model, name, placement, policy)
    runtime = schedule.offload
    assert runtime.store.resident_bytes() == 0, "units left in the store after a step"
    return {
        "losses": losses,
        "grads": grads,
        "captured": _activations(runtime.store.last_captured),
        "planned": {(*key, i) for key, n in runtime.moved.items() for i in range(n)},
    }


def _worker(rank: int, world_size: int, m: int) -> dict:
    from pp_offload.parallel import activation_checkpointing

    d, model = world_size, _model(world_size)
    out: dict = {
        (name, policy): _unit_step(rank, d, m, model, name, placement, policy)
        for name, placement in SCHEDULES
        for policy in POLICIES
    }
    # a recompute plan: each stage's first block checkpointed whole (one unit), the second on its mlp
    assert activation_checkpointing(dict(enumerate(model)), layers=list, mode="selective:0.5,mlp") == 4 * d
    out["plan"] = _unit_step(rank, d, m, model, "ScheduleVZB", "v", "budget:1:sublayer")
    return out


@functools.cache
def _run(d: int) -> list[dict]:
    return run_on_ranks(_worker, d, 2 * d, timeout=180)


def _check(got: list[dict], ref_losses: list, ref_grads: dict, what: str) -> None:
    torch.testing.assert_close([t for g in got for t in g["losses"]], ref_losses, msg=f"{what}: losses")
    grads = {k: v for g in got for k, v in g["grads"].items()}
    assert grads.keys() == ref_grads.keys()
    for key, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[key], msg=f"{what}: {key}")
    for g in got:
        assert g["planned"], f"{what}: the plan moves no unit"
        assert set(g["captured"]) == g["planned"], f"{what}: captured units differ from the plan"


def test_sublayer_budget_offload_keeps_losses_and_grads() -> None:
    """Every schedule, a fraction and the auto budget: exact, and the store's entries are exactly the
    planned (stage, microbatch, unit) keys, each a block half: the attention unit its input and GELU input
    (2 activations; the stage's first block's input is the receive buffer, kept in place), the MLP unit
    its Linear, GELU and second Linear inputs (3)."""
    d, m = 2, 4
    ref_losses, ref_grads = sequential_reference(_model(d), *_batch(m), m, _loss)
    results = _run(d)
    want = {0: 1, 1: 3, 2: 2, 3: 3}  # per unit of a 2-block stage, in activations
    for name, _ in SCHEDULES:
        for policy in POLICIES:
            got = [r[(name, policy)] for r in results]
            _check(got, ref_losses, ref_grads, f"{name} {policy}")
            for g in got:
                for key, nbytes in g["captured"].items():
                    assert nbytes == want[key[2]] * BLOCK_BYTES, (name, policy, key, nbytes)


def test_sublayer_budget_offload_with_a_recompute_plan_keeps_losses_and_grads() -> None:
    """``selective:0.5,mlp``: each stage's first block checkpointed whole (one unit: its cache of the first
    Linear outputs, the stage input staying in place), the second block's attention half plain and its
    MLP half recomputed (its first Linear's output kept): 3 units per stage, exact."""
    d, m = 2, 4
    ref_losses, ref_grads = sequential_reference(_model(d), *_batch(m), m, _loss)
    got = [r["plan"] for r in _run(d)]
    _check(got, ref_losses, ref_grads, "selective:0.5,mlp V-ZB budget:1:sublayer")
    units = {key[2] for g in got for key in g["captured"]}
    assert units == {0, 1, 2}, units
