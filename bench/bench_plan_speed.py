"""How long `pp-offload plan` spends placing budget offload, with the reference placement path and the fast
one (`pp_offload.order.offload_replay`), and checks that both give the same plan.

    python bench/bench_plan_speed.py            # the README example, in one process: ~3 min on 2 busy cores
    python bench/bench_plan_speed.py --quick    # two schedules and two recompute plans of it (~30 s)
    python bench/bench_plan_speed.py --cli      # also the example's command, default worker processes

The example is README's (and docs/planner.md's): ``pp-offload plan --model llama-3-8b --seq-len 8192 --pp 4
--microbatches 16``. Each path plans it in this process with ``jobs=1``, so its CPU time is the planner's
own (``time.process_time``); the V orders come from the order cache as a repeated plan has them (the first
path fills the cache, so both read it: run once before to keep order construction out of the first row).
``reference``: every budget trial's placement written into its order and replayed by `simulate`, no trial
remembered (`reference_replays`, the search as it ran before); ``fast``: the default. The two plans'
JSON (every number, wall-clock fields aside) must be identical: the script exits 1 otherwise. Printed: CPU
and wall seconds, budget trials run, trials answered by the memo, replays; the load average beside them,
since the machine may be shared. ``--cli`` adds the wall and CPU time of the command itself in a
subprocess (its workers included), as a user runs it.

Writes bench/results/plan_speed.json (or ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pp_offload.order.offload_replay import STATS, reference_replays  # noqa: E402
from pp_offload.plan import plan  # noqa: E402

EXAMPLE = {"seq_len": 8192, "microbatch_size": 1, "num_microbatches": 16, "pp": 4}
CLI = ["--model", "llama-3-8b", "--seq-len", "8192", "--pp", "4", "--microbatches", "16"]
QUICK = {"schedules": ["ScheduleVHalf", "ScheduleInterleavedZeroBubble"], "recompute": ["none", "mlp"]}


def _comparable(data: Any) -> Any:
    """The plan's JSON without its wall-clock fields (how long orders took to build)."""
    if isinstance(data, dict):
        return {k: _comparable(v) for k, v in data.items() if k != "order_seconds"}
    if isinstance(data, list):
        return [_comparable(v) for v in data]
    return data


def run(path: str, extra: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    STATS.clear()
    load = os.getloadavg()[0]
    cpu, wall = time.process_time(), time.perf_counter()
    if path == "reference":
        with reference_replays():
            result = plan("llama-3-8b", **EXAMPLE, jobs=1, **extra)
    else:
        result = plan("llama-3-8b", **EXAMPLE, jobs=1, **extra)
    row = {
        "path": path,
        "cpu_s": round(time.process_time() - cpu, 2),
        "wall_s": round(time.perf_counter() - wall, 2),
        "trials": STATS["trials"],
        "repeats": STATS["repeats"],
        "replays": STATS["replays"],
        "load_before": round(load, 2),
        "load_after": round(os.getloadavg()[0], 2),
    }
    return row, result


def run_cli() -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    load = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    wall = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "pp_offload", "plan", *CLI, "--quiet"],
        check=True,
        env=env,
        stdout=subprocess.DEVNULL,
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {
        "path": "cli (default jobs)",
        "cpu_s": round(cpu, 2),
        "wall_s": round(time.perf_counter() - wall, 2),
        "load_before": round(load, 2),
        "load_after": round(os.getloadavg()[0], 2),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="two schedules and two recompute plans only")
    p.add_argument("--cli", action="store_true", help="also time the command in a subprocess")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "plan_speed.json")
    args = p.parse_args(argv)
    extra = QUICK if args.quick else {}
    rows, plans = [], []
    for path in ("reference", "fast"):
        row, result = run(path, extra)
        rows.append(row)
        plans.append(_comparable(result.to_dict()))
    same = plans[0] == plans[1]
    if args.cli:
        rows.append(run_cli())
    print(f"pp-offload plan {' '.join(CLI)}" + (" (quick subset)" if args.quick else ""))
    print(f"{'path':20} {'CPU s':>8} {'wall s':>8} {'trials':>7} {'repeats':>8} {'replays':>8} {'load':>11}")
    for r in rows:
        print(
            f"{r['path']:20} {r['cpu_s']:8.1f} {r['wall_s']:8.1f} {r.get('trials', '-'):>7} "
            f"{r.get('repeats', '-'):>8} {r.get('replays', '-'):>8} "
            f"{r['load_before']:5.2f}-{r['load_after']:<5.2f}"
        )
    print(f"speed-up (CPU): {rows[0]['cpu_s'] / max(rows[1]['cpu_s'], 1e-9):.1f}x; same plan: {same}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"quick": args.quick, "rows": rows, "same_plan": same, "cpus": os.cpu_count()}, indent=1)
        + "\n"
    )
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
