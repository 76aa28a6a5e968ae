"""The probe's recompute calibration (`pp_offload.plan.recompute_calibration`) and how
`RecomputeOption.apply` charges it: measured seconds in, the documented F/I/W/B out."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from pp_offload.plan.auto import RecomputeOption
from pp_offload.plan.probe import Measurement
from pp_offload.plan.recompute_calibration import (
    CALIBRATED_MODES,
    ModeCost,
    RecomputeCalibration,
    calibrate_recompute,
    layer_inputs,
)

F, I, W = 0.010, 0.012, 0.008  # seconds per stage pass
LAYERS = 2
SEL = ModeCost(forward=0.001, input=0.002, weight=0.003, backward=0.004)


def _measured(calibration: RecomputeCalibration | None) -> Measurement:
    plain = Measurement.uniform(2, F=F, I=I, W=W, saved_bytes=1 << 20, layers=LAYERS)
    return dataclasses.replace(plain, recompute_costs=calibration)


def test_apply_charges_the_measured_costs_per_recomputed_layer() -> None:
    """Every layer selective, measured: F + forward per layer; with deferred W (`recomputations`) I is the
    microbatch's one backward: + a full backward's recomputation per layer on every stage, W unchanged,
    nothing shared. The traffic model's forward_share (here absurd) is not used."""
    calibration = RecomputeCalibration(forward=0.005, backward=0.009, modes={"selective": SEL})
    option = RecomputeOption("selective", kept_share=0.5, forward_share=50.0)
    out = option.apply(_measured(calibration))
    first, *rest = out.stages
    assert first.F == pytest.approx(F + LAYERS * SEL.forward)
    assert (first.I, first.W) == (pytest.approx(I + LAYERS * SEL.backward), pytest.approx(W))
    assert first.recompute_shared == pytest.approx(0.0)
    for st in rest:
        assert st.F == pytest.approx(F + LAYERS * SEL.forward)
        assert st.I == pytest.approx(I + LAYERS * SEL.backward)
        assert st.W == pytest.approx(W)
        # B = I + W - shared: one full backward's recomputation
        assert st.I + st.W - st.recompute_shared == pytest.approx(I + W + LAYERS * SEL.backward)
        assert st.saved_bytes == (1 << 20) // 2


def test_apply_mixes_a_measured_mode_with_an_unmeasured_one() -> None:
    """``selective:0.5,mlp`` with only selective measured: the selective layer is charged its measured
    seconds, the mlp layer its share of a layer's forward (stage F over its layers), nothing in F."""
    calibration = RecomputeCalibration(forward=0.005, backward=0.009, modes={"selective": SEL})
    option = RecomputeOption(
        "selective", kept_share=0.5, forward_share=50.0, share=0.5, rest="mlp", rest_forward_share=0.25
    )
    st = option.apply(_measured(calibration)).stages[1]
    share = 0.25 * F / LAYERS
    assert st.F == pytest.approx(F + SEL.forward)
    assert st.I == pytest.approx(I + SEL.backward + share)
    assert st.W == pytest.approx(W)
    assert st.recompute_shared == pytest.approx(0.0)


def test_apply_without_calibration_keeps_the_share_model() -> None:
    option = RecomputeOption("full", kept_share=0.1, forward_share=1.0)
    st = option.apply(_measured(None)).stages[1]
    per_layer = F / LAYERS
    assert st.F == pytest.approx(F)
    assert (st.I, st.W) == (pytest.approx(I + LAYERS * per_layer), pytest.approx(W))
    assert st.recompute_shared == pytest.approx(0.0)


def test_calibration_round_trips_and_combines_ranks() -> None:
    a = RecomputeCalibration(0.004, 0.008, {"full": ModeCost(0.0, 0.004, 0.004, 0.004), "mlp": SEL})
    b = RecomputeCalibration(0.006, 0.010, {"full": ModeCost(0.002, 0.006, 0.002, 0.008)})
    both = RecomputeCalibration.combine([a, b])
    assert set(both.modes) == {"full"}  # measured on every rank only
    assert both.forward == pytest.approx(0.005) and both.backward == pytest.approx(0.009)
    assert dataclasses.astuple(both.modes["full"]) == pytest.approx((0.001, 0.005, 0.003, 0.006))
    assert RecomputeCalibration.combine([]) is None
    measured = _measured(a)
    assert Measurement.from_dict(measured.to_dict()) == measured
    assert "recompute measured on" in measured.table()
    assert a.cost("none") == ModeCost(0.0, 0.0, 0.0, 0.0) and a.cost("selective") is None
    with pytest.raises(ValueError, match="ModeCost.input"):
        ModeCost(0.0, -1.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="RecomputeCalibration.forward"):
        RecomputeCalibration(math.inf, 0.0)


def _tiny_layer() -> tuple[torch.nn.Module, dict]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=64,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config).train()
    layer = model.model.layers[0]
    held, undo = layer_inputs(layer)
    model(input_ids=torch.randint(0, 64, (1, 16)))  # a DynamicCache too: kept as None
    undo()
    return layer, held


def test_a_real_layer_calibrates_and_is_given_back_as_it_was() -> None:
    layer, held = _tiny_layer()
    assert held["autocast"] is None
    cal = calibrate_recompute(layer, held["args"], held["kwargs"], rounds=2)
    assert cal.forward > 0 and cal.backward > 0 and cal.rounds >= 2
    assert set(cal.modes) == set(CALIBRATED_MODES) and cal.shape == (1, 16, 32) and cal.device == "cpu"
    for cost in cal.modes.values():
        assert all(0 <= getattr(cost, f.name) < 1 for f in dataclasses.fields(ModeCost))
    assert "forward" not in vars(layer) and "forward" not in vars(layer.mlp)  # unwrapped
    assert all(p.grad is None for p in layer.parameters())  # gradients untouched
    from pp_offload.parallel import activation_checkpointing

    activation_checkpointing([layer], layers=lambda m: [m], mode="full")
    with pytest.raises(ValueError, match="without checkpointing"):
        calibrate_recompute(layer, held["args"], held["kwargs"])
    with pytest.raises(ValueError, match="modes must be among"):
        calibrate_recompute(layer, held["args"], held["kwargs"], modes=["everything"])


def test_apply_charges_a_once_plan_one_measured_recomputation_in_i() -> None:
    """``selective+once`` under deferred W: the same as ``selective`` (I recomputes, a full backward's
    recomputation per layer; W does not), and nothing is held from I to W: +once is no longer needed."""
    calibration = RecomputeCalibration(forward=0.005, backward=0.009, modes={"selective": SEL})
    option = RecomputeOption("selective", kept_share=0.5, forward_share=50.0, once=True)
    first, *rest = option.apply(_measured(calibration)).stages
    assert (first.I, first.W) == (pytest.approx(I + LAYERS * SEL.backward), pytest.approx(W))
    assert first.held_after_input == 0
    for st in rest:
        assert st.F == pytest.approx(F + LAYERS * SEL.forward)
        assert (st.I, st.W) == (pytest.approx(I + LAYERS * SEL.backward), pytest.approx(W))
        assert st.held_after_input == 0
