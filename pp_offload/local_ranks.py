"""Run a function on N local processes joined in a gloo process group: the demo's, the benchmarks' and the
tests' one launcher.

    results = run_on_ranks(worker, 2, arg, key=value, timeout=60)   # worker(rank, world_size, arg, key=value)

Why one mechanism: launching ranks is where multi-process code hangs. A rank that raises leaves its peers
blocked in a receive that never completes; a deadlock leaves everyone blocked; a killed rank can leave the
parent waiting for a report that never comes. `run_on_ranks` bounds every wait and always ends every rank:

- Each rank is a fresh process (forked from a server that imported torch once, so a launch costs
  milliseconds rather than seconds of imports per rank, yet inherits nothing from the caller's state), with
  one CPU thread, the caller's environment at launch time, and a gloo process group joined through a file
  store in a private temporary directory (no port to pick, so no port race) before ``fn`` runs and
  destroyed after it returns. The group's ``op_timeout`` bounds its initialisation and every collective.
- Inside a rank, `send` streams progress messages to the parent while the ranks run (``on_message``).
- ``fn``'s return value (anything picklable; tensors are copied, not shared) comes back per rank, in rank
  order. The first rank that raises brings the whole run down: the others are killed and `RankError`
  carries that rank's traceback. A rank that dies without a word (killed, segfault) raises `RankError`
  with its exit code.
- A run that outlives ``timeout`` seconds, or goes ``idle_timeout`` seconds without a message or result,
  is killed the same way; `RankTimeout` (a `TimeoutError`) shows where every live rank was stuck: its
  Python stacks, dumped by faulthandler on request.

Each rank reports over its own pipe with length-prefixed frames that the parent reads without blocking, so
a rank dying in the middle of a report is seen as an end of file, never as a read that waits forever.
"""

from __future__ import annotations

import faulthandler
import math
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import select
import signal
import struct
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

__all__ = ["RankError", "RankTimeout", "format_stacks", "run_on_ranks", "send"]

# Imported once by the fork server, so that ranks start with them loaded (torch ~2 s, pipelining ~2 s).
PRELOAD = ("torch", "torch.distributed", "torch.distributed.pipelining")

_POLL_S = 0.1  # how often the parent looks at the clock and at the ranks' exit codes
_DEATH_GRACE_S = 2.0  # a rank seen dead but with its pipe still open (a child of its holds it): wait this
_EXIT_GRACE_S = 5.0  # after every result: time for the ranks to tear down their groups and exit
_KILL_WAIT_S = 10.0  # after SIGKILL: a bound on waiting for the processes to be gone
_DUMP_WAIT_S = 2.0  # after asking for stack dumps: a bound on waiting for them
_HEADER = struct.Struct("!BQ")  # frame: tag, payload length, payload
_RESULT, _ERROR, _MESSAGE, _READY = 0, 1, 2, 3
_READ_CHUNK = 1 << 20


class RankError(RuntimeError):
    """A rank raised (``remote_traceback`` is its traceback) or died without a result (``exitcode``)."""

    def __init__(self, rank: int, remote_traceback: str | None = None, exitcode: int | None = None) -> None:
        self.rank = rank
        self.remote_traceback = remote_traceback
        self.exitcode = exitcode
        if remote_traceback is not None:
            message = f"rank {rank} failed:\n{remote_traceback}"
        else:
            message = f"rank {rank} exited with code {exitcode} without a result"
        super().__init__(message)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.rank, self.remote_traceback, self.exitcode))


class RankTimeout(TimeoutError):
    """The run outlived its time; ``unfinished`` ranks had no result, ``stacks`` maps each live rank to its
    Python stacks (all threads) at the moment the run was stopped."""

    def __init__(self, reason: str, unfinished: list[int], stacks: dict[int, str]) -> None:
        self.reason = reason
        self.unfinished = unfinished
        self.stacks = stacks
        super().__init__(f"{reason}\n{format_stacks(stacks)}" if stacks else reason)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.reason, self.unfinished, self.stacks))


def format_stacks(stacks: dict[int, str]) -> str:
    """``--- rank r ---`` and its stack dump, for each rank in ``stacks``."""
    return "\n".join(f"--- rank {rank} ---\n{dump}" for rank, dump in sorted(stacks.items()))


# --------------------------------------------------------------------------------------------------------
# Parent side


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float,
    on_message: Callable[[int, str, Any], None] | None = None,
    idle_timeout: float | None = None,
    op_timeout: float | None = None,
    **kwargs: Any,
) -> list[Any]:
    """``[fn(rank, world_size, *args, **kwargs) for rank in range(world_size)]``, one process per rank.

    ``fn`` must be picklable by reference (a module-level function of an importable module), and so must
    ``args``, ``kwargs`` and its return value. ``timeout`` bounds the whole run; ``idle_timeout``, if given,
    bounds the time without any message or result (a run that makes progress may take long, a stuck one
    may not); ``op_timeout`` bounds the gloo group's initialisation and each of its operations (default:
    ``min(timeout, 60)``). ``on_message(rank, kind, payload)`` is called, in the caller's thread, for each
    `send` of a rank, in the order that rank sent them; an exception it raises ends the run like a
    failing rank. The keyword names of this function cannot be passed through to ``fn``.

    Raises `RankError` for the first rank that raised or died, `RankTimeout` when out of time.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0, got {timeout}")
    op_timeout = min(timeout, 60.0) if op_timeout is None else op_timeout
    start = time.monotonic()  # starting the ranks counts: the first start also starts the fork server
    ctx = _context()
    env = dict(os.environ)
    procs: list[Any] = []
    readers: list[Any] = []
    with tempfile.TemporaryDirectory(prefix="pp_offload_ranks_") as tmp:
        try:
            for rank in range(world_size):
                reader, writer = ctx.Pipe(duplex=False)
                readers.append(reader)
                proc = ctx.Process(
                    target=_rank_main,
                    args=(fn, rank, world_size, writer, tmp, env, op_timeout, args, kwargs),
                    name=f"rank{rank}",
                    daemon=True,
                )
                try:
                    proc.start()
                finally:
                    writer.close()  # the rank holds the only write end: its exit is our end of file
                procs.append(proc)
            collector = _Collector(procs, readers, on_message, start)
            results = collector.run(start + timeout, timeout, idle_timeout, tmp)
            _wait_exit(procs, _EXIT_GRACE_S)  # let them destroy their groups before we kill anything
            return results
        finally:
            _kill(procs)
            for reader in readers:
                reader.close()


def _context() -> Any:
    """A fork server that has imported torch once: each rank then starts in milliseconds, not seconds,
    and still gets a clean process: the fork server does nothing but fork, single-threaded, so nothing of
    the caller's state or threads comes along. Where there is no fork server (Windows), spawn."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))  # no effect once the server runs; missing modules skipped
    return ctx


class _Collector:
    """The parent's loop: read frames from every rank's pipe, watch the clock and the ranks' exits."""

    def __init__(
        self,
        procs: list[Any],
        readers: list[Any],
        on_message: Callable[[int, str, Any], None] | None,
        start: float,
    ) -> None:
        self.procs = procs
        self.on_message = on_message
        self.open = {reader: rank for rank, reader in enumerate(readers)}
        self.buffers = [bytearray() for _ in procs]
        self.results: dict[int, Any] = {}
        self.ready: set[int] = set()  # ranks that can dump their stacks (before, SIGUSR1 would kill them)
        self.last_heard = start

    def run(self, deadline: float, timeout: float, idle_timeout: float | None, tmp: str) -> list[Any]:
        world_size = len(self.procs)
        dead_since: dict[int, float] = {}
        while len(self.results) < world_size:
            failures: list[tuple[float, RankError]] = []
            for reader in mp.connection.wait(list(self.open), timeout=_POLL_S):
                failures += self._read(reader)
            if failures:  # several at once: the earliest is the cause, the others its consequences
                raise min(failures, key=lambda f: f[0])[1]
            now = time.monotonic()
            for rank, proc in enumerate(self.procs):
                if rank not in self.results and proc.exitcode is not None:
                    # dead, yet its pipe is still open: a child of its holds the write end
                    if now - dead_since.setdefault(rank, now) > _DEATH_GRACE_S:
                        raise RankError(rank, exitcode=proc.exitcode)
            reason = None
            if now > deadline:
                reason = f"did not finish within {timeout:g} s"
            elif idle_timeout is not None and now - self.last_heard > idle_timeout:
                reason = f"sent nothing for {idle_timeout:g} s"
            if reason is not None:
                unfinished = sorted(set(range(world_size)) - set(self.results))
                stacks = _stacks(self.procs, self.ready, tmp)
                raise RankTimeout(f"ranks {unfinished} {reason}", unfinished, stacks)
        return [self.results[rank] for rank in range(world_size)]

    def _read(self, reader: Any) -> list[tuple[float, RankError]]:
        """Take what the pipe holds (it is readable: this does not block) and handle complete frames;
        return the failures it reports, each with when it happened (a rank's death counts as earlier
        than any reported error: a peer's error is then most likely its consequence)."""
        rank = self.open[reader]
        data = os.read(reader.fileno(), _READ_CHUNK)
        if not data:  # end of file: the rank exited; a result would have come before
            del self.open[reader]
            if rank in self.results:
                return []
            self.procs[rank].join(timeout=_DEATH_GRACE_S)
            return [(-math.inf, RankError(rank, exitcode=self.procs[rank].exitcode))]
        self.last_heard = time.monotonic()
        buf = self.buffers[rank]
        buf += data
        while len(buf) >= _HEADER.size:
            tag, size = _HEADER.unpack_from(buf)
            end = _HEADER.size + size
            if len(buf) < end:
                break
            payload = bytes(buf[_HEADER.size : end])
            del buf[:end]
            if tag == _ERROR:
                when, remote_traceback = pickle.loads(payload)
                return [(when, RankError(rank, remote_traceback))]  # the rank sends nothing after it
            if tag == _READY:
                self.ready.add(rank)
            elif tag == _RESULT:
                self.results[rank] = pickle.loads(payload)
            elif self.on_message is not None:
                kind, message = pickle.loads(payload)
                self.on_message(rank, kind, message)
        return []


def _stacks(procs: list[Any], ready: set[int], tmp: str) -> dict[int, str]:
    """Ask every live rank to dump its Python stacks (faulthandler, from a C signal handler: works while
    the rank is blocked in a native call), and return the dumps."""
    if not hasattr(signal, "SIGUSR1"):
        return {}
    asked = []
    dumps = {}
    for rank, proc in enumerate(procs):
        if not proc.is_alive():
            continue
        if rank not in ready:
            dumps[rank] = "(still starting: no Python stack to show yet)\n"
        else:
            try:
                os.kill(proc.pid, signal.SIGUSR1)
                asked.append(rank)
            except ProcessLookupError:
                pass
    paths = {rank: os.path.join(tmp, f"stacks{rank}.txt") for rank in asked}
    deadline = time.monotonic() + _DUMP_WAIT_S
    while time.monotonic() < deadline and not all(_size(p) > 0 for p in paths.values()):
        time.sleep(0.05)
    time.sleep(0.1)  # a dump in progress: let it finish
    for rank, path in paths.items():
        try:
            with open(path) as f:
                dumps[rank] = f.read() or "(no stack dump)\n"
        except OSError:
            dumps[rank] = "(no stack dump)\n"
    return dumps


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _wait_exit(procs: list[Any], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))


def _kill(procs: list[Any]) -> None:
    """SIGKILL whatever still runs (a rank may be blocked in a native receive: nothing gentler works),
    and wait, boundedly, for it to be gone."""
    for proc in procs:
        if proc.is_alive():
            try:
                proc.kill()
            except (ProcessLookupError, ValueError):
                pass
    _wait_exit(procs, _KILL_WAIT_S)


# --------------------------------------------------------------------------------------------------------
# Rank side


class _Channel:
    """The rank's end of its pipe: whole frames, one thread at a time."""

    def __init__(self, writer: Any) -> None:
        self.writer = writer
        self.lock = threading.Lock()

    def write(self, tag: int, payload: bytes) -> None:
        frame = memoryview(_HEADER.pack(tag, len(payload)) + payload)
        with self.lock:
            fd = self.writer.fileno()
            while frame:
                frame = frame[os.write(fd, frame) :]


_channel: _Channel | None = None


def send(kind: str, payload: Any = None) -> None:
    """From inside a rank: pass ``(kind, payload)`` to the parent's ``on_message`` while the ranks run.

    ``payload`` is pickled here, so an unpicklable one raises here. Blocks only while the parent's pipe is
    full (the parent reads continuously). Outside a rank of `run_on_ranks` this raises RuntimeError.
    """
    if _channel is None:
        raise RuntimeError("local_ranks.send() works only inside a rank started by run_on_ranks")
    _channel.write(_MESSAGE, pickle.dumps((kind, payload)))


def _exit_with_caller(writer: Any) -> None:
    """Linux: end this rank as soon as the caller's end of its pipe closes (the caller died: killed
    outright, out of memory, a CI runner's kill; or gave up on the run), so that no rank is left behind
    blocked in a receive or spinning forever. A thread polls the pipe for the error that a write end
    shows once no reader is left. (The kernel's parent-death signal would not do: a rank's parent is the
    fork server, which outlives the caller while any rank runs.) Elsewhere the group's timeouts end
    blocked ranks."""
    if not (sys.platform.startswith("linux") and hasattr(select, "poll")):
        return
    fd = writer.fileno()

    def watch() -> None:
        poll = select.poll()
        poll.register(fd, 0)  # no events asked: only errors and hang-ups, which poll reports always
        while True:
            for _, events in poll.poll():
                if events & (select.POLLERR | select.POLLHUP | select.POLLNVAL):
                    os._exit(1)

    threading.Thread(target=watch, name="exit-with-caller", daemon=True).start()


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    writer: Any,
    tmp: str,
    env: dict[str, str],
    op_timeout: float,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> None:
    """Entry point of a rank: set up, join the group, run ``fn``, report, leave the group."""
    global _channel
    _exit_with_caller(writer)
    stacks = open(os.path.join(tmp, f"stacks{rank}.txt"), "w")  # open for the process's lifetime
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    # The fork server's environment is the caller's when it started; give the rank the caller's now.
    # (What torch read at import time, in the fork server, stays as it was.)
    os.environ.clear()
    os.environ.update(env)
    if sys.platform.startswith("linux") and os.path.exists("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the ranks are local: never another interface
    _channel = channel = _Channel(writer)
    channel.write(_READY, b"")  # from now on SIGUSR1 dumps stacks (before, it would kill the process)

    import torch
    import torch.distributed as dist

    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method="file://" + os.path.join(tmp, "store"),
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=op_timeout),
        )
        tag, payload = _RESULT, pickle.dumps(fn(rank, world_size, *args, **kwargs))
    except BaseException:  # when: CLOCK_MONOTONIC is one clock for all processes of the machine
        tag, payload = _ERROR, pickle.dumps((time.monotonic(), traceback.format_exc()))
    # Report before tearing down: a failed rank's peers may be blocked, and the parent kills them on it.
    try:
        channel.write(tag, payload)
    except OSError:  # the parent is gone
        pass
    if dist.is_initialized():
        dist.destroy_process_group()
