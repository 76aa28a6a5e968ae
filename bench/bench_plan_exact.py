"""The planner's step times against the exact replay of all m microbatches, what building an order costs
(the figures `pp_offload.plan.evaluate.SECONDS_PER_ACTION` is set from), and the planner's run time for the
`pp-offload plan` example of docs/planner.md.

    python bench/bench_plan_exact.py            # all three parts, ~5-10 min on 2 busy cores
    python bench/bench_plan_exact.py --quick    # the cases and the example only

Parts:
1. cases: llama-3-70b at seq 4096 (the issue's cases, A100 pp 8 m 64 and H100 pp 8 m 128), every schedule
   without offload or recompute: the planner's step time and bubble (`plan`), the exact replay of all m
   microbatches, and the old rule's prediction (linear from 2 pp and 3 pp microbatches) for reference;
2. cost: seconds to build one order per compute action (``6 m pp``), per schedule, pp 4 / 8 / 16 and m 16 pp
   (our V orders with the planner's ``auto`` search: full up to pp 8, fast above; torch's with mock stages);
3. example: wall time of ``pp-offload plan --model llama-3-8b --seq-len 8192 --pp 4 --microbatches 16`` in
   a subprocess (default jobs: one worker per CPU), its CPU time (its workers' included) and the load
   average before and after.

The order search's disk cache is off throughout (``PP_OFFLOAD_ORDER_CACHE=off``): the figures are what a
first run pays; a repeated plan with the same sizes and costs reads our V orders from the cache.

Writes bench/results/plan_exact.json.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the setup test_plan_exact.py checks
# what a first run pays: the V-order search's disk cache (pp_offload.order.cache) would serve repeats
os.environ["PP_OFFLOAD_ORDER_CACHE"] = "off"

from _plan_reference import llama70b_setup as _setup  # noqa: E402

from pp_offload.plan import plan  # noqa: E402
from pp_offload.plan.evaluate import build_orders, combine, evaluate_orders  # noqa: E402
from pp_offload.plan.orders import SCHEDULES, resolve_search  # noqa: E402

CASES = (("A100", 8, 64), ("H100", 8, 128))
EXAMPLE = ["--model", "llama-3-8b", "--seq-len", "8192", "--pp", "4", "--microbatches", "16"]


def _replay(setup, sizes: list[int], m: int) -> dict:
    orders = build_orders(
        setup, sizes, search=resolve_search("auto", setup.layout.num_ranks), virtual_stages=2
    )
    if orders.error:
        raise RuntimeError(orders.error)
    results = evaluate_orders(setup, orders, "none")
    if len(results) == 1:
        return combine(results, m)
    a, b = results  # the old rule, for reference: linear through two sizes, no check
    makespan = b.makespan + (m - b.size) * (b.makespan - a.makespan) / (b.size - a.size)
    return {"makespan": makespan, "bubble": 1.0 - b.busy * m / b.size / makespan}


def cases() -> list[dict]:
    rows = []
    print(
        f"{'case':<22}{'schedule':<31}{'plan s':>9}{'bubble':>8}{'exact s':>9}{'bubble':>8}{'old rule':>10}"
    )
    for machine, pp, m in CASES:
        result = plan(
            "llama-3-70b",
            seq_len=4096,
            microbatch_size=1,
            num_microbatches=m,
            pp=pp,
            machine=machine,
            gpu_memory_gib=1000,
            offload=["none"],
            recompute=["none"],
            jobs=1,
        )
        for c in sorted((c for c in result.candidates if c.evaluated), key=lambda c: c.schedule):
            setup = _setup(c.schedule, machine, pp, m)
            if c.schedule == "ScheduleVAdaptive":
                setup.memory_cap = result.schedules[c.schedule]["memory_cap_units"]
            exact = _replay(setup, [m], m)
            old = _replay(setup, [2 * pp, 3 * pp], m)
            row = {
                "machine": machine,
                "pp": pp,
                "m": m,
                "schedule": c.schedule,
                "plan_s": c.pipeline_time,
                "plan_bubble": c.bubble,
                "extrapolated": c.extrapolated,
                "exact_s": exact["makespan"],
                "exact_bubble": exact["bubble"],
                "old_rule_s": old["makespan"],
                "old_rule_bubble": old["bubble"],
            }
            rows.append(row)
            print(
                f"{f'70B {machine} pp {pp} m {m}':<22}{c.schedule:<31}{c.pipeline_time:>9.2f}"
                f"{100 * c.bubble:>7.1f}%{exact['makespan']:>9.2f}{100 * exact['bubble']:>7.1f}%"
                f"{100 * (old['makespan'] / exact['makespan'] - 1):>+9.1f}%"
            )
    return rows


def cost() -> list[dict]:
    rows = []
    _setup("ScheduleInterleaved1F1B", "A100", 2, 4)  # import torch's pipelining first: not an order's cost
    build_orders(_setup("ScheduleInterleaved1F1B", "A100", 2, 4), [4], search="full", virtual_stages=2)
    print(f"\n{'pp':>3}{'m':>5}  {'schedule':<31}{'build s':>9}{'us/action':>11}{'replay s':>10}")
    for pp in (4, 8, 16):
        m = 16 * pp
        for schedule in SCHEDULES:
            setup = _setup(schedule, "A100", pp, m)
            if setup.problem:
                continue
            orders = build_orders(setup, [m], search=resolve_search("auto", pp), virtual_stages=2)
            start = time.perf_counter()
            evaluate_orders(setup, orders, "none")
            replay = time.perf_counter() - start
            per_action = orders.build_seconds / (6 * m * pp)
            rows.append(
                {"pp": pp, "m": m, "schedule": schedule, "build_s": orders.build_seconds, "replay_s": replay}
            )
            build = f"{orders.build_seconds:>9.2f}{1e6 * per_action:>11.1f}"
            print(f"{pp:>3}{m:>5}  {schedule:<31}{build}{replay:>10.3f}")
    return rows


def example() -> dict:
    before = os.getloadavg()
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "pp_offload", "plan", *EXAMPLE],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
        check=True,
    )
    seconds = time.perf_counter() - start
    after = os.getloadavg()
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = used.ru_utime + used.ru_stime - cpu.ru_utime - cpu.ru_stime
    print(f"\npp-offload plan {' '.join(EXAMPLE)}: {seconds:.1f} s on {os.cpu_count()} cores")
    print(f"CPU time of the command and its workers: {cpu_s:.1f} s (wall on idle cores >= CPU / cores)")
    print(f"load average (1 min) before {before[0]:.2f}, after {after[0]:.2f}")
    print(done.stdout.split("\n\n")[1])
    return {
        "command": ["pp-offload", "plan", *EXAMPLE],
        "seconds": seconds,
        "cpu_seconds": cpu_s,
        "cpus": os.cpu_count(),
        "load_before": before[0],
        "load_after": after[0],
        "stderr_chars": len(done.stderr),
        "recommended": done.stdout.split("recommended: ")[1].splitlines()[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="skip the per-schedule build costs")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "plan_exact.json")
    args = parser.parse_args()
    results = {"cases": cases(), "example": example()}
    if not args.quick:
        results["cost"] = cost()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
