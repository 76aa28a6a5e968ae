"""The README's examples run as written (the quickstart under torchrun with 2 CPU ranks)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def _block(marker: str) -> str:
    blocks = [b for b in _python_blocks() if marker in b]
    assert len(blocks) == 1, f"expected one README python block containing {marker!r}"
    return blocks[0]


def test_orders_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    exec(compile(_block("adaptive_v_order(8, 32"), "README-orders", "exec"), {})
    out = capsys.readouterr().out
    assert re.search(r"bubble \d+\.\d%, peak \d+ chunk units", out), out


def _run_under_torchrun(tmp_path: Path, marker: str, nproc: int) -> str:
    script = tmp_path / "example.py"
    script.write_text(_block(marker))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-port",
        str(_free_port()),
        str(script),
    ]  # port 0 hangs torchrun's rendezvous
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_quickstart_runs_under_torchrun(tmp_path: Path) -> None:
    out = _run_under_torchrun(tmp_path, "torchrun --nproc-per-node 2 quickstart.py", 2)
    assert re.search(r"loss \d+\.\d{4}", out), out


def test_hybrid_fsdp_example_runs_on_four_ranks(tmp_path: Path) -> None:
    out = _run_under_torchrun(tmp_path, "torchrun --nproc-per-node 4 hybrid.py", 4)
    assert re.search(r"loss \d+\.\d{4}, grad norm \d+\.\d{4}", out), out


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_model_split_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    exec(compile(_block("split_model(model, num_stages=4"), "README-split", "exec"), {})
    out = capsys.readouterr().out
    assert "lm_head.weight" in out and re.search(r"loss \d+\.\d{4}", out), out


def test_partial_loading_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    exec(compile(_block("load_split_weights(split, skeleton, where)"), "README-loading", "exec"), {})
    out = capsys.readouterr().out
    match = re.search(r"read (\d+) tensors; (\d+) parameters of other ranks", out)
    assert match and int(match[1]) > 0 and int(match[2]) > 0, out


def test_auto_choice_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    exec(compile(_block("Measurement.uniform(4"), "README-auto", "exec"), {})
    out = capsys.readouterr().out
    assert re.search(r"^auto: Schedule\w+ offload=", out, flags=re.M), out
