"""What the GPU session found, kept from coming back on machines without a GPU (bench/results/gpu/README.md).

- torch 2.11's first-step warm-up sends to a neighbour stage on the same rank; gloo cannot (no link to
  itself): `compat.skip_self_p2p_warmup` drops exactly those ops.
- ``train.device``: ranks cannot share a GPU, and a gloo group carries no CUDA tensors: clear errors, and
  ``auto`` falls back to the CPU under gloo.
- The single-rank replay bench runs end to end (on CPU, tiny model), so CI keeps the GPU script working.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from pp_offload.recipe.config import ConfigError, RecipeConfig
from pp_offload.recipe.topology import Topology, device_for
from pp_offload.runtime import compat

ROOT = Path(__file__).resolve().parent.parent


class _Stage:
    def __init__(self, group_rank: int, peers: list[int]) -> None:
        self.group_rank = group_rank
        self._peers = peers
        self.calls = 0

    def _get_init_p2p_neighbors_ops(self) -> list:
        self.calls += 1
        return [SimpleNamespace(group_peer=p, peer=p) for p in self._peers]


def test_self_p2p_warmup_ops_are_dropped_once_and_others_kept() -> None:
    stage = _Stage(group_rank=1, peers=[0, 1, 1, 0])
    compat.skip_self_p2p_warmup([stage])
    compat.skip_self_p2p_warmup([stage])  # idempotent: not wrapped twice
    ops = stage._get_init_p2p_neighbors_ops()
    assert [op.group_peer for op in ops] == [0, 0]
    assert stage.calls == 1


def test_stages_without_the_warmup_hook_are_left_alone() -> None:
    stage = SimpleNamespace(group_rank=0)
    compat.skip_self_p2p_warmup([stage])  # newer torch: nothing to filter
    assert not hasattr(stage, "_get_init_p2p_neighbors_ops")


def _recipe(device: str) -> RecipeConfig:
    return RecipeConfig.from_dict(
        {
            "model": {"config": {"model_type": "llama"}},
            "data": {"path": "embedded"},
            "train": {"device": device},
        }
    )


def _pretend_cuda(monkeypatch: pytest.MonkeyPatch, *, devices: int, backend: str | None) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: devices)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    monkeypatch.setattr(dist, "is_initialized", lambda: backend is not None)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)


def test_two_ranks_on_one_gpu_are_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    _pretend_cuda(monkeypatch, devices=1, backend=None)
    topo = Topology(rank=1, world=2, local_rank=1, pp=2, dp=1)
    with pytest.raises(
        ConfigError, match=r"local rank 1\) needs its own GPU, cuda:1, but this machine shows 1"
    ):
        device_for(_recipe("cuda"), topo)
    assert device_for(_recipe("cuda"), Topology(rank=0, world=2, local_rank=0, pp=2, dp=1)) == torch.device(
        "cuda", 0
    )


def test_a_gloo_group_keeps_auto_on_the_cpu_and_refuses_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    _pretend_cuda(monkeypatch, devices=2, backend="gloo")
    topo = Topology(rank=0, world=2, local_rank=0, pp=2, dp=1)
    assert device_for(_recipe("auto"), topo) == torch.device("cpu")
    with pytest.raises(ConfigError, match="gloo backend, which cannot send CUDA tensors"):
        device_for(_recipe("cuda"), topo)


def test_replay_bench_runs_one_rank_on_a_fake_group(tmp_path: Path) -> None:
    """The GPU bench's whole path (fake process group, static stage metadata, receive buffers, pacing,
    offload on the runtime, planner predictions, tables, JSON, plot) on a tiny Llama on CPU."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PP_OFFLOAD_ORDER_CACHE": "off"}
    cmd = [
        sys.executable, str(ROOT / "bench" / "bench_gpu_replay.py"), "--tiny", "--device", "cpu", "--dtype",
        "fp32", "--seq", "16", "--microbatches", "4", "--pp", "2", "--steps", "1", "--out", str(tmp_path),
        "--name", "smoke", "--configs", "ScheduleVHalf/none/none", "ScheduleVHalf/budget:0.5/none",
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads((tmp_path / "smoke.json").read_text())
    plain, budget = data["records"]
    assert plain["config"]["offload"] == "none" and "offloaded_chunks" not in plain
    assert budget["offloaded_chunks"] > 0 and budget["moved_layers"] > 0
    for record in (plain, budget):
        assert record["paced_step_s"] > 0 and record["simulated_makespan_s"] > 0
        assert set(record["pass_s"]) >= {"F", "W"}
        assert record["predicted"]["layers_per_stage"] and record["outputs_kept"] is False
    assert budget["simulated_offload"]["makespan_s"] > 0
    assert (tmp_path / "smoke.png").stat().st_size > 0
    assert "paced overhead" in proc.stdout
