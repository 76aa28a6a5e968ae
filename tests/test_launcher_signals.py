"""``pp-offload train`` passes signals on and launches on several nodes (docs/reliability.md#preemption,
docs/recipe.md#several-nodes).

The forwarding is tested on a stand-in for torchrun (a Python process with one child "worker", both
recording the signals they get: milliseconds); the real thing once, end to end: two launchers on loopback
joined by a c10d rendezvous (one rank each), SIGTERM to one launcher mid-run: both ranks finish the step,
write the checkpoint, every process is gone within 60 s.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml
from _tiny_hf import RECIPE_LLAMA

from pp_offload.recipe.signals import run_forwarding_signals
from pp_offload.recipe.train_command import _check_nodes, add_arguments, torchrun_command

REPO = Path(__file__).resolve().parents[1]

# A stand-in for torchrun: starts one child (a "worker"); each writes the signals it gets to its own file
# ("torchrun" exits 7 after SIGTERM or SIGINT, as torchrun exits non-zero after a signal; the worker exits
# after SIGUSR1, and then "torchrun" exits 0 like torchrun after its workers succeeded).
_FAKE_TORCHRUN = textwrap.dedent(
    """
    import os, signal, subprocess, sys, time
    log = sys.argv[1]
    if sys.argv[2:] == ["worker"]:
        def note(signum, frame):
            open(log + ".worker", "a").write(signal.Signals(signum).name + "\\n")
            if signum == signal.SIGUSR1:
                sys.exit(0)
        signal.signal(signal.SIGUSR1, note)
        open(log + ".ready", "w").close()
        time.sleep(30)
        sys.exit(3)
    worker = subprocess.Popen([sys.executable, __file__, log, "worker"])
    def note(signum, frame):
        open(log + ".torchrun", "a").write(signal.Signals(signum).name + "\\n")
        os.kill(worker.pid, signal.SIGKILL)  # (Popen.wait here would wait for the wait it interrupted)
        os._exit(7)
    signal.signal(signal.SIGTERM, note)
    signal.signal(signal.SIGINT, note)
    sys.exit(0 if worker.wait() == 0 else 5)
    """
)


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    ("sig", "torchrun_got", "worker_got", "code"),
    [
        (signal.SIGTERM, "SIGTERM", "", 7),
        (signal.SIGINT, "SIGINT", "", 7),
        (signal.SIGUSR1, "", "SIGUSR1", 0),  # torchrun never sees it (it would end torchrun itself)
    ],
)
def test_signals_reach_torchrun_or_its_workers_and_the_code_comes_back(
    tmp_path: Path,
    sig: int,
    torchrun_got: str,
    worker_got: str,
    code: int,
    capsys: pytest.CaptureFixture[str],
) -> None:
    script = tmp_path / "fake_torchrun.py"
    script.write_text(_FAKE_TORCHRUN)
    log = str(tmp_path / "log")
    # What the test process had before (SIG_IGN for SIGINT when started in the background by a shell).
    before = signal.getsignal(sig)

    def send_when_ready() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (
            os.path.exists(log + ".ready") and signal.getsignal(sig) != before
        ):  # the worker runs and the launcher's handler is in place
            time.sleep(0.02)
        os.kill(os.getpid(), sig)  # to the launcher: the test process runs it

    import threading

    threading.Thread(target=send_when_ready, daemon=True).start()
    assert run_forwarding_signals([sys.executable, str(script), log]) == code
    read = lambda name: Path(f"{log}.{name}").read_text().strip() if Path(f"{log}.{name}").exists() else ""  # noqa: E731
    assert (read("torchrun"), read("worker")) == (torchrun_got, worker_got)
    assert signal.getsignal(sig) == before  # handlers restored
    where = "its workers" if worker_got else "torchrun"
    name = signal.Signals(sig).name
    assert capsys.readouterr().err.endswith(
        f"finetune: {name} passed on to {where}; the launcher exits with torchrun's code, {code}\n"
    )


def test_a_child_killed_by_a_signal_is_reported_as_a_shell_would() -> None:
    assert run_forwarding_signals([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), 9)"]) == 137


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.timeout(90)
def test_torchrun_stopped_by_a_signal_says_so_in_one_line(tmp_path: Path) -> None:
    """The launcher's torchrun (`pp_offload.recipe.agent`): SIGTERM stops its worker and the agent exits 143
    with one line, not the ``SignalException`` traceback torchrun itself prints."""
    worker = tmp_path / "worker.py"
    worker.write_text("import pathlib, sys, time\npathlib.Path(sys.argv[1]).touch()\ntime.sleep(60)\n")
    ready = tmp_path / "ready"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "pp_offload.recipe.agent", "--standalone", "--nproc-per-node", "1"]
    proc = subprocess.Popen(
        [*command, str(worker), str(ready)],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert ready.exists(), "the worker never started"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGTERM
    assert "Traceback" not in err and "SignalException" not in err
    said = "torchrun: stopped by SIGTERM; its workers were given time to write their checkpoint (exit 143)"
    assert said in err


def test_node_options_reach_torchrun() -> None:
    one = torchrun_command(_args("--nproc-per-node", "2"), ["--config", "c.yaml"])
    assert one[1:] == ["-m", "pp_offload.recipe.agent", "--standalone", "--nproc-per-node", "2", "-m"] + [
        "pp_offload.recipe",
        "--config",
        "c.yaml",
    ]
    c10d = torchrun_command(
        _args("--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "node0:29400", "--rdzv-id", "j"),
        [],
    )
    assert "--standalone" not in c10d
    assert c10d[3:11] == [
        "--nnodes",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "node0:29400",
        "--rdzv-id",
        "j",
    ]
    static = torchrun_command(
        _args("--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "--master-port", "29500"), []
    )
    assert static[3:11] == [
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--master-addr",
        "10.0.0.1",
        "--master-port",
        "29500",
    ]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nnodes", "0"], r"--nnodes must be >= 1, got 0"),
        (
            ["--nnodes", "2", "--node-rank", "2", "--master-addr", "h"],
            r"--node-rank=2 must be in \[0, --nnodes=2\)",
        ),
        (["--nnodes", "2"], r"--nnodes 2 needs a rendezvous every node can reach: --rdzv-backend c10d"),
        (["--nnodes", "2", "--master-addr", "h"], r"--master-addr \(static rendezvous\) needs --node-rank"),
    ],
)
def test_node_options_that_do_not_go_together_are_one_line(argv: list[str], message: str) -> None:
    from pp_offload.recipe import ConfigError

    with pytest.raises(ConfigError, match=message):
        _check_nodes(_args(*argv))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(pid: int) -> list[int]:
    import psutil

    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


@pytest.mark.timeout(240)
def test_two_nodes_on_loopback_and_sigterm_to_one_launcher(tmp_path: Path) -> None:
    """Two ``pp-offload train --nnodes 2`` launchers (one rank each) meet through c10d on 127.0.0.1 and
    train one pipeline of 2 stages (c10d gives global rank 0, which logs, to either node); SIGTERM to
    node 0's launcher after step 2 reaches its torchrun and worker, the step-agreed stop reaches node 1's
    worker, and both write the checkpoint. Then node 1's launcher gets SIGTERM too, as a scheduler signals
    every node: torchrun's agent on a node whose workers ended waits in its exit barrier for the other
    nodes' agents (up to 300 s, torch's default) when the agent it waits for was the one stopped. Every
    launcher, torchrun and worker is gone within 60 s of the first signal; node 0's launcher exits with
    its torchrun's non-zero code (a scheduler sees the interruption)."""
    import psutil

    out = tmp_path / "run"
    config = {
        "model": {
            "config": RECIPE_LLAMA,
            "verify_split": False,
        },
        "data": {"path": "embedded", "seq_len": 32, "max_examples": 64},
        "pipeline": {"schedule": "ScheduleVHalf", "microbatches": 2},
        "train": {
            "steps": 500,
            "global_batch_size": 4,
            "warmup_steps": 1,
            "stall_timeout": 60,
            "timeout_s": 60,
        },
        "output": {"dir": str(out), "report_to": [], "log_every": 1, "export": False, "timeline": False},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": str(REPO)}
    port = _free_port()
    logs = [tmp_path / f"node{r}.log" for r in range(2)]
    launchers = []
    for log in logs:
        command = [sys.executable, "-m", "pp_offload", "train", "--nnodes", "2", "--nproc-per-node", "1"]
        command += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "t"]
        command += ["--config", str(path), "--no-progress"]
        with log.open("w") as f:
            launchers.append(
                subprocess.Popen(command, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=tmp_path)
            )
    try:
        deadline = time.monotonic() + 150
        both = lambda: "".join(log.read_text() for log in logs)  # noqa: E731 (global rank 0 logs, on either node)
        while "step 2/500" not in both():
            assert time.monotonic() < deadline, both()[-3000:]
            assert all(p.poll() is None for p in launchers), both()[-3000:]
            time.sleep(0.1)
        everyone = [p.pid for p in launchers] + [d for p in launchers for d in _descendants(p.pid)]
        assert len(everyone) >= 6, everyone  # 2 launchers, 2 torchruns, 2 workers
        launchers[0].send_signal(signal.SIGTERM)
        sent = time.monotonic()
        while "finetune: stopped by" not in both():  # the stop reached both nodes' workers
            assert time.monotonic() < sent + 60, both()[-3000:]
            time.sleep(0.1)
        if launchers[1].poll() is None:
            launchers[1].send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=max(1, 60 - (time.monotonic() - sent))) for p in launchers]
        gone = psutil.wait_procs(
            [psutil.Process(p) for p in everyone if psutil.pid_exists(p)],
            timeout=max(1, 60 - (time.monotonic() - sent)),
        )
        assert not gone[1], f"still running 60 s after SIGTERM: {gone[1]}"
    finally:
        for p in launchers:
            if p.poll() is None:
                p.kill()
    text = [log.read_text() for log in logs]
    assert codes[0] != 0, (codes, text[0][-3000:], text[1][-3000:])
    # global rank 0 prints it: "SIGTERM" on node 0, "a signal to another rank" when it sits on node 1
    stopped = re.findall(
        r"^finetune: stopped by (?:SIGTERM|a signal to another rank) after step (\d+) of 500",
        text[0] + text[1],
        re.M,
    )
    assert stopped, (text[0][-3000:], text[1][-3000:])
    step = int(stopped[0])
    assert step < 500
    assert (out / "checkpoints" / f"step_{step:08d}" / "meta.json").is_file()
    assert f'"step": {step}' in (out / "checkpoints" / "latest.json").read_text()
