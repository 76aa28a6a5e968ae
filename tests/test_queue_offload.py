"""Deferred W's queue between I and W: moved to host memory by the activation store where an offload plan
has copies between a chunk's I and its W, and counted and timed so by the simulator, the planner and the
byte model (`pp_offload.runtime.deferred_w.WeightPass`, `pp_offload.order.Costs.queue`).

Offline and one-process, in milliseconds. The multi-process equality with queue copies (V-ZB, 3 ranks, full
offload) is in tests/test_offload_gloo.py; measured peaks in bench/bench_queue_peak.py.
"""

from __future__ import annotations

import copy
import gc
import weakref
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from pp_offload.order.actions import Action, Costs
from pp_offload.order.offload import plan_offload
from pp_offload.order.offload_inputs import OffloadInputs, StageBytes, activation_level, activation_peaks
from pp_offload.plan.orders import build_order
from pp_offload.runtime.deferred_w import WeightPass, collecting, defer_weight_grads
from pp_offload.runtime.offload import queue_key
from pp_offload.runtime.store import ActivationStore
from pp_offload.sim import simulate

_OFFLOAD, _RELOAD = "OFFLOAD", "RELOAD"


def _one_rank(queue_copies: bool = True) -> dict[int, list[Action]]:
    """Two microbatches on one stage: chunk 0 offloaded after its F, back for its I, and (``queue_copies``)
    out again after its I and back for its W."""
    seq = ["F0", "OFFLOAD0", "F1", "RELOAD0", "I0"]
    seq += ["OFFLOAD0", "I1", "RELOAD0"] if queue_copies else ["I1"]
    seq += ["W0", "W1"]
    return {0: [Action(0, a[:-1], int(a[-1])) for a in seq]}


def test_costs_queue_is_validated_and_read_per_stage() -> None:
    assert Costs.coerce({"queue": [0.5, 2]}).queue_of(1) == 2.0
    assert Costs(queue=0.75).queue_of(7) == 0.75
    assert Costs().queue_of(0) is None
    for bad in ("x", -1.0, float("inf"), [], True):
        with pytest.raises(ValueError, match="costs\\['queue'\\]"):
            Costs(queue=bad)
    with pytest.raises(ValueError, match="one per stage"):
        Costs(queue=(1.0,)).queue_of(3)


def test_the_simulator_holds_the_queue_from_i_to_w_and_times_its_copies() -> None:
    torch_split = simulate(_one_rank(), Costs(transfer=0.25))
    deferred = simulate(_one_rank(), Costs(transfer=0.25, queue=0.5))
    # torch's split: the OFFLOAD after I drops the device copy at once, the RELOAD copies the whole chunk
    copies = [(str(a), round(end - start, 9)) for a, start, end in torch_split.transfers[0]]
    assert copies == [("0OFFLOAD0", 0.5), ("0RELOAD0", 0.5), ("0OFFLOAD0", 0.0), ("0RELOAD0", 0.5)]
    # deferred W: the pair between I and W copies the queue, half a chunk: half a chunk's copy time each way
    copies = [(str(a), round(end - start, 9)) for a, start, end in deferred.transfers[0]]
    assert copies == [("0OFFLOAD0", 0.5), ("0RELOAD0", 0.5), ("0OFFLOAD0", 0.25), ("0RELOAD0", 0.25)]
    # memory (one stage on one rank: a chunk weighs 2 units): after I0 the chunk holds its queue (1 unit)
    # beside chunk 1 (2 units); the queue's copy out frees it, its copy back takes it again for W0
    levels = [level for _, level in deferred.memory_curve[0]]
    assert levels == [0.0, 2.0, 4.0, 2.0, 4.0, 3.0, 2.0, 1.0, 2.0, 1.0, 0.0]
    w0 = next(t for (stage, kind, mb), t, _ in deferred.timeline[0] if (kind, mb) == ("W", 0))
    reload_end = deferred.transfers[0][-1][2]
    assert w0 == pytest.approx(reload_end)  # W waits for its queue


def test_without_copies_the_queue_stays_from_i_to_w() -> None:
    plain = simulate(_one_rank(False), Costs(transfer=0.25, queue=3.0))
    # each I frees its chunk (2 units) but its queue: 3 chunks' worth (full recompute's queues are larger
    # than what the chunk saved); both wait for their W
    assert plain.peak == pytest.approx(6.0 + 6.0)
    assert simulate(_one_rank(False), Costs(transfer=0.25)).peak == pytest.approx(4.0)


def test_the_planner_moves_queues_where_the_gap_affords_their_copy() -> None:
    order = build_order("ScheduleVZB", 4, 16, Costs())

    def queue_copies(plan) -> list[float]:
        seen, out = set(), []
        for rank, copies in plan.sim.transfers.items():
            for action, start, end in copies:
                key = (rank, action.stage_index, action.microbatch_index, str(action.computation_type))
                if key in seen:  # the second copy each way of a chunk: its I-to-W pair
                    out.append(end - start)
                seen.add(key)
        return out

    base = Costs(transfer=0.25, queue=1.0)
    plan = plan_offload(order, base, "full")
    small = queue_copies(plan)
    assert small and plan.sim.peak < simulate(order, base).peak
    scale = 2 * 4 / 8  # chunks per stage
    assert all(d == pytest.approx(1.0 * 0.25 * scale) for d in small)
    # a queue three times larger with a slower link takes three times longer to copy: fewer gaps afford it
    slow = Costs(transfer=1.0, queue=3.0)
    large = queue_copies(plan_offload(order, slow, "full"))
    assert len(large) < len(small)
    assert all(d == pytest.approx(3.0 * 1.0 * scale) for d in large)


def test_byte_peaks_count_the_queue_off_the_device_between_its_copies() -> None:
    sim = simulate(_one_rank(), Costs(transfer=0.25, queue=0.4))
    stage_bytes = [StageBytes(saved=100, queued=40)]
    out_start, out_end = sim.transfers[0][2][1:]
    back_start = sim.transfers[0][3][1]
    held, without = activation_level(sim, stage_bytes, 0, (out_end + back_start) / 2)
    # chunk 1 (100, reloaded for its I) and nothing of chunk 0: its queue is on the host
    assert (held, without - held) == (100, 40)
    held, _ = activation_level(sim, stage_bytes, 0, out_start)
    assert held == 140  # before the queue's copy ends
    assert activation_peaks(sim, stage_bytes) == [200]  # both chunks, before chunk 0's offload


def test_offload_inputs_carry_the_queue() -> None:
    inputs = OffloadInputs(costs=Costs(transfer=0.5, queue=(0.7, 2.5)), layers=(2, 2), layer_copy=(0.1, 0.1))
    back = OffloadInputs.from_dict(inputs.to_dict())
    assert back.costs.queue == (0.7, 2.5)
    assert OffloadInputs.from_dict({**inputs.to_dict(), "costs": {"transfer": 0.5}}).costs.queue is None


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(16, 64)
        self.down = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def _backward(model: nn.Module, x: torch.Tensor) -> None:
    model(x).square().mean().backward()


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))],
)
def test_a_queue_offloaded_between_i_and_w_gives_the_same_bits_and_frees_its_tensors(device: str) -> None:
    """CUDA: pinned host buffers, copies on the store's streams, W waiting on the reload's event."""
    x = torch.randn(32, 16, device=device, requires_grad=True)
    ref = _Mlp().to(device)
    _backward(ref, x)
    model = copy.deepcopy(ref)
    model.zero_grad(set_to_none=True)
    stage = SimpleNamespace(submod=model, backward_maybe_with_nosync=lambda: None)
    defer_weight_grads([stage])
    with collecting():
        _backward(model, x.detach().requires_grad_())
    weight_pass = stage.dw_builder()  # what torch calls at W
    assert isinstance(weight_pass, WeightPass) and len(weight_pass.entries) == 2
    queued = weakref.ref(weight_pass.entries[1][1])  # down's input: an intermediate only the queue holds
    store = ActivationStore(device, min_numel=0)
    key = queue_key((0, 0))
    weight_pass.offload(store, key)
    gc.collect()
    assert queued() is None, "the queued tensor outlived its copy to host memory"
    assert store.state(key) == "offloaded" and store.last_captured[key] > 0
    assert model.up.weight.grad is None  # W has not run
    weight_pass.reload()
    weight_pass()
    if device == "cuda":
        torch.cuda.synchronize()
    assert store.state(key) is None  # released after W
    for name, p in ref.named_parameters():
        assert torch.equal(dict(model.named_parameters())[name].grad, p.grad), name


def test_a_queue_reloaded_before_its_offload_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="reloaded before it was offloaded"):
        WeightPass(nn.Linear(2, 2), []).reload()
