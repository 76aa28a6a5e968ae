"""Compiled decoder layers in pipelines on 2 gloo ranks: a representative subset of the gradient matrix
(the whole matrix: bench/bench_compile_grads.py), in ONE spawn whose cells share start-up and imports.

Every cell: each parameter's gradient within rel 1e-4 of the same compiled model in one process, 0 graphs
compiled after the first step over steps that alternate packed and unpacked batches (one graph for both
mask kinds: `pp_offload.models.masks.build_mask`'s ``uniform``), and each checkpointed layer run 2 times
per microbatch (its forward and one recomputation in I: deferred weight gradients).

The cells cover: selective recompute (torch's selective-checkpoint policy under compile,
`pp_offload.runtime.recompute.selective_context`) with torch's donated buffers on and off under V-Half
(3 steps: packed, unpacked, packed); full recompute with full offload under torch's ZBV; GPT-2 (Conv1D)
with budget offload under DualPipeV; mlp recompute of a LoRA model under V-ZB.

Why ``backend="aot_eager"``: what pp-offload must get right under compile is decided before inductor
runs. Dynamo traces the layer (guards, hence recompiles), AOT autograd builds the joint graph with our
deferred-weight-gradient op, applies the selective-checkpoint tags, partitions forward and backward
(what is saved, what is recomputed, which buffers are donated) and runs the backward once per microbatch;
``aot_eager`` runs all of that and executes the partitioned graphs op by op. Inductor only lowers those
graphs to kernels, and costs about 25 s of CPU per layer graph with a cold cache (CI's): the suite's
inductor check is the one-process test in tests/test_compile.py, whose kernels do reuse a backward's
donated buffers (the case deferred W's queue copies guard against); the whole matrix runs with inductor
in the bench.
"""

from __future__ import annotations

import pytest
import torch
from _compiled_pipeline import aliases, run_cells, sum_over_ranks
from _dist import run_on_ranks

CELLS = [
    {"family": "llama", "schedule": "ScheduleVHalf", "offload": None, "recompute": "selective", "steps": 3},
    {
        "family": "llama",
        "schedule": "ScheduleVHalf",
        "offload": None,
        "recompute": "selective",
        "donated_buffer": False,
    },
    {"family": "llama", "schedule": "ScheduleZBVZeroBubble", "offload": "full", "recompute": "full"},
    {"family": "gpt2", "schedule": "ScheduleDualPipeV", "offload": "budget:0.5", "recompute": "selective"},
    {"family": "lora", "schedule": "ScheduleVZB", "offload": None, "recompute": "mlp"},
]
BACKEND = "aot_eager"


@pytest.mark.usefixtures("one_thread")
def test_compiled_pipelines_match_one_process() -> None:
    cells = [{**cell, "backend": BACKEND} for cell in CELLS]
    results = run_on_ranks(run_cells, 2, cells, BACKEND, timeout=300)
    references = {got["reference"]: got["grads"] for per_rank in results for got in per_rank[len(CELLS) :]}
    for index, cell in enumerate(CELLS):
        label = " ".join(f"{k}={v}" for k, v in cell.items())
        for rank, per_rank in enumerate(results):
            got = per_rank[index]
            assert "error" not in got, f"rank {rank} {label}: {got['error']}"
            assert got["graphs_after_first"] == 0, f"rank {rank} {label}: recompiled after the first step"
            if cell["recompute"] is not None:
                assert got["runs_per_microbatch"] == 2, f"rank {rank} {label}: {got['runs_per_microbatch']}"
        summed = sum_over_ranks([r[index]["grads"] for r in results], aliases(cell["family"]))
        want = references[cell["family"]]
        assert set(summed) == set(want), f"{label}: {set(summed) ^ set(want)}"
        for name, grad in want.items():
            torch.testing.assert_close(
                summed[name], grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name, c=label: f"{c} {n}: {m}"
            )
