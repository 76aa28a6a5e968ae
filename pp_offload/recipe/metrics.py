"""What rank 0 reports of a run (``output.report_to``): a row per step and per evaluation, to CSV
(``metrics.csv``, ``eval.csv``), TensorBoard, Weights & Biases, MLflow or Trackio; and the device's memory
peak each row carries.

Why Trainer's targets: a Hugging Face user's dashboards are there already (``TrainingArguments.report_to``).
Every target gets the same values under the same names (``train/loss``, ``train/grad_norm``, ``train/lr``,
``train/tokens_per_s``, ``train/device_peak_mib``, ``eval/loss``, ``eval/perplexity``) at the same step.

Why rewrite on resume: the steps after the checkpoint a run resumes from are trained again, so their first
rows are dropped from the CSV files, which read as one uninterrupted run; the trackers start a new run of
their own at each launch.
"""

from __future__ import annotations

import csv
import importlib.util
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

from pp_offload.models.evaluate import EvalResult
from pp_offload.recipe.config import ConfigError, RecipeConfig

__all__ = ["REPORT_PACKAGES", "STEP_COLUMNS", "RunMetrics", "check_report_targets", "device_peak_mib"]

#: The values of a step's row, after its step number.
STEP_COLUMNS = ("loss", "grad_norm", "lr", "tokens_per_s", "device_peak_mib")
#: The package each ``output.report_to`` target needs (csv needs none), and the extra that installs it.
REPORT_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "trackio": "trackio"}
#: The project a tracker files the run under when its environment variable names none.
PROJECT = "pp-offload"


def check_report_targets(config: RecipeConfig) -> None:
    """Every ``output.report_to`` target's package is installed (looked up, not imported)."""
    for target in config.output.report_to:
        package = REPORT_PACKAGES.get(target)
        if package is not None and importlib.util.find_spec(package) is None:
            raise ConfigError(
                f"output.report_to includes {target} but the {package} package is not installed: pip "
                f"install 'pp-offload[{target}]' (or {package}), or leave {target} out of output.report_to"
            )


class RunMetrics:
    """``output.report_to``'s writers, opened under the run's directory ``out``."""

    def __init__(self, config: RecipeConfig, out: Path, resumed: bool, start: int = 0) -> None:
        """``config``: checked by `pp_offload.recipe.preflight.preflight` (every target's package)."""
        self.writers: list[Any] = []
        for target in dict.fromkeys(config.output.report_to):  # in order, once each
            if target == "csv":
                self.writers.append(_Csv(out, resumed, start, evals=config.data.has_eval))
            else:
                self.writers.append(_TRACKERS[target](config, out))

    def log(self, step: int, values: dict[str, float]) -> None:
        """One row per step (a skipped step's row holds its non-finite loss or norm)."""
        for writer in self.writers:
            writer.log(step, values)

    def log_eval(self, step: int, outcome: EvalResult) -> None:
        for writer in self.writers:
            writer.log_eval(step, outcome)

    def close(self) -> None:
        for writer in self.writers:
            writer.close()


class _Csv:
    def __init__(self, out: Path, resumed: bool, start: int, *, evals: bool) -> None:
        if resumed:  # rows of steps after the checkpoint were trained again: drop the first copies
            for name in ("metrics.csv", "eval.csv"):
                _keep_rows_up_to(out / name, start)
        self.file, self.writer = _open_csv(out / "metrics.csv", resumed, ["step", *STEP_COLUMNS])
        self.eval_file = self.eval_writer = None
        if evals:
            self.eval_file, self.eval_writer = _open_csv(
                out / "eval.csv", resumed, ["step", "loss", "perplexity", "tokens"]
            )

    def log(self, step: int, values: dict[str, float]) -> None:
        self.writer.writerow([step, *(f"{values[k]:.6g}" for k in STEP_COLUMNS)])
        self.file.flush()

    def log_eval(self, step: int, outcome: EvalResult) -> None:
        if self.eval_writer is not None:
            row = [step, f"{outcome.loss:.6g}", f"{outcome.perplexity:.6g}", outcome.tokens]
            self.eval_writer.writerow(row)
            self.eval_file.flush()

    def close(self) -> None:
        self.file.close()
        if self.eval_file is not None:
            self.eval_file.close()


def _open_csv(path: Path, resumed: bool, header: list[str]) -> tuple[Any, Any]:
    new = not (resumed and path.exists())
    file = path.open("w" if new else "a", newline="")
    writer = csv.writer(file)
    if new:
        writer.writerow(header)
    return file, writer


class _Tracker:
    """A tracker logs a mapping of named values at a step; the names are the same for every tracker."""

    def log(self, step: int, values: dict[str, float]) -> None:
        self.send({f"train/{key}": float(value) for key, value in values.items()}, step)

    def log_eval(self, step: int, outcome: EvalResult) -> None:
        self.send({"eval/loss": outcome.loss, "eval/perplexity": outcome.perplexity}, step)

    def send(self, values: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class _TensorBoard(_Tracker):
    def __init__(self, config: RecipeConfig, out: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(out / "tensorboard"))

    def send(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class _WandB(_Tracker):
    """A Weights & Biases run in ``$WANDB_PROJECT`` (else `PROJECT`), its files under the run's directory,
    the recipe config as its config. ``WANDB_MODE=offline`` keeps it on disk (``wandb sync`` uploads it)."""

    def __init__(self, config: RecipeConfig, out: Path) -> None:
        import wandb

        project = os.environ.get("WANDB_PROJECT", PROJECT)
        self.run = wandb.init(project=project, dir=str(out), config=config.to_dict())

    def send(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class _MLflow(_Tracker):
    """An MLflow run where ``$MLFLOW_TRACKING_URI`` and ``$MLFLOW_EXPERIMENT_NAME`` say (MLflow reads them),
    with the recipe config's keys as its parameters."""

    def __init__(self, config: RecipeConfig, out: Path) -> None:
        import mlflow

        self.mlflow = mlflow
        self.run = mlflow.start_run(run_name=out.name)
        params = _flat(config.to_dict())
        self.client = mlflow.tracking.MlflowClient()
        self.client.log_batch(
            self.run.info.run_id,
            params=[mlflow.entities.Param(k, str(v)[:6000]) for k, v in params.items()],
        )

    def send(self, values: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        metrics = [self.mlflow.entities.Metric(k, v, now, step) for k, v in values.items()]
        self.client.log_batch(self.run.info.run_id, metrics=metrics)

    def close(self) -> None:
        self.mlflow.end_run()


class _Trackio(_Tracker):
    """A Trackio run in ``$TRACKIO_PROJECT`` (else `PROJECT`; stored locally, or in ``$TRACKIO_SPACE_ID``'s
    Space), with the recipe config as its config."""

    def __init__(self, config: RecipeConfig, out: Path) -> None:
        import trackio

        self.trackio = trackio
        self.run = trackio.init(
            project=os.environ.get("TRACKIO_PROJECT", PROJECT),
            space_id=os.environ.get("TRACKIO_SPACE_ID"),
            config=config.to_dict(),
        )

    def send(self, values: dict[str, float], step: int) -> None:
        self.trackio.log(values, step=step)

    def close(self) -> None:
        self.trackio.finish()


_TRACKERS = {"tensorboard": _TensorBoard, "wandb": _WandB, "mlflow": _MLflow, "trackio": _Trackio}


def _flat(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings as ``section.key`` pairs (MLflow's parameters are flat)."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict) and value:
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _keep_rows_up_to(path: Path, step: int) -> None:
    """Rewrite the metrics CSV ``path`` keeping its header and the rows of steps <= ``step``."""
    if not path.is_file():
        return
    with path.open(newline="") as f:
        rows = list(csv.reader(f))
    kept = rows[:1] + [r for r in rows[1:] if r and r[0].isdigit() and int(r[0]) <= step]
    if len(kept) != len(rows):
        with path.open("w", newline="") as f:
            csv.writer(f).writerows(kept)


def device_peak_mib(device: torch.device) -> float:
    """The device peak (docs/planner.md, *Two peaks*): CUDA's allocated high-water mark, or on CPU the
    process's largest resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**20 if sys.platform == "darwin" else 2**10)
