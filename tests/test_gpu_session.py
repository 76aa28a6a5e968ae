"""The one-call GPU session (`bash bench/gpu_session.sh quick`), rehearsed on the CPU.

Why: a task is lent a GPU by chance, with 15 minutes of device time in all; a typo in the script, a
configuration string the planner or runtime refuses, or a result file without its `meta` found there costs
the session. ``GPU_SESSION_CPU=1`` runs the same script, the same parts in the same order with the same
command lines, on a tiny model on the CPU: every configuration is parsed and checked, two run, the
CUDA-only parts are recorded as skipped. The sync check's failure path (which needs CUDA to happen) is
driven here with a step that raises what torch's sync debug mode raises.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu_session.sh"

# issue 24's list: what the quick session measures at seq 4096 (schedule, offload, recompute)
ISSUE_CONFIGS = {
    ("ScheduleVHalf", "none", "none"),
    ("ScheduleVHalf", "full", "none"),
    ("ScheduleVHalf", "budget:auto:0.1", "none"),
    ("ScheduleVHalf", "budget:sublayer", "mlp"),
    ("ScheduleVZB", "none", "none"),
    ("ScheduleVZB", "budget:sublayer", "mlp"),
    ("Interleaved1F1B", "none", "none"),
    ("Interleaved1F1B", "budget:auto:0.1", "none"),
    ("ScheduleZBVZeroBubble", "none", "none"),
    ("ScheduleZBVZeroBubble", "budget:auto:0.1", "none"),
    ("ScheduleDualPipeV", "none", "none"),
    ("ScheduleDualPipeV", "budget:auto:0.1", "none"),
    ("ScheduleVHalf", "none", "full"),
    ("ScheduleVHalf", "none", "selective"),
    ("ScheduleVHalf", "none", "selective+once"),
    ("ScheduleVHalf", "none", "full+once"),
}

# issue 30's compiled rows, most important first (the first one runs in the CPU rehearsal)
COMPILED_CONFIGS = [
    ("ScheduleVHalf", "none", "none"),
    ("Interleaved1F1B", "none", "none"),
    ("ScheduleVZB", "none", "none"),
    ("ScheduleVHalf", "budget:auto:0.1", "none"),
    ("Interleaved1F1B", "budget:auto:0.1", "none"),
    ("ScheduleVZB", "budget:auto:0.1", "none"),
]
PARTS = ["nvidia-smi", "env", "store", "sync-check", "replay", "replay-compiled"]


def _session(part: str, out: Path, **extra: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "GPU_SESSION_CPU": "1",
        "PYTHON": sys.executable,
        "OMP_NUM_THREADS": "1",
        "PP_OFFLOAD_COMMIT": "rehearsal-commit",
        **extra,
    }
    env.pop("PYTHONPATH", None)  # the script sets its own: the worktree's code, as on the device
    return subprocess.run(
        ["bash", str(SCRIPT), part, str(out)], env=env, capture_output=True, text=True, timeout=240
    )


def _configs(records: list[dict]) -> list[tuple[str, str, str]]:
    return [(r["config"]["schedule"], r["config"]["offload"], r["config"]["recompute"]) for r in records]


def _check_meta(meta: dict, *, mode: str, rank: int) -> None:
    assert meta["git_commit"] and meta["torch"] == torch.__version__ and meta["device"]
    assert meta["mode"] == mode and meta["rank"] == rank and meta["model"] == "tiny"


def test_quick_session_rehearsed_on_cpu(tmp_path: Path) -> None:
    proc = _session("quick", tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    summary = json.loads((tmp_path / "quick.json").read_text())
    assert summary["meta"]["cpu_rehearsal"] is True
    assert summary["meta"]["torch"] == torch.__version__ and summary["meta"]["device"]
    assert summary["env"]["git_commit"] == "rehearsal-commit"
    parts = {p["part"]: p for p in summary["parts"]}
    assert list(parts) == PARTS
    assert parts["store"]["status"] == parts["nvidia-smi"]["status"] == "skipped: no CUDA"
    for name in ("env", "sync-check", "replay", "replay-compiled"):
        assert parts[name]["status"] == "ok" and 0 < parts[name]["limit_s"] <= 450, parts[name]
    # the compiled part's limit is what is left of the session's 450 s (an 8-minute call with room to
    # spare); the eager replay's leaves it its 150 s
    before = sum(p["seconds"] for p in summary["parts"][:-2])
    assert 400 - 150 <= before + parts["replay"]["limit_s"] <= 450 - 15 - 150 + len(PARTS)
    before += parts["replay"]["seconds"]
    assert 400 <= before + parts["replay-compiled"]["limit_s"] <= 450 - 15 + len(PARTS)
    assert "--sync-check" in parts["sync-check"]["command"]
    assert "--rank 0" in parts["replay"]["command"] and "--budget-s" in parts["replay"]["command"]
    assert "--compile" not in parts["replay"]["command"]

    sync = json.loads((tmp_path / "quick_sync.json").read_text())
    _check_meta(sync["meta"], mode="sync_check", rank=0)
    ran = [r for r in sync["records"] if "sync_check" in r]
    assert [r["sync_check"]["status"] for r in ran] == ["skipped", "skipped"]
    assert all("no CUDA" in r["sync_check"]["reason"] for r in ran)
    assert ("ScheduleVHalf", "full", "none") in _configs(ran)
    assert len(sync["records"]) == 3
    assert all(r["skipped"].startswith("skipped: --limit") for r in sync["records"][2:])
    assert summary["results"]["quick_sync.json"]["done"] == 2

    replay = json.loads((tmp_path / "quick_replay.json").read_text())
    _check_meta(replay["meta"], mode="replay", rank=0)
    assert replay["meta"]["seq"] == 16 and "--configs" in replay["meta"]["argv"]
    configs = _configs(replay["records"])
    assert set(configs) == ISSUE_CONFIGS and len(configs) == len(ISSUE_CONFIGS)
    # the most important first: V-Half without and with whole-chunk offload
    assert configs[:2] == [("ScheduleVHalf", "none", "none"), ("ScheduleVHalf", "full", "none")]
    plain, full = replay["records"][:2]
    for record in (plain, full):
        assert record["paced_step_s"] > 0 and record["wall_s"] > 0 and record["outputs_kept"] is False
    assert full["offloaded_chunks"] > 0
    assert all("skipped" in r for r in replay["records"][2:])
    assert (tmp_path / "quick_replay.png").stat().st_size > 0
    assert "== replay: ok" in (tmp_path / "quick.log").read_text()

    compiled = json.loads((tmp_path / "quick_compiled.json").read_text())
    _check_meta(compiled["meta"], mode="replay", rank=0)
    assert compiled["meta"]["compile"] == {"backend": "aot_eager"}
    # the eager replay's calibration: the compiled rows are priced with the same costs
    assert compiled["meta"]["calibration_from"].endswith("quick_replay.json")
    assert compiled["meta"]["calibrated_mfu"] == replay["meta"]["calibrated_mfu"]
    assert _configs(compiled["records"]) == COMPILED_CONFIGS
    first = compiled["records"][0]
    assert first["compiled"] is True and first["paced_step_s"] > 0 and first["outputs_kept"] is False
    assert first["compile"]["graphs"] > 0 and first["compile"]["graphs_after_first_step"] == 0
    assert all(r["skipped"].startswith("skipped: --limit") for r in compiled["records"][1:])
    assert summary["results"]["quick_compiled.json"]["done"] == 1
    assert "compiled / eager" in (tmp_path / "quick.log").read_text()
    # at most 8 files come back from a device call
    assert len([p for p in tmp_path.iterdir() if p.is_file()]) <= 8


def test_quick_session_dry_run_checks_the_cuda_command_lines(tmp_path: Path) -> None:
    """Without the CPU switch (the device's command lines): the bench's arguments and configurations are
    checked (``--check-only``), the CUDA-only commands recorded, not run."""
    proc = _session("quick", tmp_path, GPU_SESSION_CPU="0", GPU_SESSION_DRY="1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    parts = {p["part"]: p for p in json.loads((tmp_path / "quick.json").read_text())["parts"]}
    assert list(parts) == PARTS
    assert [parts[n]["status"] for n in ("nvidia-smi", "env", "store")] == ["dry-run"] * 3
    assert "tests/test_store.py tests/test_queue_offload.py -k cuda" in parts["store"]["command"]
    for name in ("sync-check", "replay", "replay-compiled"):
        assert parts[name]["status"] == "ok"
        assert "--seq 4096 --microbatches 8 --pp 4 --steps 3" in parts[name]["command"]
        assert "--tiny" not in parts[name]["command"] and "--limit" not in parts[name]["command"]
    assert "--compile " in parts["replay-compiled"]["command"]
    assert "--compile-backend" not in parts["replay-compiled"]["command"]  # inductor on the GPU
    assert "16 configuration(s) checked" in proc.stdout and "6 configuration(s) checked" in proc.stdout


def test_quick_last_runs_the_rank_with_the_lm_head(tmp_path: Path) -> None:
    """`quick-last`: the last rank; with Interleaved1F1B (loop placement) it holds the LM head and loss."""
    proc = _session("quick-last", tmp_path, GPU_SESSION_CPU_CONFIGS="1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    replay = json.loads((tmp_path / "quick_last_replay.json").read_text())
    _check_meta(replay["meta"], mode="replay", rank=1)
    first = replay["records"][0]
    assert first["config"]["schedule"] == "Interleaved1F1B" and first["paced_step_s"] > 0
    assert first["stages"] == [1, 3] and first["num_stages"] == 4  # stage 3: the LM head and loss
    parts = [p["part"] for p in json.loads((tmp_path / "quick_last.json").read_text())["parts"]]
    assert parts == ["replay"]


def test_a_bad_configuration_is_refused_before_anything_runs(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable, str(ROOT / "bench" / "bench_gpu_replay.py"), "--tiny", "--device", "cpu",
        "--out", str(tmp_path), "--configs", "ScheduleVHalf/none/none", "ScheduleVHalf/budget:autoo/none",
        "ScheduleVHaf/none/none", "ScheduleVHalf/none/selectve+once",
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    for bad in ("budget:autoo", "ScheduleVHaf", "selectve+once"):
        assert bad in proc.stderr
    assert "ScheduleVHalf/none/none'" not in proc.stderr
    assert not list(tmp_path.iterdir())  # refused before measuring or writing


def _measure(monkeypatch: pytest.MonkeyPatch):
    """The replay's `gpu_replay.measure` module, imported as ``bench/bench_gpu_replay.py`` imports it."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    return importlib.import_module("gpu_replay.measure")


def _offending_call() -> None:
    raise RuntimeError("called a synchronizing CUDA operation")


@pytest.mark.parametrize(
    ("step", "status"),
    [(lambda: None, "passed"), (_offending_call, "failed"), (lambda: 1 / 0, "error")],
    ids=["passed", "failed", "error"],
)
def test_sync_check_names_the_offending_call(monkeypatch: pytest.MonkeyPatch, step, status: str) -> None:
    """The CUDA branch of `sync_check` with torch's debug-mode switch recorded: the mode is always reset,
    a sync error is "failed" with the call site, any other exception "error"."""
    bench = _measure(monkeypatch)
    modes: list[str] = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    monkeypatch.setattr(bench, "synchronize", lambda device: None)
    monkeypatch.setattr(bench, "free", lambda device: None)
    schedule = SimpleNamespace(step=lambda *a, **k: step())
    result = bench.sync_check(schedule, (), {}, torch.device("cuda", 0))
    assert result["status"] == status
    assert modes[0] == "error" and modes[-1] == "default"
    if status == "failed":
        assert "synchronizing CUDA operation" in result["error"]
        assert result["where"].startswith("test_gpu_session.py:") and "_offending_call" in result["where"]


def test_a_spent_time_budget_skips_the_rest_and_keeps_meta(tmp_path: Path) -> None:
    """``--budget-s``: past the budget no configuration starts; each is recorded as skipped, with meta."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PP_OFFLOAD_ORDER_CACHE": "off"}
    cmd = [
        sys.executable, str(ROOT / "bench" / "bench_gpu_replay.py"), "--tiny", "--device", "cpu", "--dtype",
        "fp32", "--seq", "16", "--microbatches", "4", "--pp", "2", "--steps", "1", "--sync-check",
        "--budget-s", "0", "--out", str(tmp_path), "--name", "spent", "--configs", "ScheduleVHalf/none/none",
        "ScheduleVZB/none/none",
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads((tmp_path / "spent.json").read_text())
    assert data["meta"]["mode"] == "sync_check" and data["meta"]["git_commit"]
    assert [r["skipped"].startswith("skipped: time budget") for r in data["records"]] == [True, True]
