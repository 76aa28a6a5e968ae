"""``output.report_to``: each tracker records the loss curve that ``metrics.csv`` holds, offline (Weights &
Biases in its offline mode, MLflow on a file store, Trackio in a local directory). A tracker whose package
is not installed is skipped here and refused before a run starts (one line naming the extra to install).

The run is one process started by `run_on_ranks` (world size 1: the single-process recipe), so each
tracker is imported fresh under this module's environment (Trackio reads its directory at import).
"""

from __future__ import annotations

import csv
import importlib.util
import json
import struct
from pathlib import Path
from typing import Any

import pytest
from _dist import run_on_ranks
from _tiny_hf import RECIPE_LLAMA

from pp_offload.recipe import ConfigError, RecipeConfig

pytestmark = pytest.mark.usefixtures("quiet_datasets")

TRACKERS = ("wandb", "mlflow", "trackio")
INSTALLED = [t for t in TRACKERS if importlib.util.find_spec(t) is not None]
PROJECT = "pp-offload-test"
STEPS = 4


def _config(out: Path) -> dict[str, Any]:
    return {
        "model": {"config": RECIPE_LLAMA},
        "data": {"path": "embedded", "seq_len": 32, "max_examples": 100},
        "pipeline": {"microbatches": 2},
        "train": {"steps": STEPS, "global_batch_size": 4, "warmup_steps": 1},
        "output": {"dir": str(out), "report_to": ["csv", *INSTALLED], "export": False, "log_every": 0},
    }


def _train(rank: int, world: int, config: dict[str, Any], cache: str) -> list[float]:
    from pp_offload.recipe.train import run

    return run(RecipeConfig.from_dict(config), cache_dir=cache, progress=False).losses


def _trackio_losses(rank: int, world: int) -> list[tuple[int, float]]:
    from trackio.sqlite_storage import SQLiteStorage

    (name,) = SQLiteStorage.get_runs(PROJECT)
    return [(row["step"], row["train/loss"]) for row in SQLiteStorage.get_logs(PROJECT, name)]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One run reporting to csv and every installed tracker; what each recorded."""
    if not INSTALLED:
        pytest.skip("none of wandb, mlflow, trackio is installed")
    root = tmp_path_factory.mktemp("report_to")
    out = root / "run"
    env = {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_PROJECT": PROJECT,
        "MLFLOW_TRACKING_URI": (root / "mlruns").as_uri(),
        "MLFLOW_ALLOW_FILE_STORE": "true",  # MLflow 3 asks for it; a file store needs no server
        "MLFLOW_EXPERIMENT_NAME": PROJECT,
        "TRACKIO_DIR": str(root / "trackio"),
        "TRACKIO_PROJECT": PROJECT,
    }
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        losses = run_on_ranks(_train, 1, _config(out), str(root / "cache"), timeout=300)[0]
        trackio = run_on_ranks(_trackio_losses, 1, timeout=120)[0] if "trackio" in INSTALLED else None
    with (out / "metrics.csv").open() as f:
        rows = [(int(r["step"]), float(r["loss"])) for r in csv.DictReader(f)]
    return {"out": out, "root": root, "losses": losses, "csv": rows, "trackio": trackio}


def _same_curve(recorded: list[tuple[int, float]], csv_rows: list[tuple[int, float]]) -> None:
    """The tracker's (step, loss) pairs are metrics.csv's (which keeps 6 significant digits)."""
    assert [s for s, _ in recorded] == [s for s, _ in csv_rows] == list(range(1, STEPS + 1))
    for (_, got), (_, want) in zip(recorded, csv_rows, strict=True):
        assert got == pytest.approx(want, rel=1e-5)


def _wandb_history(run_file: Path) -> list[dict[str, str]]:
    """The history rows of an offline W&B run file (its records are wandb's own protobuf ``Record``, in
    the LevelDB log format: 32 KiB blocks of chunks with a 7-byte header: CRC, length, kind)."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    block, pos, pending, rows = 32768, 7, b"", []  # after the file's 7-byte header
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        payload, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        pending = payload if kind in (1, 2) else pending + payload
        if kind in (1, 4):  # a whole record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            if record.HasField("history"):
                rows.append(
                    {item.key or "/".join(item.nested_key): item.value_json for item in record.history.item}
                )
    return rows


def test_wandb_offline_records_the_csv_loss_curve(run: dict[str, Any]) -> None:
    pytest.importorskip("wandb")
    (run_file,) = (run["out"] / "wandb").glob("offline-run-*/run-*.wandb")
    history = [row for row in _wandb_history(run_file) if "train/loss" in row]
    _same_curve([(int(r["_step"]), json.loads(r["train/loss"])) for r in history], run["csv"])


def test_mlflow_file_store_records_the_csv_loss_curve(
    run: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")

    client = MlflowClient((run["root"] / "mlruns").as_uri())
    experiment = client.get_experiment_by_name(PROJECT)
    (found,) = client.search_runs([experiment.experiment_id])
    history = sorted(client.get_metric_history(found.info.run_id, "train/loss"), key=lambda m: m.step)
    _same_curve([(m.step, m.value) for m in history], run["csv"])
    assert found.data.params["train.steps"] == str(STEPS)  # the config, flattened


def test_trackio_records_the_csv_loss_curve(run: dict[str, Any]) -> None:
    pytest.importorskip("trackio")
    _same_curve(run["trackio"], run["csv"])


def test_csv_holds_the_runs_losses(run: dict[str, Any]) -> None:
    assert [loss for _, loss in run["csv"]] == pytest.approx(run["losses"], rel=1e-5)


def test_a_tracker_that_is_not_installed_is_refused_before_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    from pp_offload.recipe import metrics

    monkeypatch.setattr(metrics.importlib.util, "find_spec", lambda name: None)
    config = RecipeConfig.from_dict({"model": {"config": RECIPE_LLAMA}, "output": {"report_to": ["mlflow"]}})
    with pytest.raises(ConfigError, match=r"includes mlflow but the mlflow package is not installed: pip "):
        metrics.check_report_targets(config)
