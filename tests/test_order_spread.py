"""The order search spread over ranks gives exactly the serial search's orders.

In-process: `spread_map` with a thread-backed gather (each task runs once, on its assigned rank; a
failing task fails every rank). Gloo: two ranks build V orders together, through the API and through a
schedule class, and get the orders one process builds alone.
"""

from __future__ import annotations

import threading

import torch
from _dist import run_on_ranks

from pp_offload.order import adaptive_v_order, v_min_order, v_zb_order
from pp_offload.order.spread import SpreadTaskError, assign, spread_map

D, M = 4, 8
COSTS = {"F": 3.0, "I": 4.0, "W": 2.0}
LIMITS = (0.5, 0.75)


class _ThreadGather:
    """Ranks as threads of this process, exchanging through a shared list and a barrier."""

    def __init__(self, rank: int, size: int, board: list, barrier: threading.Barrier) -> None:
        self.rank, self.size, self.board, self.barrier = rank, size, board, barrier
        self.calls = 0

    def all_gather(self, obj):
        self.calls += 1
        self.board[self.rank] = obj
        self.barrier.wait(timeout=10)
        out = list(self.board)
        self.barrier.wait(timeout=10)
        return out


def _on_threads(size: int, body) -> list:
    board, barrier = [None] * size, threading.Barrier(size)
    results: list = [None] * size
    errors: list = [None] * size

    def run(rank: int) -> None:
        try:
            results[rank] = body(_ThreadGather(rank, size, board, barrier))
        except Exception as e:  # noqa: BLE001 - handed to the test thread
            errors[rank] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return [errors[r] or results[r] for r in range(size)]


def test_assign_balances_heaviest_first_and_is_deterministic():
    assert assign([1.0] * 5, 2) == [0, 1, 0, 1, 0]
    assert assign([3.0, 1.0, 1.0, 1.0], 2) == [0, 1, 1, 1]  # the heavy task alone on rank 0
    assert assign([1.0, 3.0], 3) == [1, 0]
    assert set(assign([1.0] * 6, 3)) == {0, 1, 2}


def test_spread_map_runs_each_task_once_and_every_rank_gets_all_results():
    ran: list[tuple[int, int]] = []
    lock = threading.Lock()

    def body(gather):
        def task(x: int) -> int:
            with lock:
                ran.append((gather.rank, x))
            return x * x

        return spread_map(gather, task, list(range(7)), weights=[1, 1, 1, 1, 1, 1, 5])

    results = _on_threads(3, body)
    assert results == [[x * x for x in range(7)]] * 3
    assert sorted(x for _, x in ran) == list(range(7))  # each task once, somewhere
    owner = assign([1, 1, 1, 1, 1, 1, 5], 3)
    assert sorted(ran) == sorted((owner[x], x) for x in range(7))  # on the rank assigned to it
    assert spread_map(None, lambda x: x + 1, [1, 2]) == [2, 3]  # no group: serial


def test_a_failing_task_fails_every_rank():
    def body(gather):
        return spread_map(gather, lambda x: 1 // (x - 2), list(range(4)))

    results = _on_threads(2, body)
    assert all(isinstance(r, SpreadTaskError) and "ZeroDivisionError" in str(r) for r in results)


def _spread_worker(rank: int, world: int) -> dict:
    from pp_offload.order import vshape
    from pp_offload.runtime.search_group import GroupGather

    gather = GroupGather()
    calls = [0]
    exchange = gather.all_gather

    def counted(obj):
        calls[0] += 1
        return exchange(obj)

    gather.all_gather = counted
    vshape._curve.cache_clear()
    out = {"min": v_min_order(D, M, COSTS, gather=gather)}  # V-Min's part of the curve, then the rest
    out["zb"] = v_zb_order(D, M, COSTS, gather=gather)
    out["adaptive"] = [adaptive_v_order(D, M, lim, COSTS, gather=gather) for lim in LIMITS]
    out["calls"] = calls[0]
    # A rank whose in-process curve is behind (a new one here): the ranks disagree on the state, so
    # each finishes alone, still with the same order.
    if rank == 1:
        vshape._curve.cache_clear()
    out["min_alone"] = v_min_order(D, M, COSTS, gather=gather)
    return out


def _schedule_worker(rank: int, world: int, m: int) -> dict:
    from torch.distributed.pipelining import PipelineStage

    from pp_offload import ScheduleVAdaptive
    from pp_offload.order import v_stages, vshape

    vshape._curve.cache_clear()
    layers = [torch.nn.Linear(4, 4) for _ in range(2 * world)]
    stages = [PipelineStage(layers[s], s, 2 * world, torch.device("cpu")) for s in v_stages(rank, world)]
    schedule = ScheduleVAdaptive(
        stages, m, loss_fn=torch.nn.functional.mse_loss, memory_limit=0.75, costs=COSTS
    )
    assert schedule._search_gather is not None and schedule._search_gather.size == world
    return {r: [str(a) for a in acts if a is not None] for r, acts in schedule.pipeline_order.items()}


def test_two_gloo_ranks_build_the_serial_orders():
    from pp_offload.order import vshape

    results = run_on_ranks(_spread_worker, 2, timeout=120)
    vshape._curve.cache_clear()  # the same history as the ranks': V-Min's part of the curve first
    serial_min = v_min_order(D, M, COSTS)
    serial_zb = v_zb_order(D, M, COSTS)
    for out in results:
        assert out["min"] == serial_min
        assert out["zb"] == serial_zb
        assert out["adaptive"] == [adaptive_v_order(D, M, lim, COSTS) for lim in LIMITS]
        assert out["min_alone"] == v_min_order(D, M, COSTS)
        assert out["calls"] >= 8  # two searches of three exchanges each, after agreeing (not serial)


def test_a_schedule_class_spreads_its_search_over_the_stages_group():
    m = 6
    results = run_on_ranks(_schedule_worker, 2, m, timeout=120)
    serial = adaptive_v_order(2, m, 0.75, COSTS)
    expected = {r: [str(a) for a in acts] for r, acts in serial.items()}
    assert results[0] == results[1] == expected
