"""Run a function on N local processes joined in a gloo process group, for multi-process tests.

    results = run_on_ranks(worker, 2, arg, key=value)   # worker(rank, world_size, arg, key=value)

Each rank runs in a fresh process (forked from a server that imported torch once, so a launch costs
milliseconds) with one CPU thread, joins a gloo group through a file store (no ports to race for), runs
the worker and sends back its return value (anything picklable; tensors are copied, not shared). The first
rank that raises brings the whole run down: the other ranks are killed (they may be blocked in a receive
that will never complete) and a RuntimeError carries the failing rank's traceback. A run that outlives
``timeout`` seconds is killed the same way, and the error shows where each unfinished rank was stuck
(Python stacks dumped by faulthandler on request).
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import queue
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

__all__ = ["run_on_ranks"]

_INIT_TIMEOUT = timedelta(seconds=60)


def run_on_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0, **kwargs: Any
) -> list[Any]:
    """``[fn(rank, world_size, *args, **kwargs) for rank in range(world_size)]``, one process per rank.

    ``fn`` must be importable by name (a module-level function of an importable module).
    """
    ctx = _context()
    results: queue.Queue[tuple[int, bool, bytes | str]] = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="pp_offload_dist_") as tmp:
        init_method = "file://" + os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(fn, rank, world_size, init_method, results, tmp, args, kwargs),
                name=f"rank{rank}",
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        try:
            return _collect(procs, results, world_size, timeout)
        except TimeoutError as e:
            raise TimeoutError(f"{e}\n{_stacks(procs, tmp)}") from None
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(timeout=10)


def _context() -> Any:
    """A fork server that has imported torch once: each rank then starts in milliseconds, not seconds,
    and still gets a clean process (nothing inherited from the test runner's state)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    return ctx


def _collect(procs: list[Any], results: Any, world_size: int, timeout: float) -> list[Any]:
    outputs: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(outputs) < world_size:
        try:
            rank, ok, payload = results.get(timeout=0.2)
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if r not in outputs and p.exitcode is not None]
            if dead:
                try:  # its report may still be in flight
                    rank, ok, payload = results.get(timeout=2.0)
                except queue.Empty:
                    code = procs[dead[0]].exitcode
                    raise RuntimeError(f"rank {dead[0]} exited with code {code} without a result") from None
            elif time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(outputs))
                raise TimeoutError(f"ranks {missing} did not finish within {timeout:.0f} s") from None
            else:
                continue
        if not ok:
            raise RuntimeError(f"rank {rank} failed:\n{payload}")
        outputs[rank] = pickle.loads(payload)
    return [outputs[r] for r in range(world_size)]


def _stacks(procs: list[Any], tmp: str) -> str:
    """Ask every live rank to dump its Python stacks, and return them."""
    for p in procs:
        if p.is_alive():
            os.kill(p.pid, signal.SIGUSR1)
    time.sleep(1.0)
    dumps = []
    for rank in range(len(procs)):
        path = os.path.join(tmp, f"stacks{rank}.txt")
        if os.path.exists(path):
            with open(path) as f:
                dumps.append(f"--- rank {rank} ---\n{f.read()}")
    return "\n".join(dumps)


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    init_method: str,
    results: Any,
    tmp: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> None:
    stacks = open(os.path.join(tmp, f"stacks{rank}.txt"), "w")  # open for the process's lifetime
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)

    import torch
    import torch.distributed as dist

    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=init_method, rank=rank, world_size=world_size, timeout=_INIT_TIMEOUT
        )
        report = (rank, True, pickle.dumps(fn(rank, world_size, *args, **kwargs)))
    except BaseException:
        report = (rank, False, traceback.format_exc())
    # Report before tearing down: a failed rank's peers may be blocked, and the parent kills them on it.
    results.put(report)
    if dist.is_initialized():
        dist.destroy_process_group()
