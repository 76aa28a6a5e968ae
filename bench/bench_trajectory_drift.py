"""How far a training trajectory drifts when gradients are summed in another order.

The recipe tests compare a pipelined run (microbatch and data-parallel gradients summed in one order) with
one process (summed in another) over several AdamW steps. This benchmark measures the drift such a
difference can cause, so the tests' tolerances rest on a measurement rather than on one machine's luck:
it runs the tests' tiny Llama (tied embedding) and GPT-2 on one process, once as is and several times
with noise of ``eps`` times each gradient's mean magnitude added before every optimizer step (a
pessimistic model of another summation order: fp32 reductions over a few thousand terms differ by a few
ulps of the terms, about 1e-7 of them), and reports the worst relative difference of the loss and the
gradient norm at every step. It then checks the tolerance rule of ``tests/_tolerance.py`` against it.

    python bench/bench_trajectory_drift.py            # about 2 minutes on 2 cores
Writes bench/results/trajectory_drift.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from _tolerance import trajectory_tolerance  # noqa: E402
from test_recipe import GPT2, LLAMA  # noqa: E402

from pp_offload.recipe import RecipeConfig  # noqa: E402
from pp_offload.recipe.train import run  # noqa: E402

MODELS = {"llama (tied)": LLAMA, "gpt2": GPT2}  # the recipe tests' own models


def _config(out: Path, model: dict, steps: int) -> RecipeConfig:
    """The recipe tests' settings (tests/test_recipe.py), on one process."""
    return RecipeConfig.from_dict(
        {
            "model": {"config": model},
            "data": {"path": "embedded", "seq_len": 32, "max_examples": 400},
            "pipeline": {"schedule": "ScheduleVHalf", "microbatches": 4},
            "train": {"steps": steps, "global_batch_size": 8, "lr": 3e-3, "warmup_steps": 2},
            "output": {"dir": str(out), "report_to": ["csv"], "log_every": 0, "export": False},
        }
    )


def _trajectory(model: dict, steps: int, cache: str, eps: float, seed: int) -> tuple[list, list]:
    generator = torch.Generator().manual_seed(seed)

    def perturb(optimizer, args, kwargs):  # noqa: ARG001 (the hook's signature)
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    noise = torch.randn(p.grad.shape, generator=generator)
                    p.grad.add_(eps * p.grad.abs().mean() * noise)

    handle = register_optimizer_step_pre_hook(perturb) if eps > 0 else None
    try:
        with tempfile.TemporaryDirectory() as out:
            result = run(_config(Path(out), model, steps), cache_dir=cache, progress=False)
    finally:
        if handle is not None:
            handle.remove()
    return result.losses, result.grad_norms


def _relative(a: list[float], b: list[float]) -> list[float]:
    return [abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--eps", type=float, nargs="+", default=[1e-7, 1e-6, 1e-5])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "trajectory_drift.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        for name, model in MODELS.items():
            base_losses, base_norms = _trajectory(model, args.steps, cache, 0.0, 0)
            for eps in args.eps:
                loss_drift = [0.0] * args.steps
                norm_drift = [0.0] * args.steps
                for trial in range(args.trials):
                    losses, norms = _trajectory(model, args.steps, cache, eps, 1 + trial)
                    loss_drift = list(map(max, loss_drift, _relative(losses, base_losses)))
                    norm_drift = list(map(max, norm_drift, _relative(norms, base_norms)))
                rows.append({"model": name, "eps": eps, "loss": loss_drift, "grad_norm": norm_drift})

    steps = range(args.steps)
    print(f"worst relative drift over {args.trials} noisy runs vs the unperturbed run, by optimizer step")
    print(f"{'model':<14}{'eps':>8}  {'what':<10}" + "".join(f"{'step ' + str(k):>10}" for k in steps))
    for row in rows:
        for what in ("loss", "grad_norm"):
            cells = "".join(f"{x:>10.1e}" for x in row[what])
            print(f"{row['model']:<14}{row['eps']:>8.0e}  {what:<10}{cells}")
    for what in ("loss", "grad_norm"):
        tol = [trajectory_tolerance(what, k)[0] for k in steps]
        print(f"{'rtol (tests)':<22}  {what:<10}" + "".join(f"{x:>10.1e}" for x in tol))
    realistic = [r for r in rows if r["eps"] <= 1e-6]
    margin = min(
        trajectory_tolerance(what, k)[0] / max(r[what][k], 1e-30)
        for r in realistic
        for what in ("loss", "grad_norm")
        for k in steps
    )
    print(f"smallest margin of the tests' rtol over the drift at eps <= 1e-6: {margin:.1f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"steps": args.steps, "trials": args.trials, "rows": rows, "margin": margin}, indent=1)
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
