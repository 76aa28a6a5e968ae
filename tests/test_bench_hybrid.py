"""Smoke test of bench/bench_hybrid.py: one schedule, both layouts (pp 4; pp 2 x dp 2 with FSDP2), tiny
sizes, on 4 gloo processes. The two layouts compute the same function (the bench checks losses and
gradients and exits 1 otherwise), and the measured activation peaks are the simulator's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bench_hybrid_smoke(tmp_path: Path) -> None:
    cmd = [
        sys.executable, str(ROOT / "bench" / "bench_hybrid.py"), "--no-progress", "--out", str(tmp_path),
        "--schedules", "ScheduleVHalf", "--layers", "8", "--microbatches", "4", "--layer-costs", "0.5:1:0.5",
        "--warmup", "1", "--steps", "1", "--rounds", "1", "--hidden", "8",
    ]  # fmt: skip
    done = subprocess.run(
        cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    doc = json.loads((tmp_path / "hybrid.json").read_text())
    assert doc["meta"]["losses_and_grads_agree"]
    records = {r["config"]: r for r in doc["emulated"]}
    assert set(records) == {"pp4", "pp2xdp2"}
    for r in records.values():
        assert r["peak_mib"] > 0 and r["leftover_mib"] == 0
        assert abs(r["peak_mib"] - r["sim_peak_mib"]) < 1e-6, r
    assert records["pp2xdp2"]["grad_max_rel_diff_vs_ref"] < 1e-4
    assert (tmp_path / "hybrid.png").exists()
