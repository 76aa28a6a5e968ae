"""Deferred weight gradients (`pp_offload.runtime.deferred_w`) in one process: the queued GEMMs give
autograd's bits, frozen weights queue nothing, and a compiled module on torch's retained-graph split is
refused.

The multi-process equality (every schedule, offload, recompute, FSDP) is in the gloo tests, where deferred W
is the default; here the op itself, in milliseconds. Compiled layers: tests/test_compile.py and
tests/test_compile_gloo.py.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from pp_offload.runtime import deferred_w
from pp_offload.runtime.deferred_w import (
    apply_queued_weight_grads,
    collecting,
    defer_weight_grads,
    deferred_modules,
    refuse_compiled_split,
)


class _Tiny(nn.Module):
    """Embedding, a biased Linear, GPT-2's Conv1D, a frozen Linear and an LM head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        from transformers.pytorch_utils import Conv1D

        torch.manual_seed(0)
        self.embed = nn.Embedding(11, 8)
        self.proj = nn.Linear(8, 12)
        self.conv = Conv1D(8, 12)  # weight (12, 8): stored transposed
        self.frozen = nn.Linear(8, 8, bias=False).requires_grad_(False)
        self.head = nn.Linear(8, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = self.conv(torch.tanh(self.proj(h)))
        return self.head(self.frozen(h))


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _run(model: nn.Module, ids: torch.Tensor, microbatches: int = 2) -> None:
    for chunk in ids.tensor_split(microbatches):
        model(chunk).square().mean().backward()


def _deferred(model: nn.Module) -> nn.Module:
    stage = SimpleNamespace(submod=model, backward_maybe_with_nosync=lambda: None)
    assert defer_weight_grads([stage]) == [stage]
    return model


def _reference_and_copy() -> tuple[torch.Tensor, nn.Module, nn.Module]:
    """A batch, `_Tiny` after plain autograd on it, and a deferring copy of it with no gradients."""
    ids = torch.randint(0, 11, (4, 5))
    ref = _Tiny()
    _run(ref, ids)
    model = _deferred(copy.deepcopy(ref))
    model.zero_grad(set_to_none=True)
    return ids, ref, model


def test_queued_gemms_give_autograds_bits() -> None:
    ids, ref, model = _reference_and_copy()
    assert {n for n, _ in deferred_modules(model)} == {"proj", "conv", "head"}  # the frozen one keeps its own
    for chunk in ids.tensor_split(2):
        with collecting():
            model(chunk).square().mean().backward()
        # proj, conv, head: one entry each; the frozen layer queues nothing
        assert len(deferred_w._QUEUE) == 3
        assert deferred_w.queued_bytes() > 0
        assert apply_queued_weight_grads(model.parameters()) == 3
    assert deferred_w._QUEUE == []
    want, got = _grads(ref), _grads(model)
    assert set(got) == set(want) and "frozen.weight" not in got
    for name in want:
        assert got[name].grad_fn is None, name
        if name == "embed.weight":  # tied: its two contributions are summed in another order
            torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-9)
        else:
            assert torch.equal(got[name], want[name]), name


def test_outside_a_stage_the_gradient_is_accumulated_at_once() -> None:
    ids, ref, model = _reference_and_copy()
    _run(model, ids)  # no collecting block: plain autograd's result, nothing queued
    assert deferred_w._QUEUE == []
    want, got = _grads(ref), _grads(model)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=0, msg=name)


def test_lora_a_and_b_defer_and_the_frozen_base_does_not() -> None:
    peft = pytest.importorskip("peft")

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    config = peft.LoraConfig(r=2, target_modules=["0", "2"], lora_dropout=0.0, init_lora_weights=False)
    ref = peft.get_peft_model(base, config)
    x = torch.randn(3, 8)
    ref(x).square().sum().backward()
    model = _deferred(copy.deepcopy(ref))
    model.zero_grad(set_to_none=True)
    names = {n.rsplit(".", 2)[-2] + "." + n.rsplit(".", 1)[-1] for n, _ in deferred_modules(model)}
    assert names == {"lora_A.default", "lora_B.default"}, names
    with collecting():
        model(x).square().sum().backward()
    # layer 0's lora_A sees the model input (no gradient wanted): its weight gradient is computed in I
    assert len(deferred_w._QUEUE) == 3
    apply_queued_weight_grads(model.parameters())
    for name, grad in _grads(ref).items():
        assert torch.equal(_grads(model)[name], grad), name


def test_a_weight_not_among_the_parameters_is_an_error() -> None:
    model = _deferred(nn.Sequential(nn.Linear(4, 4)))
    with collecting():
        model(torch.randn(2, 4, requires_grad=True)).sum().backward()
    with pytest.raises(RuntimeError, match=r"queued for a weight of shape \(4, 4\) that is not among"):
        apply_queued_weight_grads(nn.Linear(4, 4).parameters())
    assert deferred_w._QUEUE == []


def test_compiled_module_on_torchs_split_is_refused() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4)))
    model[1].compile()  # in place: nothing is compiled until it runs
    stage = SimpleNamespace(submod=model, stage_index=3, backward_maybe_with_nosync=lambda: None)
    refused = r"ScheduleVHalf: stage 3 holds compiled module '1' .* deferred_w=True"
    with pytest.raises(ValueError, match=refused):
        refuse_compiled_split([stage], "ScheduleVHalf")
    defer_weight_grads([stage])
    refuse_compiled_split([stage], "ScheduleVHalf")  # deferred W: the compiled backward runs once
    defer_weight_grads([stage], enabled=False)
    assert deferred_modules(model) == []
    with pytest.raises(ValueError, match="compiled module"):
        refuse_compiled_split([stage], "ScheduleVHalf")
    wrapped = SimpleNamespace(submod=nn.Sequential(torch.compile(nn.Linear(4, 4))), stage_index=0)
    with pytest.raises(ValueError, match=r"compiled module '0'"):
        refuse_compiled_split([wrapped], "ScheduleZBVZeroBubble")


def test_a_weight_freed_between_i_and_w_is_an_error_not_a_wrong_match() -> None:
    # FSDP2 frees a unit's unsharded weights when it reshards after its forward; a freed storage's data
    # pointer (0) would match any other freed or wrapper parameter of that shape, so W refuses it.
    model = nn.Sequential(nn.Linear(4, 4))
    defer_weight_grads([SimpleNamespace(submod=model, backward_maybe_with_nosync=lambda: None)])
    with collecting():
        model(torch.randn(2, 4, requires_grad=True)).sum().backward()
    weight = model[0].weight
    weight.data.untyped_storage().resize_(0)
    with pytest.raises(RuntimeError, match=r"storage freed between the I .* reshard_after_forward=False"):
        apply_queued_weight_grads(model.parameters())
    assert deferred_w._QUEUE == []
