"""What rank 0 records of a run: a row per step and per evaluation (``metrics.csv``, ``eval.csv``,
TensorBoard), and the device's memory peak each row carries.

Why rewrite on resume: the steps after the checkpoint a run resumes from are trained again, so their first
rows are dropped and the files read as one uninterrupted run.
"""

from __future__ import annotations

import csv
import resource
import sys
from pathlib import Path

import torch

from pp_offload.models.evaluate import EvalResult
from pp_offload.recipe.config import ConfigError, RecipeConfig

__all__ = ["STEP_COLUMNS", "RunMetrics", "device_peak_mib"]

#: The values of a step's row, after its step number.
STEP_COLUMNS = ("loss", "grad_norm", "lr", "tokens_per_s", "device_peak_mib")


class RunMetrics:
    """``output.metrics``' writers: CSV and (if installed) TensorBoard, under the run's directory."""

    def __init__(self, config: RecipeConfig, out: Path, resumed: bool, start: int = 0) -> None:
        self.csv_file = None
        if resumed:  # rows of steps after the checkpoint were trained again: drop the first copies
            for name in ("metrics.csv", "eval.csv"):
                _keep_rows_up_to(out / name, start)
        self.eval_csv = None
        self.tensorboard = None
        if "csv" in config.output.metrics and config.data.has_eval:
            path = out / "eval.csv"
            new = not (resumed and path.exists())
            self.eval_csv = path.open("w" if new else "a", newline="")
            self.eval_writer = csv.writer(self.eval_csv)
            if new:
                self.eval_writer.writerow(["step", "loss", "perplexity", "tokens"])
        if "csv" in config.output.metrics:
            path = out / "metrics.csv"
            new = not (resumed and path.exists())
            self.csv_file = path.open("w" if new else "a", newline="")
            self.writer = csv.writer(self.csv_file)
            if new:
                self.writer.writerow(["step", *STEP_COLUMNS])
        if "tensorboard" in config.output.metrics:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as error:
                raise ConfigError(
                    "output.metrics includes tensorboard but the tensorboard package is not installed: "
                    "pip install tensorboard, or use output.metrics=[csv]"
                ) from error
            self.tensorboard = SummaryWriter(str(out / "tensorboard"))

    def log(self, step: int, values: dict[str, float]) -> None:
        """One row per step (a skipped step's row holds its non-finite loss or norm)."""
        if self.csv_file is not None:
            self.writer.writerow([step, *(f"{values[k]:.6g}" for k in STEP_COLUMNS)])
            self.csv_file.flush()
        if self.tensorboard is not None:
            for key, value in values.items():
                self.tensorboard.add_scalar(f"train/{key}", value, step)

    def log_eval(self, step: int, outcome: EvalResult) -> None:
        if self.eval_csv is not None:
            self.eval_writer.writerow(
                [step, f"{outcome.loss:.6g}", f"{outcome.perplexity:.6g}", outcome.tokens]
            )
            self.eval_csv.flush()
        if self.tensorboard is not None:
            self.tensorboard.add_scalar("eval/loss", outcome.loss, step)
            self.tensorboard.add_scalar("eval/perplexity", outcome.perplexity, step)

    def close(self) -> None:
        if self.eval_csv is not None:
            self.eval_csv.close()
        if self.csv_file is not None:
            self.csv_file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()


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
