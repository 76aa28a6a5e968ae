"""The compiled-gradient matrix: every cell within rel 1e-4 of the same compiled model in one process.

Cells: HF Llama, Qwen2, GPT-2 and a LoRA model (peft on the Llama) x V-Min, V-Half, V-ZB, ZBV, DualPipeV,
Interleaved1F1B x offload none / full / budget:0.5 x recompute none / full / selective (216), plus V-Half
with selective recompute and torch's donated buffers off per family (4). Each decoder layer is compiled in
place (`pp_offload.runtime.compile.compile_layers`, inductor by default) on 2 gloo ranks; a cell runs 3
steps alternating packed and unpacked rows (tests/_compiled_pipeline.py, shared with the suite's
representative subset, tests/test_compile_gloo.py) and records, per rank:

- the worst gradient error as a fraction of the tolerance (``|got - want| / (1e-6 + 1e-4 |want|)``, the
  rule of ``torch.testing.assert_close(rtol=1e-4, atol=1e-6)``: at most 1 passes), against the same
  model with the same backend in one process (tied weights summed over the ranks);
- the graphs dynamo compiled after the first step (0 expected);
- how many times each checkpointed layer ran per microbatch (2 expected: its forward and one
  recomputation in I).

One process launch per family (its 54 or 55 cells share start-up, imports and compiled graphs: dynamo
and inductor compile a layer class once per recompute mode), with a progress bar.

    python bench/bench_compile_grads.py                       # the whole matrix (inductor)
    python bench/bench_compile_grads.py --families llama --schedules ScheduleVHalf --backend aot_eager
Writes bench/results/compile_grads.json (merged with the cells already there, so runs can be split).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from _compiled_pipeline import FAMILIES, aliases, run_cells, sum_over_ranks  # noqa: E402
from _dist import run_on_ranks  # noqa: E402

SCHEDULES = (
    "ScheduleVMin",
    "ScheduleVHalf",
    "ScheduleVZB",
    "ScheduleZBVZeroBubble",
    "ScheduleDualPipeV",
    "ScheduleInterleaved1F1B",
)
OFFLOADS = (None, "full", "budget:0.5")
RECOMPUTES = (None, "full", "selective")
RESULTS = ROOT / "bench" / "results" / "compile_grads.json"


def _key(cell: dict[str, Any]) -> str:
    return " ".join(
        f"{k}={cell.get(k)}" for k in ("family", "schedule", "offload", "recompute", "donated_buffer")
    )


def cells_of(family: str, schedules: tuple[str, ...], backend: str) -> list[dict[str, Any]]:
    """A family's cells, grouped by recompute mode (a mode's layer graph is compiled once)."""
    cells = [
        {"family": family, "schedule": s, "offload": o, "recompute": r, "backend": backend, "steps": 3}
        for r, s, o in itertools.product(RECOMPUTES, schedules, OFFLOADS)
    ]
    if "ScheduleVHalf" in schedules:
        cells.append(
            {**cells[0], "schedule": "ScheduleVHalf", "recompute": "selective", "donated_buffer": False}
        )
    return cells


def _error(got: dict[str, Any], want: dict[str, Any]) -> tuple[float, str]:
    """The worst |got - want| / (1e-6 + 1e-4 |want|) over every parameter, and that parameter."""
    worst, where = 0.0, ""
    for name, grad in want.items():
        if name not in got:
            return float("inf"), f"{name} missing"
        ratio = float(((got[name] - grad).abs() / (1e-6 + 1e-4 * grad.abs())).max())
        if ratio > worst:
            worst, where = ratio, name
    extra = set(got) - set(want)
    if extra:
        return float("inf"), f"{sorted(extra)[0]} unexpected"
    return worst, where


def run_family(family: str, schedules: tuple[str, ...], backend: str) -> list[dict[str, Any]]:
    cells = cells_of(family, schedules, backend)
    start = time.monotonic()
    results = run_on_ranks(run_cells, 2, cells, backend, True, timeout=3600, idle_timeout=1800)
    seconds = time.monotonic() - start
    want = next(got["grads"] for per_rank in results for got in per_rank[len(cells) :])
    names = aliases(family)
    rows = []
    for index, cell in enumerate(cells):
        per_rank = [r[index] for r in results]
        errors = [r["error"] for r in per_rank if "error" in r]
        row: dict[str, Any] = {**cell, "key": _key(cell)}
        if errors:
            row["error"] = errors[0]
        else:
            summed = sum_over_ranks([r["grads"] for r in per_rank], names)
            row["error_over_tolerance"], row["worst_parameter"] = _error(summed, want)
            row["graphs_after_first"] = [r["graphs_after_first"] for r in per_rank]
            row["runs_per_microbatch"] = [r["runs_per_microbatch"] for r in per_rank]
            row["ok"] = (
                row["error_over_tolerance"] <= 1
                and all(g == 0 for g in row["graphs_after_first"])
                and all(n in (None, 2) for n in row["runs_per_microbatch"])
            )
        rows.append(row)
    print(f"{family}: {len(cells)} cells in {seconds:.0f} s", flush=True)
    return rows


def report(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| family | schedule | offload | recompute | error / tol | graphs after step 1 | runs / mb | ok |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        schedule = row["schedule"] + (" (donated off)" if row.get("donated_buffer") is False else "")
        if "error" in row:
            lines.append(
                f"| {row['family']} | {schedule} | {row['offload']} | {row['recompute']} | "
                f"{row['error'][:60]} | | | no |"
            )
            continue
        lines.append(
            f"| {row['family']} | {schedule} | {row['offload']} | {row['recompute']} | "
            f"{row['error_over_tolerance']:.3f} | {row['graphs_after_first']} | "
            f"{row['runs_per_microbatch']} | {'yes' if row['ok'] else 'NO'} |"
        )
    ok = sum(1 for row in rows if row.get("ok"))
    lines.append(f"\n{ok} of {len(rows)} cells pass")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES))
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    stored = json.loads(args.out.read_text()) if args.out.exists() else {"cells": {}}
    for family in args.families:
        rows = run_family(family, tuple(args.schedules), args.backend)
        for row in rows:
            stored["cells"][f"{args.backend} {row['key']}"] = row
        stored["torch"] = torch.__version__
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(stored, indent=1, default=str))
        print(report(rows), flush=True)
    every = list(stored["cells"].values())
    print(f"stored: {sum(1 for r in every if r.get('ok'))} of {len(every)} cells pass -> {args.out}")


if __name__ == "__main__":
    main()
