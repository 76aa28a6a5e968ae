"""What budget offload looks like when the runtime plans it without the planner's figures, and with them.

Setting: Llama-3-8B (`pp_offload.plan.shapes`), pp 4, m 8 (the planner replays this exact m), seq 4096,
microbatch 1, bf16, H100 preset; V-Half, V-ZB and torch's Interleaved1F1B; offload ``budget`` (within 3%
step time) and ``budget:auto:0.1`` (within 10%).

- predicted: the planner's plan (`pp_offload.plan.evaluate.offload_plan`), step time and per-rank peak of
  saved activations as `pp_offload.plan.plan` reports them. With ``enable_offload(..., inputs=...)`` the
  runtime places exactly this plan (tests/test_offload_handoff.py checks it chunk by chunk and position by
  position), so these are also the figures of the run.
- without figures: what the runtime placed before it took the planner's figures (as on main before
  issue 13's follow-up): every rank plans on the schedule's ``pipeline_order`` (stage 0's I included) with
  the scalar costs, counting its own stages' layers and assuming the largest for the others; each rank
  keeps its own part (ours built from the planner's scalar costs, as if the user had passed them: the
  recipe passed none, and built them for unit costs). That run, replayed with the true per-stage times,
  layers, copy times and bytes (the same replay the planner makes): its step time and peak, how many
  chunks move another number of layers than predicted, how many ranks have OFFLOAD/RELOAD elsewhere.

    python bench/bench_offload_handoff.py     # under a minute

Writes ``offload_handoff.json`` to ``bench/results`` (or ``--out DIR``).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
GIB = float(1 << 30)
SCHEDULES = ("ScheduleVHalf", "ScheduleVZB", "ScheduleInterleaved1F1B")
SHORT = {"ScheduleVHalf": "V-Half", "ScheduleVZB": "V-ZB", "ScheduleInterleaved1F1B": "Interleaved1F1B"}
POLICIES = ("budget", "budget:auto:0.1")
SETTING = {"seq_len": 4096, "microbatch_size": 1, "num_microbatches": 8, "pp": 4}


def _setup(schedule: str) -> Any:
    from pp_offload.plan.handoff import planner_setup

    return planner_setup("llama-3-8b", schedule=schedule, machine="H100", **SETTING)


def _schedule_order(schedule: str, setup: Any) -> dict[int, list[Any]]:
    """The compute order the schedule class builds (torch's own for torch's, ours from the scalar costs)."""
    from pp_offload.plan.evaluate import scalar_costs
    from pp_offload.plan.orders import build_order

    d, m = SETTING["pp"], SETTING["num_microbatches"]
    return dict(build_order(schedule, d, m, scalar_costs(setup.costs), search="full"))


def _without_figures(schedule: str, setup: Any, policy: str) -> tuple[dict[int, list[Any]], dict]:
    """Every rank's part of the plan the runtime made from scalar costs and its own layer counts."""
    from pp_offload.order.offload import plan_offload
    from pp_offload.plan.evaluate import scalar_costs

    order = _schedule_order(schedule, setup)
    scalar = scalar_costs(setup.costs)
    ranks: dict[int, list[Any]] = {}
    layered: dict = {}
    for rank in sorted(order):
        own = {s: setup.layers[s] for s in setup.layout.stages_of(rank)}
        layers = [own.get(s, max(own.values())) for s in range(setup.layout.num_stages)]
        plan = plan_offload(order, scalar, policy, layers=layers)
        ranks[rank] = plan.order[rank]
        for key in plan.offloaded[rank]:
            if key in plan.layered:
                layered[key] = plan.layered[key]
    return ranks, layered


def _replay(setup: Any, order: dict[int, list[Any]], layered: dict, lanes: str) -> tuple[float, int]:
    """Step time and largest per-rank peak of ``order`` as torch runs it, with the true figures."""
    from pp_offload.order.offload_inputs import activation_peaks
    from pp_offload.sim import as_executed_by_torch, simulate

    inputs = setup.offload_inputs()
    true = {
        key: replace(c, layers=inputs.layers[key[0]], layer_copy=inputs.layer_copy[key[0]])
        for key, c in layered.items()
    }
    sim = simulate(as_executed_by_torch(order), setup.costs, copy_lanes=lanes, layered=true)
    return sim.makespan, max(activation_peaks(sim, inputs.stage_bytes, true))


def _row(schedule: str, policy: str) -> dict[str, Any]:
    from pp_offload.plan.evaluate import activation_peaks, build_orders, offload_plan
    from pp_offload.sim import as_executed_by_torch, simulate

    setup = _setup(schedule)
    m = SETTING["num_microbatches"]
    order = build_orders(setup, [m], search="full", virtual_stages=2).orders[m]
    planned = offload_plan(setup, order, policy)
    peaks = activation_peaks(planned.sim, setup, layered=planned.layered)
    base = simulate(order, setup.costs)
    base_peak = max(activation_peaks(base, setup))
    ranks, layered = _without_figures(schedule, setup, policy)
    step, peak = _replay(setup, ranks, layered, planned.policy.lanes)
    predicted_moved = {k: c.moved for k, c in planned.layered.items()}
    moved = {k: c.moved for k, c in layered.items()}
    keys = set(predicted_moved) | set(moved)
    differ = sum(1 for k in keys if predicted_moved.get(k, 0) != moved.get(k, 0))
    executed = as_executed_by_torch(ranks)
    moved_ranks = sum(
        1 for r in planned.order if [str(a) for a in planned.order[r]] != [str(a) for a in executed[r]]
    )
    return {
        "schedule": SHORT[schedule],
        "policy": policy,
        "no_offload_step_s": base.makespan,
        "no_offload_peak_gib": base_peak / GIB,
        "predicted_step_s": planned.sim.makespan,
        "predicted_peak_gib": max(peaks) / GIB,
        "predicted_moved_layers": sum(predicted_moved.values()),
        "without_step_s": step,
        "without_peak_gib": peak / GIB,
        "without_moved_layers": sum(moved.values()),
        "chunks_moving_other_layers": differ,
        "chunks": setup.layout.num_stages * m,
        "ranks_with_other_positions": moved_ranks,
    }


def _table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'schedule':16} {'policy':16} {'none s':>7} {'none GiB':>8} | {'pred s':>7} {'pred GiB':>8} "
        f"{'layers':>6} | {'w/o s':>7} {'w/o GiB':>8} {'layers':>6} {'chunks≠':>8} {'ranks≠':>6}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['schedule']:16} {r['policy']:16} "
            f"{r['no_offload_step_s']:7.3f} {r['no_offload_peak_gib']:8.2f} | "
            f"{r['predicted_step_s']:7.3f} {r['predicted_peak_gib']:8.2f} {r['predicted_moved_layers']:6d} | "
            f"{r['without_step_s']:7.3f} {r['without_peak_gib']:8.2f} {r['without_moved_layers']:6d} "
            f"{r['chunks_moving_other_layers']:>4d}/{r['chunks']:<3d} {r['ranks_with_other_positions']:>4d}/4"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    start = time.perf_counter()
    rows = [_row(s, p) for s in SCHEDULES for p in POLICIES]
    print(_table(rows))
    data = {
        "bench": "offload_handoff",
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "seconds": round(time.perf_counter() - start, 1),
        "setting": {"model": "llama-3-8b", "machine": "H100", "dtype": "bf16", **SETTING},
        "results": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "offload_handoff.json").write_text(json.dumps(data, indent=1) + "\n")
    print(f"({data['seconds']} s; {args.out / 'offload_handoff.json'})")


if __name__ == "__main__":
    main()
