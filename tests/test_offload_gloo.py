"""Multi-process (gloo, CPU): activation offload changes no loss and no gradient, on every schedule.

For d = 2 and 3, our V schedules, torch's ZBVZeroBubble and DualPipeV (V placement) and its
Interleaved1F1B and InterleavedZeroBubble (loop placement) run without offload, with full offload and
with selective offload of half the chunks; losses and every parameter's gradient must equal a
single-process reference. At d = 3, V-ZB's full offload also moves chunks' deferred-W queues to host
memory between their I and W and back for W (checked). The activations are large enough (> the store's
1024-element floor) that offload really moves bytes, which the test checks. A RELOAD removed from an
order must fail with an error naming the chunk.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from _dist import run_on_ranks
from _reference import sequential_reference
from torch import nn

HIDDEN = 48
ROWS = 32  # rows per microbatch: activations of 1536 elements, above the store's floor
OFFLOADS = (None, "full", "selective:0.5")


def _model(d: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.GELU()) for _ in range(2 * d)])


def _batch(m: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(m * ROWS, HIDDEN, generator=gen), torch.randn(m * ROWS, HIDDEN, generator=gen)


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)


def _schedules(d: int) -> list[tuple[str, str]]:
    """(name, placement) of every schedule under test."""
    ours = ["ScheduleVMin", "ScheduleVHalf", "ScheduleVZB", "ScheduleVAdaptive"]
    theirs = [("ScheduleZBVZeroBubble", "v"), ("ScheduleDualPipeV", "v")]
    theirs += [("ScheduleInterleaved1F1B", "loop"), ("ScheduleInterleavedZeroBubble", "loop")]
    return [(n, "v") for n in ours] + theirs


def _build(name: str, stages: list, m: int, offload):
    from pp_offload.runtime.catalog import build_schedule, schedule_info
    from pp_offload.runtime.offload import enable_offload

    kwargs = {"loss_fn": _loss, "scale_grads": False}
    if name.startswith("ScheduleV"):
        extra = {"memory_limit": 1.0} if name == "ScheduleVAdaptive" else {}
        return build_schedule(schedule_info(name), stages, m, offload=offload, **kwargs, **extra)
    schedule = build_schedule(schedule_info(name), stages, m, **kwargs)  # deferred W for torch's split ones
    enable_offload(schedule, offload)
    return schedule


def _stage_ids(rank: int, d: int, placement: str) -> tuple[int, int]:
    return (rank, 2 * d - 1 - rank) if placement == "v" else (rank, rank + d)


def _worker(rank: int, world_size: int, m: int) -> dict:
    from torch.distributed.pipelining import PipelineStage

    from pp_offload.runtime import compat

    d = world_size
    model = _model(d)
    x, y = _batch(m)
    out: dict = {}
    for name, placement in _schedules(d):
        ids = _stage_ids(rank, d, placement)
        holds_first, holds_last = 0 in ids, 2 * d - 1 in ids
        for offload in OFFLOADS:
            model.zero_grad(set_to_none=True)
            stages = [PipelineStage(model[s], s, 2 * d, torch.device("cpu")) for s in ids]
            compat.skip_self_p2p_warmup(stages)  # torch 2.11 + gloo: no warm-up send to the own rank
            schedule = _build(name, stages, m, offload)
            losses: list[torch.Tensor] = []
            schedule.step(
                *((x,) if holds_first else ()),
                **({"target": y, "losses": losses} if holds_last else {}),
            )
            moved, drops, queues = 0, set(), set()
            if offload is not None:
                store = schedule.offload.store
                moved = store.stats().host_pool_bytes  # grows only when chunks go to host
                drops = set(schedule.offload.plan.dropped_after_i(rank))
                # deferred W: a drop between I and W moves the chunk's W queue (its own store chunk)
                queues = schedule.offload.moved_queues()
                assert schedule.offload.store.resident_bytes() == 0, "chunks left in the store after a step"
            grads = {f"{s}.{n}": p.grad.clone() for s in ids for n, p in model[s].named_parameters()}
            out[(name, offload)] = {
                "losses": [t.detach() for t in losses],
                "grads": grads,
                "moved": moved,
                "drops": drops,
                "queues": queues,
            }
    return out


def _reference(d: int, m: int) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    return sequential_reference(_model(d), *_batch(m), m, _loss)


@functools.cache
def _run(d: int) -> list[dict]:
    return run_on_ranks(_worker, d, 2 * d, timeout=180)


@pytest.mark.parametrize("d", [2, 3])
def test_offload_keeps_losses_and_grads(d: int) -> None:
    m = 2 * d
    ref_losses, ref_grads = _reference(d, m)
    results = _run(d)
    for name, _ in _schedules(d):
        for offload in OFFLOADS:
            losses = [t for r in results for t in r[(name, offload)]["losses"]]
            torch.testing.assert_close(losses, ref_losses, msg=f"{name} offload={offload}: losses")
            grads = {k: v for r in results for k, v in r[(name, offload)]["grads"].items()}
            assert grads.keys() == ref_grads.keys()
            for key, grad in grads.items():
                torch.testing.assert_close(grad, ref_grads[key], msg=f"{name} offload={offload}: {key}")
            if offload is not None:
                assert sum(r[(name, offload)]["moved"] for r in results) > 0, (
                    f"{name} {offload}: no bytes moved"
                )
    if d == 3:  # V-ZB keeps chunks from I to W: full offload moves their W queue in between, back for W
        drops = set().union(*(r[("ScheduleVZB", "full")]["drops"] for r in results))
        assert drops
        # stage 0's one linear reads the user's input, which needs no gradient: its weight gradient is
        # computed in I and nothing is queued; every other dropped chunk moved its queue
        queues = set().union(*(r[("ScheduleVZB", "full")]["queues"] for r in results))
        assert queues == {k for k in drops if k[0] != 0}


def _missing_reload_worker(rank: int, world_size: int, m: int) -> None:
    from torch.distributed.pipelining import PipelineStage

    from pp_offload import ScheduleVHalf
    from pp_offload.runtime import compat

    d = world_size
    model = _model(d)
    x, y = _batch(m)
    ids = _stage_ids(rank, d, "v")
    stages = [PipelineStage(model[s], s, 2 * d, torch.device("cpu")) for s in ids]
    compat.skip_self_p2p_warmup(stages)  # torch 2.11 + gloo: no warm-up send to the own rank
    schedule = ScheduleVHalf(stages, m, loss_fn=_loss, scale_grads=False, offload="full")
    lowered = compat.lowered_order(schedule)
    for r in lowered:  # drop the first RELOAD of every rank
        first = next(i for i, a in enumerate(lowered[r]) if str(a.computation_type.value) == "RELOAD")
        del lowered[r][first]
    if rank == 0:
        schedule.step(x, target=y, losses=[])
    else:
        schedule.step()


def test_missing_reload_fails_naming_the_chunk() -> None:
    with pytest.raises(RuntimeError, match=r"\(\d+, \d+\).*(reload|RELOAD)"):
        run_on_ranks(_missing_reload_worker, 2, 4, timeout=120)
