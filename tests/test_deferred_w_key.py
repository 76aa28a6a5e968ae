"""``pipeline.deferred_w``: the recipe's choice between deferred weight gradients and torch's retained-graph
split, and the planner's figures that follow it (config, preflight, the planner's bytes, times and orders,
``schedule: auto``'s pricing, ``pp-offload plan --split``, and one 2-rank run: the split changes no math)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest

from pp_offload.plan.auto import RecomputeOption
from pp_offload.plan.probe import Measurement, predicted_measurement
from pp_offload.plan.recompute_calibration import ModeCost, RecomputeCalibration
from pp_offload.recipe import ConfigError, RecipeConfig, load_config
from pp_offload.recipe.preflight import check_pipeline
from pp_offload.recipe.topology import Topology

# A Llama small enough to plan in milliseconds, with layers wide enough that the queue shows
TINY = {
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1024,
}
SETTING = {"pp": 2, "seq_len": 256, "microbatch_size": 1, "num_microbatches": 4, "machine": "H100"}


def _recipe(**pipeline) -> RecipeConfig:
    from _tiny_hf import RECIPE_LLAMA

    return RecipeConfig.from_dict(
        {
            "model": {"config": RECIPE_LLAMA},
            "data": {"path": "embedded", "seq_len": 32},
            "pipeline": {"schedule": "ScheduleVHalf", "microbatches": 4, **pipeline},
            "train": {"global_batch_size": 8},
        }
    )


# config


def test_the_key_defaults_to_deferred_w_and_reads_a_bool() -> None:
    assert load_config().pipeline.deferred_w is True
    assert load_config(overrides=["pipeline.deferred_w=false"]).pipeline.deferred_w is False


@pytest.mark.parametrize("value", ["torch", "0", "null", "[true]"])
def test_a_value_that_is_not_a_bool_is_named(value: str) -> None:
    with pytest.raises(ConfigError, match=r"pipeline\.deferred_w=.* must be true or false"):
        load_config(overrides=[f"pipeline.deferred_w={value}"])


def test_the_config_reference_explains_the_key() -> None:
    from pp_offload.recipe.config_doc import attribute_docs

    text = " ".join(attribute_docs(type(load_config().pipeline))["deferred_w"].split())
    for words in ("recompute", "third run", "train.compile", "changes nothing"):
        assert words in text


# preflight


def _preflight(config: RecipeConfig) -> None:
    check_pipeline(config, Topology(rank=0, world=2, local_rank=0, pp=2, dp=1), 4)


@pytest.mark.parametrize(
    ("schedule", "where"),
    [("ScheduleVHalf", "ScheduleVHalf"), ("auto", "auto (its probe runs ScheduleVMin)")],
)
def test_compile_on_torchs_split_stops_in_preflight_naming_both_keys(schedule: str, where: str) -> None:
    config = _recipe(schedule=schedule, deferred_w=False)
    config.train.compile = True
    with pytest.raises(ConfigError) as caught:
        _preflight(config)
    message = str(caught.value)
    assert "\n" not in message and where in message
    assert "train.compile" in message and "pipeline.deferred_w=false" in message
    assert "set pipeline.deferred_w=true" in message  # the fix


def test_torchs_split_is_accepted_without_compile_and_anywhere_without_split_backward() -> None:
    _preflight(_recipe(deferred_w=False))
    config = _recipe(schedule="ScheduleInterleaved1F1B", deferred_w=False)
    config.train.compile = True  # no split backward: one backward per microbatch, the key changes nothing
    _preflight(config)


def test_check_notes_what_the_key_does_once(tmp_path: Path) -> None:
    from pp_offload.recipe.dry_build import _split_notes

    assert _split_notes(_recipe()) == []
    (torch_split,) = _split_notes(_recipe(deferred_w=False))
    assert "retained graph" in torch_split and "3 times" in torch_split
    (nothing,) = _split_notes(_recipe(schedule="ScheduleInterleaved1F1B", deferred_w=False))
    assert "changes nothing" in nothing


# the planner's figures


def _setup(deferred_w: bool, recompute: str = "full", schedule: str = "ScheduleVHalf"):
    from pp_offload.plan.handoff import planner_setup

    return planner_setup(TINY, schedule=schedule, recompute=recompute, deferred_w=deferred_w, **SETTING)


def test_with_recompute_the_queue_outweighs_what_torchs_split_holds_from_i_to_w() -> None:
    """Deferred W holds each stage's queue from I to W, torch's split its saved tensors: with full recompute
    the queue is the larger, per stage; torch's split queues nothing."""
    deferred, torch_split = _setup(True), _setup(False)
    for d, t in zip(deferred.stages, torch_split.stages, strict=True):
        assert t.activation.queued is None and d.activation.queued is not None
        assert d.activation.saved == t.activation.saved  # the same layers save the same
        if d.layers:
            assert d.activation.queued > t.activation.saved
    inputs = torch_split.offload_inputs()  # what the recipe's budget offload is placed with
    assert all(b.queued is None for b in inputs.stage_bytes)
    assert all(b.queued is not None for b in deferred.offload_inputs().stage_bytes)


def test_recompute_is_charged_once_under_deferred_w_and_twice_under_torchs_split() -> None:
    """The stage times: deferred W recomputes in I only; torch's split in I and W (torch's first stage:
    in W only, where its whole backward runs). Without recompute the two are the same."""
    from pp_offload.plan.costs import recompute_seconds
    from pp_offload.plan.machines import resolve_machine
    from pp_offload.plan.model import model_spec

    extra = recompute_seconds(
        model_spec(TINY), resolve_machine("H100"), "bf16", microbatch_size=1, seq_len=256, recompute="full"
    )
    plain = _setup(True, recompute="none")
    assert [s.times for s in plain.stages] == [s.times for s in _setup(False, recompute="none").stages]
    for index, (p, d, t) in enumerate(
        zip(plain.stages, _setup(True).stages, _setup(False).stages, strict=True)
    ):
        layers_extra = extra * p.layers
        assert d.times.I == pytest.approx(p.times.I + layers_extra) and d.times.W == pytest.approx(p.times.W)
        assert t.times.W == pytest.approx(p.times.W + layers_extra)
        assert t.times.I == pytest.approx(p.times.I + (0 if index == 0 else layers_extra))


def test_torchs_split_replays_stage_0s_backward_whole_and_lowers_the_peak_with_recompute() -> None:
    from pp_offload.plan.evaluate import build_orders, predict

    peaks = {}
    for deferred_w in (True, False):
        setup = _setup(deferred_w)
        orders = build_orders(setup, [4], search="auto", virtual_stages=2)
        kinds = {
            a.computation_type for actions in orders.orders[4].values() for a in actions if a.stage_index == 0
        }
        assert ("B" in kinds) is not deferred_w  # torch runs stage 0's backward whole at W
        summary, _ = predict(setup, orders, "none", 4)
        peaks[deferred_w] = max(summary["activation"])
    assert peaks[False] < peaks[True]


# schedule: auto


SEL = ModeCost(forward=0.001, input=0.002, weight=0.003, backward=0.004)


def _measured(deferred_w: bool) -> Measurement:
    plain = Measurement.uniform(2, F=0.010, I=0.012, W=0.008, saved_bytes=1 << 20, layers=2)
    calibration = RecomputeCalibration(forward=0.005, backward=0.009, modes={"selective": SEL})
    return dataclasses.replace(plain, recompute_costs=calibration, deferred_w=deferred_w)


@pytest.mark.parametrize("once", [False, True])
def test_auto_prices_recompute_by_the_split_the_probe_ran(once: bool) -> None:
    """The measured recompute costs: deferred W adds a full backward's recomputation to I; torch's split
    adds I's and W's own (torch's first stage: the whole backward's to W), and a ``+once`` plan under it
    holds the freed bytes from I to W."""
    option = RecomputeOption("selective", kept_share=0.5, forward_share=50.0, once=once)
    deferred = option.apply(_measured(True)).stages
    first, *rest = option.apply(_measured(False)).stages
    assert all(
        (s.I, s.W) == (pytest.approx(0.012 + 2 * SEL.backward), pytest.approx(0.008)) for s in deferred
    )
    assert all(s.held_after_input == 0 for s in deferred)
    assert (first.I, first.W) == (pytest.approx(0.012), pytest.approx(0.008 + 2 * SEL.backward))
    assert first.held_after_input == 0
    for st in rest:
        assert st.I == pytest.approx(0.012 + 2 * SEL.input)
        assert st.W == pytest.approx(0.008 + (0 if once else 2 * SEL.weight))
        assert st.held_after_input == ((1 << 20) - st.saved_bytes if once else 0)


def test_auto_measurement_carries_the_split_and_round_trips() -> None:
    measured = predicted_measurement(TINY, recompute="full", deferred_w=False, **SETTING)
    assert measured.deferred_w is False and all(st.queued_bytes is None for st in measured.stages)
    assert Measurement.from_dict(measured.to_dict()) == measured
    assert "retained-graph split" in measured.table()
    assert predicted_measurement(TINY, **SETTING).deferred_w is True


@pytest.mark.parametrize("deferred_w", [True, False])
def test_a_probe_knows_the_split_its_stages_ran(deferred_w: bool) -> None:
    """`measure_step`'s summary: stages that deferred their weight gradients report their queues; a probe
    on torch's split reports none, and its measurement says so."""
    from pp_offload.plan.probe import _summarize

    events = [(f"{s}{kind}0", 0.001) for s in range(4) for kind in ("F", "I", "W")]
    parts = [
        {
            "events": events,
            "bytes": [(s, 0, 1 << 20) for s in range(4)],
            "comm": 0.0,
            "queued": {s: 1 << 19 for s in range(4)} if deferred_w else {},
        }
    ]
    kw = {"num_ranks": 2, "num_microbatches": 1, "steps": 1, "copies_overlap": False, "device": "cpu"}
    measured = _summarize(parts, **kw)
    assert measured.deferred_w is deferred_w
    assert [st.queued_bytes for st in measured.stages] == [(1 << 19) if deferred_w else None] * 4


def test_the_recipes_budget_figures_follow_the_key(capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import LlamaConfig

    from pp_offload.recipe.offload_figures import planner_offload_inputs

    model = SimpleNamespace(config=LlamaConfig(**{k: v for k, v in TINY.items() if k != "model_type"}))
    figures = {}
    for deferred_w in (True, False):
        config = _recipe(offload="budget", deferred_w=deferred_w)
        config.train.activation_checkpointing = "full"
        inputs = planner_offload_inputs(
            config,
            model,
            schedule="ScheduleVHalf",
            stages_per_rank=2,
            pp=2,
            dp=1,
            layers_per_stage=[2, 2, 2, 2],
            device=__import__("torch").device("cpu"),
            log=True,
        )
        figures[deferred_w] = inputs
        said = capsys.readouterr().out
        assert ("under torch's retained-graph split" in said) is not deferred_w and "planner's" in said
    assert all(b.queued is None for b in figures[False].stage_bytes)
    assert all(b.queued for b in figures[True].stage_bytes[1:])
    assert figures[False].costs.W > figures[True].costs.W  # W recomputes under torch's split


# pp-offload plan --split


def test_plan_weighs_the_pick_under_both_splits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from pp_offload.plan.cli import main

    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    common = [
        "--model", str(config), "--seq-len", "256", "--microbatches", "4", "--pp", "2", "--quiet",
        "--schedules", "ScheduleVHalf", "--offload", "none", "--recompute", "full", "--jobs", "1",
    ]  # fmt: skip
    out = {}
    for split in ("deferred", "torch"):
        assert main([*common, "--split", split, "--json", str(tmp_path / f"{split}.json")]) == 0
        out[split] = " ".join(capsys.readouterr().out.split())  # the report wraps at 100 columns
    plans = {s: json.loads((tmp_path / f"{s}.json").read_text()) for s in out}
    assert plans["deferred"]["settings"]["deferred_w"] is True
    assert plans["torch"]["settings"]["deferred_w"] is False
    deferred, torch_split = (plans[s]["candidates"][0] for s in ("deferred", "torch"))
    # each run's pick, weighed under the other split, is the other run's pick
    assert plans["deferred"]["other_split"]["activation"] == torch_split["activation"]
    assert plans["torch"]["other_split"]["activation"] == deferred["activation"]
    assert max(torch_split["activation"]) < max(deferred["activation"])
    assert "this pick's activation peak" in out["deferred"] and "the lower peak" in out["deferred"]
    assert "no lower peak" in out["torch"] and "torch's retained-graph split" in out["torch"]
    assert "deferred_w: false" in out["torch"] and "deferred_w" not in out["deferred"].split("apply it")[1]


def test_plan_without_recompute_or_split_backward_weighs_nothing() -> None:
    from pp_offload.plan import plan

    kw = {
        "seq_len": 256,
        "microbatch_size": 1,
        "num_microbatches": 4,
        "pp": 2,
        "offload": ["none"],
        "jobs": 1,
    }
    assert plan(TINY, schedules=["ScheduleVHalf"], recompute=["none"], **kw).other_split is None
    looped = plan(TINY, schedules=["ScheduleInterleaved1F1B"], recompute=["full"], **kw)
    assert looped.recommended.recompute == "full" and looped.other_split is None
    # one backward per microbatch: torch's split changes nothing there, time or memory
    same = plan(TINY, schedules=["ScheduleInterleaved1F1B"], recompute=["full"], deferred_w=False, **kw)
    for a, b in zip(looped.candidates, same.candidates, strict=True):
        assert (a.step_time, a.activation, a.memory) == (pytest.approx(b.step_time), b.activation, b.memory)
    with pytest.raises(TypeError, match="deferred_w must be True"):
        plan(TINY, schedules=["ScheduleVHalf"], deferred_w="torch", **kw)


# one run on 2 ranks


def _split_worker(rank: int, world: int, configs: list[dict], cache: str) -> list[tuple[list[float], list]]:
    """Each config's losses, and per schedule built: (the deferred_w the recipe passed, whether the rank's
    stages then deferred their weight gradients)."""
    import pp_offload.recipe.pipeline as pipeline
    from pp_offload.recipe.train import run
    from pp_offload.runtime.deferred_w import all_deferring

    real, built = pipeline.build_schedule, []

    def spy(info, stages, num_microbatches, **kwargs):
        schedule = real(info, stages, num_microbatches, **kwargs)
        built.append((kwargs["deferred_w"], all_deferring(stages)))
        return schedule

    pipeline.build_schedule = spy
    out = []
    try:
        for config in configs:
            built.clear()
            out.append(
                (run(RecipeConfig.from_dict(config), cache_dir=cache, progress=False).losses, list(built))
            )
    finally:
        pipeline.build_schedule = real
    return out


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_torchs_split_trains_the_default_runs_losses_on_v_half(tmp_path: Path) -> None:
    """V-Half on 2 gloo ranks, tiny Llama, fp32, full recompute: ``deferred_w: false`` builds torch's
    retained-graph split and trains the same losses as the default deferred W (the split changes where the
    weight gradients are computed, not what they are)."""
    from _dist import run_on_ranks
    from _tiny_hf import RECIPE_LLAMA

    def config(name: str, deferred_w: bool) -> dict:
        return {
            "model": {"config": RECIPE_LLAMA},
            "data": {"path": "embedded", "seq_len": 32, "max_examples": 200},
            "pipeline": {"schedule": "ScheduleVHalf", "microbatches": 4, "deferred_w": deferred_w},
            "train": {
                "steps": 3,
                "global_batch_size": 8,
                "warmup_steps": 1,
                "activation_checkpointing": "full",
            },
            "output": {"dir": str(tmp_path / name), "report_to": ["csv"], "log_every": 0, "export": False},
        }

    cache = str(tmp_path / "cache")
    results = run_on_ranks(
        _split_worker, 2, [config("deferred", True), config("torch", False)], cache, timeout=240
    )
    for (deferred, deferred_built), (torch_split, torch_built) in results:
        assert deferred_built == [(True, True)] and torch_built == [(False, False)]
        assert len(deferred) == 3 and deferred == torch_split


def test_when_nothing_fits_under_deferred_w_torchs_split_is_suggested_where_it_fits() -> None:
    from pp_offload.plan import plan
    from pp_offload.plan.planner import PlanError
    from pp_offload.plan.result import GIB

    kw = {"seq_len": 256, "microbatch_size": 1, "num_microbatches": 4, "pp": 2, "jobs": 1, "reserve_gib": 0.0}
    kw |= {"schedules": ["ScheduleVMin", "ScheduleVHalf"], "offload": ["none"], "recompute": ["full"]}
    peak = {dw: min(c.peak_bytes for c in plan(TINY, deferred_w=dw, **kw).candidates) for dw in (True, False)}
    assert peak[False] < peak[True]
    between = (peak[False] + peak[True]) / 2 / GIB
    with pytest.raises(
        PlanError, match=r"What would fit: torch's retained-graph split, i\.e\. --split torch"
    ):
        plan(TINY, gpu_memory_gib=between, **kw)
    plan(TINY, gpu_memory_gib=between, deferred_w=False, **kw)  # fits


# torch's split of a weight used twice in one stage (pytorch #180952)


def test_a_stage_that_uses_a_weight_twice_is_refused_where_torchs_split_double_counts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from torch import nn

    from pp_offload.recipe import pipeline
    from pp_offload.runtime.catalog import schedule_info

    shared = nn.Linear(2, 2)
    stages = {0: nn.Sequential(shared, nn.Tanh(), shared), 3: nn.Linear(2, 2)}
    v_half = schedule_info("ScheduleVHalf")
    monkeypatch.setattr(pipeline, "torch_split_counts_a_reused_weight_once", lambda: False)
    with pytest.raises(ConfigError) as caught:
        pipeline.refuse_reused_weights(v_half, stages, deferred_w=False)
    message = str(caught.value)
    assert "stage 0 uses one weight twice (0.weight and 2.weight)" in message
    assert "pytorch #180952" in message and "pipeline.deferred_w=true" in message and "torch 2.14" in message
    pipeline.refuse_reused_weights(v_half, stages, deferred_w=True)  # deferred W: the key's default
    pipeline.refuse_reused_weights(schedule_info("ScheduleInterleaved1F1B"), stages, deferred_w=False)
    pipeline.refuse_reused_weights(v_half, {3: stages[3]}, deferred_w=False)  # nothing shared
    monkeypatch.setattr(pipeline, "torch_split_counts_a_reused_weight_once", lambda: True)
    pipeline.refuse_reused_weights(v_half, stages, deferred_w=False)  # a torch with the fix


def test_the_question_to_torch_sees_a_double_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe answers from torch's behaviour: a split that adds the weight's gradient twice (as torch
    before the fix did) makes it say no."""
    from pp_offload.recipe import pipeline
    from pp_offload.runtime import compat

    probe = pipeline.torch_split_counts_a_reused_weight_once.__wrapped__  # uncached
    assert isinstance(probe(), bool)
    real = compat.stage_backward_weight

    def doubled(weights, groups, *args, **kwargs):  # noqa: ANN001, ANN202
        weights = list(weights)
        out = real(iter(weights), groups, *args, **kwargs)
        for weight in weights:
            weight.grad = weight.grad * 2
        return out

    monkeypatch.setattr(compat, "stage_backward_weight", doubled)
    assert probe() is False
