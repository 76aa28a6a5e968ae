"""The planner charges the recomputations the runtime makes (offline, milliseconds).

`pp_offload.recompute_plan.recomputations` is the one rule: the runtime's counts are checked against it on
gloo ranks (`tests/test_hot_path_gloo.py`, `tests/test_fsdp_gloo.py::test_hot_path_under_fsdp`); here the
planner's formulas (`pp_offload.plan.costs.stage_times`), the measured path of ``schedule: auto``
(`RecomputeOption.apply`) and the simulator's full backward (``Costs.stages`` shared time) are checked
against the same rule.
"""

from __future__ import annotations

import pytest

from pp_offload.order.actions import Costs
from pp_offload.recompute_plan import recomputations


def test_the_rule() -> None:
    for first in (False, True):
        for once in (False, True):  # deferred W (the default): F and I (or B) only, on every stage
            counts = [recomputations(k, first_stage=first, once=once) for k in ("F", "I", "W", "B")]
            assert counts == [0, 1, 0, 1]
    torch_split = {"deferred_w": False}
    assert [recomputations(k, **torch_split) for k in ("F", "I", "W", "B")] == [0, 1, 1, 1]
    assert [recomputations(k, first_stage=True, **torch_split) for k in ("F", "I", "W", "B")] == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="pass kind must be one of F, I, W, B, got 'X'"):
        recomputations("X")


@pytest.mark.parametrize("first", [False, True])
@pytest.mark.parametrize("mode", ["full", "selective", "mlp"])
def test_stage_times_charge_the_runtime_rule(first: bool, mode: str) -> None:
    from pp_offload.plan.costs import recompute_seconds, stage_times
    from pp_offload.plan.machines import resolve_machine
    from pp_offload.plan.model import model_spec

    spec, machine = model_spec("llama-3-8b"), resolve_machine("H100")
    kw = {"layers": 4, "first": first, "last": False, "microbatch_size": 1, "seq_len": 4096}
    plain = stage_times(spec, machine, "bf16", **kw)
    with_recompute = stage_times(spec, machine, "bf16", recompute=mode, **kw)
    one = 4 * recompute_seconds(spec, machine, "bf16", microbatch_size=1, seq_len=4096, recompute=mode)
    assert with_recompute.F == pytest.approx(plain.F)
    for kind in ("I", "W", "B"):
        extra = getattr(with_recompute, kind) - getattr(plain, kind)
        assert extra == pytest.approx(one * recomputations(kind, first_stage=first)), kind


def test_auto_rescales_a_measurement_by_the_same_rule() -> None:
    from pp_offload.plan.auto import RecomputeOption
    from pp_offload.plan.probe import Measurement

    measured = Measurement.uniform(2, F=0.01, I=0.012, W=0.008, saved_bytes=4000, layers=2)
    full = RecomputeOption("full", kept_share=0.1, forward_share=1.0).apply(measured)
    per_layer_forward = 0.01 / 2
    for index, (before, after) in enumerate(zip(measured.stages, full.stages, strict=True)):
        extra = 2 * per_layer_forward
        first = index == 0
        assert after.I - before.I == pytest.approx(extra * recomputations("I", first_stage=first))
        assert after.W - before.W == pytest.approx(extra * recomputations("W", first_stage=first))
        b_extra = after.I + after.W - after.recompute_shared - before.I - before.W
        assert b_extra == pytest.approx(extra * recomputations("B", first_stage=first))


def test_a_full_backward_runs_shared_time_once() -> None:
    costs = Costs(stages=[(1.0, 2.0, 1.5), (1.0, 2.0, 1.5, 0.5)])
    assert costs.of_stage(0, "B") == pytest.approx(3.5)
    assert costs.of_stage(1, "B") == pytest.approx(3.0)
    assert costs.of_stage(1, "I") == pytest.approx(2.0)
    with pytest.raises(ValueError, match=r"\(stage 0\): shared must be >= 0 and below both I and W"):
        Costs(stages=[(1.0, 2.0, 1.5, 1.5)])
    with pytest.raises(ValueError, match=r"must be \[F, I, W\] or \[F, I, W, shared\]"):
        Costs(stages=[(1.0, 2.0)])
