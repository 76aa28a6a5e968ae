"""``schedule: auto`` with sub-layer offload units (``budget:sublayer``): the probe measures what each
budget-offload unit moves exactly as the runtime's captures do, `choose` judges ``budget:sublayer`` where
the units are known and picks it where it wins, an old measurement without units still works (no
sub-layer candidates, the reason in the table), and the recipe runs a ``budget:sublayer`` pick exactly."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from _dist import run_on_ranks
from test_auto import _planner_measurement as planner_measurement
from test_offload_sublayer import tiny_stage, unit_capture
from test_recipe import _auto_worker, _config, _matches_one_process, _run

from pp_offload.plan.auto import AutoDecision, Measurement, choose, recompute_options
from pp_offload.plan.shapes import SHAPES

# --- the probe's unit marks against the runtime's unit captures -----------------------------------------


def _probe_marks(family: str, plan: str) -> dict:
    """`tiny_stage`'s forward captured whole as the probe captures a chunk, with the probe's unit marks:
    per layer, (its bytes as one unit, its sub-layer units' bytes)."""
    from pp_offload.plan.probe import _mark_units
    from pp_offload.runtime.store import ActivationStore

    stage, x = tiny_stage(family, plan)
    store, found = ActivationStore("cpu"), {}
    undo = _mark_units(stage, store, found)
    with store.capture((0, 0), keep=[x]):
        stage.submod(inputs_embeds=x, use_cache=False)
    undo()
    marks = found.pop(0)
    with store.capture((0, 1), keep=[x]):
        stage.submod(inputs_embeds=x, use_cache=False)
    assert found == {}  # undone: the probe's hooks are gone
    return marks


@pytest.mark.parametrize(
    ("family", "plan"),
    [("llama", "none"), ("llama", "mlp"), ("llama", "selective:0.5,mlp"), ("gpt2", "none")],
)
def test_probe_measures_each_unit_as_the_runtime_captures_it(family: str, plan: str) -> None:
    """Per layer, the probe's marks inside one whole-chunk capture give the bytes the runtime's own
    captures of that layer (``budget``) and of each of its sub-layer units (``budget:sublayer``) record,
    byte for byte (views counted once per unit, the rotary cos/sin in each layer's attention half)."""
    marks = _probe_marks(family, plan)
    assert sorted(marks) == [0, 1, 2, 3]
    units, unit_count = unit_capture(family, plan)
    layers, layer_count = unit_capture(family, plan, "layer")
    assert layer_count == 4 and unit_count == sum(len(marks[i][1]) for i in range(4))
    assert [marks[i][0] for i in range(4)] == [layers[i] for i in range(4)]
    assert [b for i in range(4) for b in marks[i][1]] == [units[u] for u in range(unit_count)]
    assert all(b > 0 for i in range(4) for b in marks[i][1])


# --- choose: where the units win, and without them -------------------------------------------------------


def _planner_measurement(d: int, m: int, seq: int, *, units: bool = True) -> Measurement:
    """`test_auto._planner_measurement` with the units by default."""
    return planner_measurement(d, m, seq, units=units)


PICKS = {
    "num_microbatches": 8,
    "memory_limit": 0.9,
    "schedules": ["ScheduleVZB", "ScheduleVHalf"],
    "offload": ["none", "budget", "budget:sublayer"],
}


def test_auto_picks_sublayer_units_where_they_win() -> None:
    """Llama-3-8B, seq 4096, pp 4, m 8 on the H100 as the planner predicts it, 90% of 1F1B's activation
    memory, V-ZB or V-Half, MLP-only recompute offered: V-ZB with MLP recompute does not fit without
    offload; whole-layer budget offload fits at +1.7%, sub-layer units fit at +0.1% (their first copy is a
    quarter of a layer, started before the layer's MLP runs) with less memory, and beat V-Half without
    offload by 2%: auto picks them. Its offload inputs count units, as the runtime checks."""
    from pp_offload.order.offload_inputs import OffloadInputs

    measured = _planner_measurement(4, 8, 4096)
    assert measured.units_known is None
    mlp = [o for o in recompute_options(SHAPES["llama-3-8b"], seq_len=4096) if o.label == "mlp"]
    decision = choose(measured, **PICKS, recompute=mlp)
    picked = (decision.schedule, decision.offload, decision.recompute)
    assert picked == ("ScheduleVZB", "budget:sublayer", "mlp")
    rows = {(c.schedule, c.offload, c.recompute): c for c in decision.candidates}
    layer = rows[("ScheduleVZB", "budget", "mlp")]
    # deferred W moved each recomputation from W into I: the margin fell from over 1% to about 0.6%
    assert layer.fits and decision.predicted_step_s < layer.predicted_step_s * (1 - 0.005)
    assert decision.candidates[0].max_peak < layer.max_peak
    assert not rows[("ScheduleVZB", "none", "mlp")].fits
    others = [c for c in decision.candidates[1:] if c.fits]
    assert min(c.predicted_step_s for c in others) > decision.predicted_step_s * (1 + 0.005)
    inputs = OffloadInputs.from_dict(json.loads(json.dumps(decision.offload_inputs)))
    assert inputs.granularity == "sublayer"
    assert inputs.layers == tuple(2 * st.layers for st in measured.stages)  # mlp recompute: both halves stay
    per_layer = tuple(x / measured.stages[1].layers for x in measured.unit_shares)
    assert inputs.unit_compute[1][:2] == pytest.approx(per_layer)
    restored = AutoDecision.from_dict(json.loads(json.dumps(decision.to_dict())))
    assert restored.offload == "budget:sublayer" and restored.notes == []


def test_a_measurement_without_units_still_works_without_sublayer_candidates() -> None:
    """An old probe's JSON (no per-layer or per-unit bytes, no unit shares) loads, and `choose` judges
    every other policy on it: the sub-layer policy gets no row, and the table says why."""
    old = _planner_measurement(4, 8, 4096).to_dict()
    old.pop("unit_shares")
    for stage in old["stages"]:
        stage.pop("units")
        stage.pop("layer_bytes")
    measured = Measurement.from_dict(json.loads(json.dumps(old)))
    assert "no sub-layer unit bytes" in measured.units_known
    assert "sub-layer units unknown" in measured.table()
    decision = choose(measured, **{**PICKS, "memory_limit": None})
    assert {c.offload for c in decision.candidates} == {"none", "budget"}
    assert "not judged: offload budget:sublayer" in decision.table()
    with pytest.raises(ValueError, match="cannot be judged"):
        choose(measured, **{**PICKS, "offload": ["budget:sublayer"]})
    new = _planner_measurement(4, 8, 4096)
    assert Measurement.from_dict(json.loads(json.dumps(new.to_dict()))) == new
    no_shares = dataclasses.replace(new, unit_shares=None)
    assert "unit compute shares" in no_shares.units_known


def test_recompute_options_turn_checkpointed_layers_into_one_unit() -> None:
    """Selective recompute on half of each stage's layers: those become one unit of what they keep; the
    MLP-only recompute on the others shrinks their second unit only."""
    measured = _planner_measurement(2, 4, 4096)
    option = next(
        o for o in recompute_options(SHAPES["llama-3-8b"], seq_len=4096) if o.label == "selective:0.5,mlp"
    )
    base, st = measured.stages[1], option.apply(measured).stages[1]
    half = -(-st.layers // 2)  # the first ceil(half) layers are selective
    assert [len(u) for u in st.units] == [1] * half + [2] * (st.layers - half)
    assert [u[0] for u in st.units[half:]] == [u[0] for u in base.units[half:]]
    assert all(u[1] < b[1] for u, b in zip(st.units[half:], base.units[half:], strict=True))
    assert [sum(u) for u in st.units] == list(st.layer_bytes)


# --- the recipe: a budget:sublayer pick, end to end on 2 gloo ranks --------------------------------------


def test_recipe_auto_runs_a_sublayer_pick_exactly(tmp_path: Path) -> None:
    """``schedule: auto`` with ``pipeline.offload`` as auto's candidate list, here budget:sublayer only
    (so the tiny model exercises the path whatever would win): the probe measures the units on both
    ranks, auto picks a schedule with budget:sublayer, the runtime places the predicted plan from its
    offload inputs (unit counts checked against the stages), and the losses equal one process."""
    cache = str(tmp_path / "cache")
    auto = {"pipeline__schedule": "auto", "pipeline__offload": ["budget:sublayer"], "output__export": False}
    config = _config(tmp_path / "auto", steps=3, **auto)
    results = run_on_ranks(_auto_worker, 2, [config], cache, timeout=300)
    assert results[0] == results[1]  # the same decision and losses on both ranks
    ((losses, decision),) = results[0]
    assert decision["offload"] == "budget:sublayer"
    assert decision["offload_inputs"]["granularity"] == "sublayer"
    recorded = json.loads((tmp_path / "auto" / "auto.json").read_text())
    measured = Measurement.from_dict(recorded["measurement"])
    assert measured.units_known is None
    assert all(len(u) == 2 for st in measured.stages for u in st.units)  # Llama layers split in two
    reference = _run(_config(tmp_path / "reference", output__export=False, steps=3), cache)
    _matches_one_process(losses, reference)


def test_recipe_auto_takes_an_offload_candidate_list_and_checks_it(tmp_path: Path) -> None:
    """Under ``schedule: auto``, ``pipeline.offload`` may list the policies auto chooses from (checked
    before any process starts); a single policy is still refused (auto chooses it)."""
    from test_recipe import _preflight

    from pp_offload.recipe import ConfigError

    auto = {"pipeline__schedule": "auto"}
    _preflight(_config(tmp_path, pipeline__offload=["none", "budget:sublayer"], **auto))
    with pytest.raises(ConfigError, match="auto's candidates.*'budget:bogus'"):
        _preflight(_config(tmp_path, pipeline__offload=["none", "budget:bogus"], **auto))
    with pytest.raises(ConfigError, match=r"\(auto's candidates\): offload 'auto' depends on costs"):
        _preflight(_config(tmp_path, pipeline__offload=["auto"], **auto))
    with pytest.raises(ConfigError, match=r"cannot be set with pipeline.schedule=auto .*\(a list of offload"):
        _preflight(_config(tmp_path, pipeline__offload="full", **auto))
