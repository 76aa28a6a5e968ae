"""Multi-process (gloo, CPU) checks that the V schedules compute exactly what one process computes.

One spawn per pipeline size runs every schedule class inside the same workers; the losses and every
parameter's gradient are compared with a single-process reference of the same model on the same batch.
The d=2 run also records one timed step of a V schedule and of torch's ScheduleZBVZeroBubble.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from _dist import run_on_ranks
from torch import nn

from pp_offload import ScheduleVAdaptive, ScheduleVHalf, ScheduleVMin, ScheduleVZB
from pp_offload.order import v_stages

HIDDEN = 8
ROWS_PER_MICROBATCH = 2
MICROBATCHES = {2: 4, 3: 5}  # d=3 runs fewer microbatches than 2d, a partial steady phase
ADAPTIVE_LIMITS = {2: (1.0, 0.5), 3: (1.0, 0.7)}  # 0.5 at d=2: the 2-chunk floor (1 / min(d, m))


def _configs(d: int) -> list[tuple[str, type, dict]]:
    configs = [(cls.__name__, cls, {}) for cls in (ScheduleVMin, ScheduleVHalf, ScheduleVZB)]
    # Deferred W is the default; torch's retained-graph split stays available and must stay exact too.
    configs.append(("ScheduleVHalf(torch split)", ScheduleVHalf, {"deferred_w": False}))
    configs += [
        (f"ScheduleVAdaptive({lim})", ScheduleVAdaptive, {"memory_limit": lim}) for lim in ADAPTIVE_LIMITS[d]
    ]
    return configs


def _model(d: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh()) for _ in range(2 * d)])


def _batch(m: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(m * ROWS_PER_MICROBATCH, HIDDEN, generator=gen)
    y = torch.randn(m * ROWS_PER_MICROBATCH, HIDDEN, generator=gen)
    return x, y


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)


def _stages(model: nn.Sequential, rank: int, d: int) -> list:
    from torch.distributed.pipelining import PipelineStage

    from pp_offload.runtime import compat

    stages = [PipelineStage(model[s], s, 2 * d, torch.device("cpu")) for s in v_stages(rank, d)]
    compat.skip_self_p2p_warmup(stages)  # torch 2.11 + gloo: no warm-up send to the own rank
    return stages


def _step(schedule, rank: int, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    losses: list[torch.Tensor] = []
    if rank == 0:  # V placement: the first stage (input) and the last (loss) both live on rank 0
        schedule.step(x, target=y, losses=losses)
    else:
        schedule.step()
    return losses


def _worker(rank: int, world_size: int, m: int, configs: list, timing: bool) -> dict:
    import torch.distributed as dist

    d = world_size
    model = _model(d)
    x, y = _batch(m)
    out: dict = {}
    for name, cls, kwargs in configs:
        model.zero_grad(set_to_none=True)
        schedule = cls(_stages(model, rank, d), m, loss_fn=_loss, scale_grads=False, **kwargs)
        losses = _step(schedule, rank, x, y)
        grads = {
            f"{s}.{n}": p.grad.detach().clone()
            for s in v_stages(rank, d)
            for n, p in model[s].named_parameters()
        }
        out[name] = {"losses": [loss.detach().clone() for loss in losses], "grads": grads}
    if timing:
        from torch.distributed.pipelining import ScheduleZBVZeroBubble

        from pp_offload import record_actions
        from pp_offload.runtime import compat

        out["timing"] = {}
        from pp_offload.runtime.deferred_w import defer_weight_grads

        for cls in (ScheduleVHalf, ScheduleZBVZeroBubble):
            stages = _stages(model, rank, d)
            defer_weight_grads(stages)  # torch's own class built by hand: the documented call
            schedule = cls(stages, m, loss_fn=_loss, scale_grads=False)
            _step(schedule, rank, x, y)  # warm-up: shape inference and p2p set-up are not part of a step
            dist.barrier()
            with record_actions(schedule) as rec:
                _step(schedule, rank, x, y)
            _step(schedule, rank, x, y)  # detached: records nothing more
            events = rec.gather()
            trace = None
            if rank == 0:
                with tempfile.TemporaryDirectory() as tmp:
                    path = os.path.join(tmp, "trace.json")
                    rec.to_chrome_trace(path, events)
                    with open(path) as f:
                        trace = f.read()
            out["timing"][cls.__name__] = {
                "events": [tuple(e) for e in events],
                "lowered": [str(a) for a in compat.lowered_order(schedule)[rank]],
                "trace": trace,
            }
    return out


@functools.cache
def _run(d: int) -> list[dict]:
    return run_on_ranks(_worker, d, MICROBATCHES[d], _configs(d), d == 2, timeout=120)


def _reference(d: int) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    model = _model(d)
    x, y = _batch(MICROBATCHES[d])
    losses = [
        _loss(model(xc), yc)
        for xc, yc in zip(x.tensor_split(MICROBATCHES[d]), y.tensor_split(MICROBATCHES[d]), strict=True)
    ]
    torch.stack(losses).sum().backward()
    grads = {name: p.grad for name, p in model.named_parameters()}  # "<stage>.<name in stage>"
    return [loss.detach() for loss in losses], grads


@pytest.mark.parametrize("d", [2, 3])
def test_losses_and_grads_match_single_process(d):
    results = _run(d)
    ref_losses, ref_grads = _reference(d)
    for name, _, _ in _configs(d):
        torch.testing.assert_close(torch.stack(results[0][name]["losses"]), torch.stack(ref_losses), msg=name)
        seen = set()
        for rank in range(d):
            for key, grad in results[rank][name]["grads"].items():
                torch.testing.assert_close(grad, ref_grads[key], msg=lambda m, k=f"{name} {key}": f"{k}: {m}")
                seen.add(key)
        assert seen == set(ref_grads), f"{name}: grads of {sorted(set(ref_grads) - seen)} never reported"


@pytest.mark.parametrize("schedule", ["ScheduleVHalf", "ScheduleZBVZeroBubble"])
def test_recorded_step(schedule):
    from pp_offload.runtime.timing import ActionEvent, action_category, realized_bubble

    results = _run(2)
    timing = [r["timing"][schedule] for r in results]
    events = [ActionEvent(*e) for e in timing[0]["events"]]
    assert [ActionEvent(*e) for e in timing[1]["events"]] == events  # gathered on every rank
    for rank in range(2):
        mine = [e for e in events if e.rank == rank]
        executed = Counter(a for a in timing[rank]["lowered"] if action_category(a) == "compute")
        recorded = Counter(e.action for e in mine if action_category(e.action) == "compute")
        assert recorded == executed and max(recorded.values()) == 1
        # Every non-wait action of the lowered order was recorded once, in execution order.
        assert [e.action for e in mine if not e.action.startswith("wait:")] == timing[rank]["lowered"]
        for e in mine:
            assert e.start <= e.end
        for a, b in zip(mine, mine[1:], strict=False):
            assert a.end <= b.start
    trace = json.loads(timing[0]["trace"])
    slices = [t for t in trace["traceEvents"] if t["ph"] == "X"]
    assert len(slices) == len(events)
    assert {t["pid"] for t in slices} == {0, 1}
    assert {"compute", "comm"} <= {t["cat"] for t in slices}
    assert 0.0 <= realized_bubble(events) < 1.0
