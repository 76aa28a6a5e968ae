"""The runtime places offload exactly as the planner predicts, when it gets the planner's figures.

Offline: every rank's schedule is built with torch's mock stages (holding as many real layer modules as the
planner's split gives the stage), so `enable_offload` runs its real code path: plan, then insertion into
torch's lowered order. The planner's plan is `pp_offload.plan.evaluate.offload_plan` on the order
`build_orders` makes, exactly what `pp_offload.plan.plan` replays for its table.
"""

from __future__ import annotations

import functools
import json
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed.pipelining as tp
from torch import nn
from torch.distributed.pipelining import PipelineStage
from transformers import AutoConfig

import pp_offload
from pp_offload.order.actions import Costs
from pp_offload.order.offload_inputs import OffloadInputs, StageBytes
from pp_offload.plan import offload_inputs
from pp_offload.plan.evaluate import Setup, build_orders, offload_plan
from pp_offload.plan.handoff import planner_setup
from pp_offload.runtime import compat
from pp_offload.runtime.offload import enable_offload

D, M = 4, 8  # m <= 4 * pp: the planner replays the order of exactly this m (no extrapolation)
SCHEDULES = ("ScheduleVHalf", "ScheduleVZB", "ScheduleInterleaved1F1B")
SETTING = {"seq_len": 4096, "microbatch_size": 1, "num_microbatches": M, "pp": D}


@functools.cache
def _setup(name: str) -> Setup:
    return planner_setup("llama-3-8b", schedule=name, machine="H100", **SETTING)


@functools.cache
def _planner_order(name: str) -> Any:
    return build_orders(_setup(name), [M], search="full", virtual_stages=2).orders[M]


def _stages(name: str, rank: int, layers: tuple[int, ...], d: int = D, layer: Any = nn.Identity) -> list[Any]:
    """This rank's mock stages, each holding its stage's layers as real modules (``layer()``: identities)."""
    ids = (rank, 2 * d - 1 - rank) if name != "ScheduleInterleaved1F1B" else (rank, rank + d)
    out = []
    for s in ids:
        stage = mock.create_autospec(PipelineStage, instance=True)
        stage.group_rank, stage.group_size, stage.num_stages, stage.stage_index = rank, d, len(layers), s
        stage.submod = nn.ModuleList(layer() for _ in range(layers[s]))
        stage.device = torch.device("cpu")
        out.append(stage)
    return out


def _runtime(
    name: str, rank: int, policy: str, layers: tuple[int, ...], layer: Any = nn.Identity, **figures: Any
) -> Any:
    """``name`` built on ``rank`` with offload ``policy``: ours through their ``offload=`` argument,
    torch's through `enable_offload` (``figures``: ``inputs=`` or ``costs=``)."""
    stages = _stages(name, rank, layers, layer=layer)
    if hasattr(pp_offload, name):
        if "inputs" in figures:
            figures = {"offload_inputs": figures["inputs"]}
        return getattr(pp_offload, name)(stages, M, offload=policy, **figures)
    schedule = getattr(tp, name)(stages, M)
    enable_offload(schedule, policy, **figures)
    return schedule


def _executed(actions: list[Any]) -> list[str]:
    """Compute passes and copies of a lowered order, as the runtime executes them: deferred W runs every
    stage's I and W as written (`pp_offload.runtime.deferred_w`)."""
    out = []
    for a in actions:
        kind = str(getattr(a.computation_type, "value", a.computation_type))
        if kind in ("F", "I", "W", "B", "OFFLOAD", "RELOAD"):
            out.append(f"{a.stage_index}{kind}{a.microbatch_index}")
    return out


def _differences(schedule: Any, planned: Any, rank: int) -> list[str]:
    plan = schedule.offload.plan
    found = []
    if plan.offloaded != planned.offloaded:
        found.append("chunks")
    if {k: c.moved for k, c in plan.layered.items()} != {k: c.moved for k, c in planned.layered.items()}:
        found.append("moved layers per chunk")
    if {r: list(map(str, a)) for r, a in plan.order.items()} != {
        r: list(map(str, a)) for r, a in planned.order.items()
    }:
        found.append("OFFLOAD/RELOAD positions in the plan")
    if _executed(compat.lowered_order(schedule)[rank]) != [str(a) for a in planned.order[rank]]:
        found.append("OFFLOAD/RELOAD positions in torch's lowered order")
    return found


@pytest.mark.parametrize("policy", ["budget", "budget:0.5"])
@pytest.mark.parametrize("name", SCHEDULES)
def test_runtime_places_the_planners_offload(name: str, policy: str) -> None:
    setup = _setup(name)
    planned = offload_plan(setup, _planner_order(name), policy)
    assert planned.layered and sum(c.moved for c in planned.layered.values()) > 0, "the planner moves nothing"
    inputs = setup.offload_inputs()
    for rank in range(D):
        schedule = _runtime(name, rank, policy, inputs.layers, inputs=inputs)
        assert _differences(schedule, planned, rank) == [], f"{name} {policy} rank {rank}"
        assert schedule.offload.moved == {
            k: planned.layered[k].moved for k in planned.offloaded[rank] if k in planned.layered
        }


@pytest.mark.parametrize("name", SCHEDULES)
def test_without_the_planners_figures_the_plan_differs(name: str) -> None:
    """Why the figures travel: scalar costs and this rank's layer counts place budget offload elsewhere
    (the embedding's and the head's stages weigh differently, and the budget lowers bytes, not chunks)."""
    setup = _setup(name)
    planned = offload_plan(setup, _planner_order(name), "budget")
    inputs = setup.offload_inputs()
    scalar = {k: getattr(inputs.costs, k) for k in ("F", "I", "W", "comm", "transfer")}
    found = [
        _differences(_runtime(name, rank, "budget", inputs.layers, costs=scalar), planned, rank)
        for rank in range(D)
    ]
    assert any(found), f"{name}: the runtime placed the planner's plan without the planner's figures"


def test_planner_public_entry_gives_the_setups_figures() -> None:
    got = offload_inputs("llama-3-8b", schedule="V-Half", machine="H100", **SETTING)
    assert got == _setup("ScheduleVHalf").offload_inputs()
    assert sum(got.layers) == 32 and got.costs.stages is not None and len(got.costs.stages) == 2 * D
    # the LM head's stage saves more per microbatch than a stage of as many decoder layers
    last, inner = got.stage_bytes[-1], got.stage_bytes[1]
    assert last.total / got.layers[-1] > inner.total / got.layers[1]
    split = [4, 4, 4, 4, 4, 4, 4, 4]
    assert offload_inputs("llama-3-8b", schedule="V-Half", layers_per_stage=split, **SETTING).layers == tuple(
        split
    )
    with pytest.raises(ValueError, match="summing to the model's 32 layers"):
        offload_inputs("llama-3-8b", schedule="V-Half", layers_per_stage=[4] * 7 + [3], **SETTING)


def test_offload_inputs_survive_json_and_check_their_fields() -> None:
    inputs = _setup("ScheduleVZB").offload_inputs()
    again = OffloadInputs.from_dict(json.loads(json.dumps(inputs.to_dict())))
    assert again == inputs
    with pytest.raises(ValueError, match="layer_copy has 1 entries for 2 stages"):
        OffloadInputs(Costs(), (1, 1), (0.1,))
    with pytest.raises(ValueError, match="stage_bytes has 1 entries for 2 stages"):
        OffloadInputs(Costs(), (1, 1), (0.1, 0.1), (StageBytes(8),))
    with pytest.raises(ValueError, match=r"StageBytes.saved must be an int >= 0"):
        StageBytes(-1)
    with pytest.raises(ValueError, match="unknown OffloadInputs keys"):
        OffloadInputs.from_dict({**inputs.to_dict(), "stages": 3})


def test_runtime_refuses_figures_that_do_not_describe_its_stages() -> None:
    inputs = _setup("ScheduleVHalf").offload_inputs()
    other = list(inputs.layers)
    other[0] += 1
    with pytest.raises(ValueError, match="stage 0 holds 5 layers, inputs say 4"):
        _runtime("ScheduleInterleaved1F1B", 0, "budget", tuple(other), inputs=inputs)
    with pytest.raises(ValueError, match="costs= or inputs="):
        _runtime("ScheduleInterleaved1F1B", 0, "budget", inputs.layers, inputs=inputs, costs={"F": 1.0})
    short = OffloadInputs(Costs(), inputs.layers[:4], inputs.layer_copy[:4])
    with pytest.raises(ValueError, match="describe 4 stages but the schedule's order has 8"):
        _runtime("ScheduleInterleaved1F1B", 0, "budget", inputs.layers, inputs=short)


# --- schedule: auto hands the runtime what it chose with -----------------------------------------------


def _imbalanced_measurement(d: int) -> Any:
    """Per stage 10 ms passes, 4 layers, 4 MiB saved and 4 ms copies; the last stage (LM head and loss)
    slower and heavier, stage 0 without an input gradient (torch runs its backward at W)."""
    from dataclasses import replace

    from pp_offload.plan.probe import Measurement, StageMeasurement

    mib = 1 << 20
    plain = StageMeasurement(
        F=0.010, I=0.010, W=0.010, saved_bytes=4 * mib, offload=0.004, reload=0.004, layers=4
    )
    stages = [plain] * (2 * d)
    stages[0] = replace(plain, I=1e-6, W=0.020)
    stages[-1] = replace(plain, F=0.016, I=0.016, W=0.014, saved_bytes=7 * mib, offload=0.007, reload=0.007)
    return Measurement(d, tuple(stages), comm=0.0005, copies_overlap=True, device="hand-made")


@pytest.mark.parametrize("name", ["ScheduleVHalf", "ScheduleInterleaved1F1B"])
def test_auto_decision_carries_the_figures_its_plan_was_judged_with(name: str) -> None:
    """What the recipe does with a decision (``costs=decision.costs``, ``offload_inputs=``) places the
    offload plan ``choose`` judged the pick by."""
    from pp_offload.plan import auto

    d, m = 2, 4
    measured = _imbalanced_measurement(d)
    decision = auto.choose(measured, num_microbatches=m, schedules=[name], offload=["budget"])
    assert (decision.schedule, decision.offload) == (name, "budget")
    setup = auto._setup(measured, name, m)
    order = build_orders(setup, [m], search="full", virtual_stages=2).orders[m]
    judged = offload_plan(setup, order, "budget")
    assert sum(c.moved for c in judged.layered.values()) > 0
    inputs = OffloadInputs.from_dict(json.loads(json.dumps(decision.offload_inputs)))  # as broadcast
    for rank in range(d):
        stages = _stages(name, rank, inputs.layers, d)
        if hasattr(pp_offload, name):
            figures = {"costs": decision.costs, "offload_inputs": decision.offload_inputs}
            schedule = getattr(pp_offload, name)(stages, m, offload=decision.offload, **figures)
        else:
            schedule = getattr(tp, name)(stages, m)
            enable_offload(schedule, decision.offload, inputs=decision.offload_inputs)
        assert _differences(schedule, judged, rank) == [], f"{name} rank {rank}"
    plain = auto.choose(measured, num_microbatches=m, schedules=[name], offload=["none"])
    assert plain.offload_inputs is None


# --- a budget set by hand in the recipe -----------------------------------------------------------------

TINY_LLAMA = {
    "vocab_size": 256,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def _recipe(offload: str, **pipeline: Any) -> Any:
    from pp_offload.recipe import RecipeConfig

    return RecipeConfig.from_dict(
        {
            "model": {"config": {"model_type": "llama", **TINY_LLAMA}},
            "data": {"path": "embedded", "seq_len": 32},
            "pipeline": {"schedule": "ScheduleVHalf", "microbatches": 4, "offload": offload, **pipeline},
            "train": {"steps": 1, "global_batch_size": 8},
        }
    )


def _figures(config: Any, model: Any, schedule: str = "ScheduleVHalf") -> Any:
    from pp_offload.recipe.offload_figures import planner_offload_inputs

    return planner_offload_inputs(
        config,
        model,
        schedule=schedule,
        stages_per_rank=2,
        pp=2,
        dp=1,
        layers_per_stage=[1, 3, 3, 1],
        device=torch.device("cpu"),
        log=True,
    )


def test_recipe_gives_a_hand_set_budget_the_planners_figures(capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))
    got = _figures(_recipe("budget:0.5"), model)
    want = offload_inputs(
        model.config,
        schedule="ScheduleVHalf",
        pp=2,
        seq_len=32,
        microbatch_size=2,  # 8 sequences over 4 microbatches
        num_microbatches=4,
        machine="H100",  # a CPU run rehearses the H100 preset
        dtype="fp32",
        layers_per_stage=[1, 3, 3, 1],  # the split the pipeline was built with, not the planner's own
    )
    assert got == want
    assert "placed with the planner's per-stage figures" in capsys.readouterr().out
    # falls back to today's plan, and says why
    assert _figures(_recipe("budget", costs={"F": 1.0, "I": 1.0, "W": 1.0}), model) is None
    assert "pipeline.costs is set" in capsys.readouterr().out
    assert _figures(_recipe("budget"), model, schedule="ScheduleLoopedBFS") is None
    assert "the planner does not evaluate ScheduleLoopedBFS" in capsys.readouterr().out
    moe = SimpleNamespace(config=AutoConfig.for_model("mixtral", num_hidden_layers=8))
    assert _figures(_recipe("budget"), moe) is None
    assert "the planner cannot model this run (mixtral: mixture-of-experts" in capsys.readouterr().out
    # whole-chunk policies keep their plan from the costs, silently
    assert _figures(_recipe("full"), model) is None
    assert capsys.readouterr().out == ""
