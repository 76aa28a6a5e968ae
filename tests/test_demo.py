"""The README's first command: ``python -m pp_offload demo`` trains with six schedules and reports.

Runs the real thing as a subprocess (2 ranks, gloo, CPU), so these tests are the slow ones of the suite
(about half a minute on 2 cores); flag errors are checked in-process and take milliseconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pp_offload.__main__ import main

DEMO_TIMEOUT_S = 150


def _run(*args: str, timeout: float = DEMO_TIMEOUT_S) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", "pp_offload", "demo", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def test_demo_trains_every_schedule_and_matches_the_reference(tmp_path):
    out = tmp_path / "demo"
    proc = _run("--steps", "2", "--ranks", "2", "--out", str(out))
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    summary = json.loads((out / "summary.json").read_text())
    names = [s["schedule"] for s in summary["schedules"]]
    assert names == [
        "ScheduleVMin",
        "ScheduleVHalf",
        "ScheduleVZB",
        "ScheduleVAdaptive(0.75)",
        "ScheduleZBVZeroBubble",
        "ScheduleInterleaved1F1B",
    ]
    assert summary["all_match_reference"]
    for s in summary["schedules"]:
        assert s["matches_reference"], s["schedule"]
        assert len(s["losses"]) == 2
        assert s["losses"] == pytest.approx(summary["reference_losses"], rel=1e-4)
        assert s["losses"][1] < s["losses"][0], f"{s['schedule']}: the loss did not fall"
        assert 0 < s["peak_activation_vs_1f1b"] <= 1.5
        assert s["median_step_ms"] > 0 and 0 <= s["realized_bubble"] < 1
        png = out / os.path.basename(s["timeline_png"])
        assert png.read_bytes().startswith(b"\x89PNG") and png.stat().st_size > 10_000
    adaptive = next(s for s in summary["schedules"] if s["schedule"] == "ScheduleVAdaptive(0.75)")
    assert adaptive["peak_activation_vs_1f1b"] <= 0.75
    assert "loss by step" in proc.stdout and "real bubble" in proc.stdout


def test_a_failing_rank_stops_the_job_with_its_error(tmp_path):
    proc = _run("--steps", "1", "--no-plots", "--out", str(tmp_path), "--fail-rank", "1", timeout=90)
    assert proc.returncode != 0
    assert "rank 1 failed" in proc.stderr and "fails on purpose" in proc.stderr, proc.stderr
    assert not (tmp_path / "summary.json").exists()


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--ranks", "1"], "--ranks"),
        (["--ranks", "two"], "--ranks"),
        (["--microbatches", "0"], "--microbatches"),
        (["--steps", "0"], "--steps"),
        (["--timeout", "-5"], "--timeout"),
    ],
)
def test_bad_flags_exit_nonzero_naming_the_flag(args, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["demo", *args])
    assert exc.value.code != 0
    assert f"argument {flag}" in capsys.readouterr().err


def test_no_command_prints_help_and_fails(capsys):
    assert main([]) == 2
    assert "demo" in capsys.readouterr().err


def test_bad_flag_through_the_command_line():
    proc = subprocess.run(
        [sys.executable, "-m", "pp_offload", "demo", "--ranks", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "--ranks" in proc.stderr and "Traceback" not in proc.stderr
