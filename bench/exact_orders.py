"""Exact check of one adaptive-search point: is there a V order within a memory limit that finishes by a
given makespan? A CP-SAT model (ortools, `pip install 'pp-offload[exact]'`) of the same yardstick as
`pp_offload.order.replay`: comm 0, a chunk held from its F's start to its W's end, every rank's level within
the limit, each (stage, kind) running its microbatches in order (torch's runtime expects it), seeded with
the search's own order as a hint.

Why: the search is a heuristic; this shows where it is beaten and what the better order looks like. At
d=8, m=32, F:I:W=3:4:2, limit 15 it found a 613-unit order where the search (search version 4) had 614,
which led to the critical-chain polish (`pp_offload.order.polish`; the search now reaches 611). Proving a
point optimal is usually out of its reach in minutes; `pp_offload.order.vshape.makespan_lower_bound` does
that where it is tight.

    python bench/exact_orders.py --d 8 --m 32 --limit 15 --costs 3:4:2 --target 613 --seconds 300
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "exact_orders.json"
KINDS = ("F", "I", "W")


def solve(d: int, m: int, limit: int, costs: tuple[int, int, int], target: int, seconds: float) -> dict:
    try:
        from ortools.sat.python import cp_model
    except ImportError as e:
        raise SystemExit("bench/exact_orders.py needs ortools: pip install 'pp-offload[exact]'") from e
    from pp_offload.order import Costs, adaptive_v_order
    from pp_offload.order.replay import replay_ranks
    from pp_offload.order.vshape import one_f_one_b_peak

    duration = dict(zip(KINDS, costs, strict=True))
    search_costs = Costs(**{k: float(v) for k, v in duration.items()})
    order = adaptive_v_order(d, m, limit / one_f_one_b_peak(d, m), search_costs)
    hint: dict = {}
    search_makespan, _ = replay_ranks(order, search_costs, hint)

    stages = 2 * d
    model = cp_model.CpModel()
    start, interval = {}, {}
    for s in range(stages):
        for k in KINDS:
            for j in range(m):
                start[s, k, j] = model.new_int_var(0, target - duration[k], f"s{s}{k}{j}")
                interval[s, k, j] = model.new_fixed_size_interval_var(
                    start[s, k, j], duration[k], f"i{s}{k}{j}"
                )

    def end(key: tuple) -> object:
        return start[key] + duration[key[1]]

    for r in range(d):
        held = (r, stages - 1 - r)
        model.add_no_overlap([interval[s, k, j] for s in held for k in KINDS for j in range(m)])
        events = [start[s, "F", j] for s in held for j in range(m)] + [
            end((s, "W", j)) for s in held for j in range(m)
        ]
        model.add_reservoir_constraint(events, [1] * (2 * m) + [-1] * (2 * m), 0, limit)
    for j in range(m):
        for s in range(1, stages):
            model.add(start[s, "F", j] >= end((s - 1, "F", j)))
        model.add(start[stages - 1, "I", j] >= end((stages - 1, "F", j)))
        for s in range(stages - 1):
            model.add(start[s, "I", j] >= end((s + 1, "I", j)))
        for s in range(stages):
            model.add(start[s, "W", j] >= end((s, "I", j)))
            if j + 1 < m:
                for k in KINDS:
                    model.add(start[s, k, j + 1] >= end((s, k, j)))
    for (s, k, j), t in hint.items():
        model.add_hint(start[s, k, j], int(round(t)))

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = seconds
    solver.parameters.num_workers = 2
    began = time.perf_counter()
    status = solver.solve(model)
    found = status in (cp_model.OPTIMAL, cp_model.FEASIBLE)
    makespan = max(solver.value(start[key]) + duration[key[1]] for key in start) if found else None
    work = 2 * m * sum(costs)
    return {
        "d": d,
        "m": m,
        "limit": limit,
        "costs": ":".join(map(str, costs)),
        "target": target,
        "seconds_allowed": seconds,
        "seconds": round(time.perf_counter() - began, 1),
        "status": solver.status_name(status),
        "makespan": makespan,
        "bubble": None if makespan is None else 100 * (1 - work / makespan),
        "search_makespan": search_makespan,
        "search_bubble": 100 * (1 - work / search_makespan),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d", type=int, required=True)
    p.add_argument("--m", type=int, required=True)
    p.add_argument("--limit", type=int, required=True, help="memory limit, chunk units per rank")
    p.add_argument("--costs", default="1:1:1", help="integer F:I:W, e.g. 3:4:2")
    p.add_argument("--target", type=int, required=True, help="makespan to reach (time units)")
    p.add_argument("--seconds", type=float, default=300.0, help="solver time limit")
    p.add_argument("--out", type=Path, default=RESULTS, help="JSON file the result is appended to")
    args = p.parse_args(argv)
    try:
        costs = tuple(int(x) for x in args.costs.split(":"))
    except ValueError:
        costs = ()
    if len(costs) != 3 or min(costs) < 1:
        p.error(f"--costs must be three positive integers F:I:W like 3:4:2, got {args.costs!r}")
    if args.limit < 2 or args.limit > 2 * args.d:
        p.error(f"--limit must be between 2 and 2d = {2 * args.d} chunk units, got {args.limit}")
    row = solve(args.d, args.m, args.limit, costs, args.target, args.seconds)
    row["timestamp"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    print(
        f"d={row['d']} m={row['m']} {row['costs']} limit {row['limit']}: search {row['search_makespan']:g} "
        f"({row['search_bubble']:.2f}%); makespan <= {row['target']}: {row['status']}"
        + ("" if row["makespan"] is None else f", found {row['makespan']} ({row['bubble']:.2f}%)")
        + f" in {row['seconds']} s"
    )
    rows = json.loads(args.out.read_text()) if args.out.exists() else []
    rows.append(row)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
