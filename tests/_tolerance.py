"""Tolerances for comparing a pipelined training trajectory with one process (fp32).

Step 0 starts from identical weights and data: only the order in which microbatch and data-parallel
gradients are summed differs, so the loss and the gradient norm agree to a few fp32 ulps of the terms
(rtol 1e-5). After an optimizer step the weights themselves differ in their last bits, and AdamW divides
each gradient by its own running magnitude, so near-zero gradients (say, the tied embedding rows of
tokens that are not in the batch) turn last-bit differences into visible weight differences, which the
next steps' gradient norms show first. A fixed rtol of 1e-5 over 4 steps therefore passes on one CPU and
fails on another (it did: 1.4e-5 at step 4 on a 2-core EPYC).

``bench/bench_trajectory_drift.py`` measures the drift on these tests' tiny models with noise of 1e-6 of
each gradient's mean magnitude added before every step (several ulps: pessimistic for another summation
order): losses drift by at most ~4e-6 relative over 6 steps and gradient norms by 1e-5 to 2.4e-4 (runs
differ; up to 6e-4 with ten times that noise). The tolerances after step 0 sit above those figures
and still catch what a bug does to a trajectory: one warm-up step too many moves the loss by 1.6e-4 at
step 1 and 1e-3 at step 2, a learning rate 10% too high by 2.2e-4 at step 2 (measured on the same
model). Every gradient bug already shows at step 0, which stays tight.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

FIRST_STEP = (1e-5, 1e-6)  # (rtol, atol): same weights, another summation order
LATER_STEPS = {"loss": (1e-4, 1e-6), "grad_norm": (2e-3, 1e-6)}


def trajectory_tolerance(what: str, step: int) -> tuple[float, float]:
    """(rtol, atol) for comparing ``what`` ("loss" or "grad_norm") at optimizer step ``step`` (0-based)."""
    if what not in LATER_STEPS:
        raise ValueError(f"what={what!r}: expected one of {sorted(LATER_STEPS)}")
    return FIRST_STEP if step == 0 else LATER_STEPS[what]


def assert_trajectory_close(
    got: Sequence[float], want: Sequence[float], what: str = "loss", *, first_step: int = 0
) -> None:
    """Per-step comparison of two trajectories; ``first_step`` is the optimizer step of ``got[0]``."""
    assert len(got) == len(want), f"{what}: {len(got)} steps vs {len(want)}"
    for offset, (g, w) in enumerate(zip(got, want, strict=True)):
        step = first_step + offset
        rtol, atol = trajectory_tolerance(what, step)
        torch.testing.assert_close(
            torch.tensor(g, dtype=torch.float64),
            torch.tensor(w, dtype=torch.float64),
            rtol=rtol,
            atol=atol,
            msg=lambda m, s=step: f"{what} at step {s}: {m}",
        )
