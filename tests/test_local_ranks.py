"""`pp_offload.local_ranks.run_on_ranks`: results in rank order, progress messages while the ranks run, and
every way a run can go wrong (a rank raises, a rank dies, a rank hangs) ends promptly, with the cause, and
with no process left behind.

The fork server starts once per session (it imports torch: a few seconds, in the fixture below, so that
the tests with short timeouts do not pay for it); after that a launch takes well under a second.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from pp_offload import local_ranks
from pp_offload.local_ranks import RankError, RankTimeout, run_on_ranks


def _gone(pid: int) -> bool:
    """The process no longer runs (exited, or a zombie waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False


def _assert_all_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + 5
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_gone(p) for p in pids), [p for p in pids if not _gone(p)]


# -------------------------------------------------------------------------------------------------------
# Rank functions (module level: they travel to the ranks by name)


def _identity(rank: int, world_size: int, arg: str, *, key: int) -> dict:
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)  # the group is up
    return {
        "rank": rank,
        "world_size": world_size,
        "arg": arg,
        "key": key,
        "sum": total,
        "threads": torch.get_num_threads(),
        "env": os.environ.get("PP_OFFLOAD_TEST_LAUNCH"),
    }


def _chatty(rank: int, world_size: int, flag: str) -> bool:
    for i in range(3):
        local_ranks.send("step", i)
    local_ranks.send("pid", os.getpid())
    if rank != 0:
        return False
    deadline = time.monotonic() + 10  # the parent answers our messages while we run
    while not os.path.exists(flag):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _fail_on_one(rank: int, world_size: int) -> None:
    local_ranks.send("pid", os.getpid())
    if rank == 1:
        raise ValueError("rank 1 fails on purpose")
    dist.recv(torch.zeros(1), src=1)  # never comes: only the parent's kill ends this


def _die_on_one(rank: int, world_size: int) -> None:
    local_ranks.send("pid", os.getpid())
    if rank == 1:
        os._exit(3)
    time.sleep(60)


def _stuck_forever(rank: int, world_size: int) -> None:
    local_ranks.send("pid", os.getpid())
    if rank == 0:
        dist.recv(torch.zeros(1), src=1)
    else:
        _sleeping_here()


def _sleeping_here() -> None:
    time.sleep(60)


def _quiet(rank: int, world_size: int) -> None:
    time.sleep(60)


def _report_pid_and_hang(rank: int, world_size: int, directory: str) -> None:
    with open(os.path.join(directory, f"{rank}.tmp"), "w") as f:
        f.write(str(os.getpid()))
    os.rename(os.path.join(directory, f"{rank}.tmp"), os.path.join(directory, f"{rank}.pid"))
    time.sleep(60)


def _unpicklable(rank: int, world_size: int) -> object:
    return lambda: None


def _nothing(rank: int, world_size: int) -> None:
    pass


@pytest.fixture(scope="module", autouse=True)
def _fork_server_running() -> None:
    run_on_ranks(_nothing, 1, timeout=120)


# -------------------------------------------------------------------------------------------------------


def test_results_come_back_in_rank_order(monkeypatch):
    monkeypatch.setenv("PP_OFFLOAD_TEST_LAUNCH", "seen")  # set now: the ranks get the caller's environment
    out = run_on_ranks(_identity, 3, "a", key=7, timeout=60)
    assert [r["rank"] for r in out] == [0, 1, 2]
    for r in out:
        assert (r["world_size"], r["arg"], r["key"], r["threads"], r["env"]) == (3, "a", 7, 1, "seen")
        assert torch.equal(r["sum"], torch.tensor([3.0]))


def test_messages_reach_the_parent_while_the_ranks_run(tmp_path):
    flag = tmp_path / "flag"
    got: list[tuple[int, str, object]] = []

    def on_message(rank: int, kind: str, payload: object) -> None:
        got.append((rank, kind, payload))
        if (rank, kind) == (0, "step"):
            flag.touch()

    out = run_on_ranks(_chatty, 2, str(flag), timeout=60, on_message=on_message)
    assert out == [True, False]  # rank 0 saw the parent react to its first message before it returned
    for rank in (0, 1):
        mine = [(kind, payload) for r, kind, payload in got if r == rank]
        assert mine[:3] == [("step", 0), ("step", 1), ("step", 2)]
        assert mine[3][0] == "pid"
    _assert_all_gone([payload for _, kind, payload in got if kind == "pid"])


def test_a_failing_rank_surfaces_its_traceback_and_ends_the_others():
    pids: list[int] = []
    start = time.monotonic()
    with pytest.raises(RankError) as exc:
        run_on_ranks(_fail_on_one, 3, timeout=60, on_message=lambda r, k, p: pids.append(p))
    assert time.monotonic() - start < 10
    err = exc.value
    assert isinstance(err, RuntimeError) and err.rank == 1
    assert "rank 1 failed" in str(err) and "ValueError: rank 1 fails on purpose" in str(err)
    assert "_fail_on_one" in err.remote_traceback  # the rank's own traceback, not the parent's
    _assert_all_gone(pids)


def test_a_rank_that_dies_without_a_word_is_reported_with_its_exit_code():
    pids: list[int] = []
    with pytest.raises(RankError, match="rank 1 exited with code 3 without a result") as exc:
        run_on_ranks(_die_on_one, 2, timeout=60, on_message=lambda r, k, p: pids.append(p))
    assert exc.value.exitcode == 3
    _assert_all_gone(pids)


def test_timeout_raises_with_every_live_ranks_stack():
    pids: list[int] = []
    start = time.monotonic()
    with pytest.raises(TimeoutError) as exc:  # 4 s: on a loaded machine a rank may need 2 s to start
        run_on_ranks(_stuck_forever, 2, timeout=4, on_message=lambda r, k, p: pids.append(p))
    assert time.monotonic() - start < 12
    err = exc.value
    assert isinstance(err, RankTimeout) and err.unfinished == [0, 1]
    text = str(err)
    assert "ranks [0, 1] did not finish within 4 s" in text
    assert "--- rank 0 ---" in text and "--- rank 1 ---" in text
    assert "_stuck_forever" in err.stacks[0] and "_sleeping_here" in err.stacks[1]
    _assert_all_gone(pids)


def test_idle_timeout_stops_a_run_that_sends_nothing():
    start = time.monotonic()
    with pytest.raises(RankTimeout, match=r"sent nothing for 1 s"):
        run_on_ranks(_quiet, 2, timeout=60, idle_timeout=1)
    assert time.monotonic() - start < 10


def test_an_unpicklable_result_is_the_ranks_error():
    with pytest.raises(RankError, match="rank 0 failed") as exc:
        run_on_ranks(_unpicklable, 1, timeout=60)
    assert "pickle" in exc.value.remote_traceback.lower()


_CALLER = """
import sys
from pp_offload import local_ranks
import test_local_ranks
local_ranks.PRELOAD = ("torch",)  # a fresh fork server: the smallest preload, to start quickly
local_ranks.run_on_ranks(test_local_ranks._report_pid_and_hang, 2, sys.argv[1], timeout=60)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ranks watch their pipe with poll(2)")
def test_ranks_die_with_a_caller_killed_outright(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), *sys.path])}
    caller = subprocess.Popen([sys.executable, "-c", _CALLER, str(tmp_path)], env=env, start_new_session=True)
    try:
        paths = [tmp_path / f"{rank}.pid" for rank in range(2)]
        deadline = time.monotonic() + 30
        while not all(p.exists() for p in paths):
            assert caller.poll() is None and time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.05)
        pids = [int(p.read_text()) for p in paths]
        assert not any(_gone(p) for p in pids)
        caller.send_signal(signal.SIGKILL)  # no finally, no atexit: only the ranks themselves can notice
        caller.wait(timeout=10)
        _assert_all_gone(pids)
    finally:
        if caller.poll() is None:
            caller.kill()
        caller.wait(timeout=10)


def test_send_outside_a_rank_raises():
    with pytest.raises(RuntimeError, match="inside a rank"):
        local_ranks.send("step", 0)
