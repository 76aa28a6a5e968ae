"""The planner's activation peak and step under deferred W and torch's split, without and with offload, where
an offload plan's copies between a chunk's I and its W move the W queue to host memory.

Why: with recompute a deferred-W chunk holds its queue (each linear's input and output gradient) from I to
W, several times what the recomputing layers save (`pp_offload.plan.memory.queued_bytes`); torch's split
holds only the checkpointed layers' inputs and recomputes a third time in W. Offload can move the queue
off the device where the gap between I and W affords its copy both ways (`pp_offload.order.Costs.queue`);
this table says where that is, at a real size, on a PCIe host link (H100) and on a fast one (GH200).

    python bench/bench_queue_plan.py          # ~20 s
Writes ``queue_plan.json`` to ``bench/results`` (or ``--out DIR``): per machine, schedule, recompute plan
and split, the planner's highest per-rank activation peak (GiB), its step (s) and the queue copies
placed, for no offload, ``full`` and ``budget``.
"""

from __future__ import annotations

import argparse
import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
MODEL, PP, SEQ, MICROBATCHES = "llama-3-8b", 4, 8192, 16
MACHINES = ("H100", "GH200")
SCHEDULES = ("ScheduleVHalf", "ScheduleVZB", "ScheduleZBVZeroBubble")
RECOMPUTE = ("none", "full")
POLICIES = ("none", "full", "budget")


def row(machine: str, schedule: str, recompute: str, deferred: bool) -> dict[str, Any]:
    from pp_offload.order.offload_inputs import activation_peaks
    from pp_offload.plan.evaluate import build_orders, offload_plan
    from pp_offload.plan.handoff import planner_setup
    from pp_offload.sim import simulate

    setup = planner_setup(
        MODEL,
        schedule=schedule,
        pp=PP,
        seq_len=SEQ,
        microbatch_size=1,
        num_microbatches=MICROBATCHES,
        recompute=recompute,
        machine=machine,
        deferred_w=deferred,
    )
    order = build_orders(setup, [MICROBATCHES], search="fast", virtual_stages=2).orders[MICROBATCHES]
    inputs = setup.offload_inputs()
    out: dict[str, Any] = {"machine": machine, "schedule": schedule, "recompute": recompute}
    out["split"] = "deferred W" if deferred else "torch split"
    out["queue_over_saved"] = max(inputs.costs.queue) if inputs.costs.queue else None
    for policy in POLICIES:
        if policy == "none":
            sim, layered, copies = simulate(order, inputs.costs), {}, 0
        else:
            plan = offload_plan(setup, order, policy)
            sim, layered, copies = plan.sim, plan.layered, len(plan.dropped_after_i()) if deferred else 0
        peak = max(activation_peaks(sim, inputs.stage_bytes, layered))
        out[policy] = {
            "peak_gib": round(peak / 2**30, 2),
            "step_s": round(sim.makespan, 3),
            "queue_copies": copies,
        }
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    from tqdm import tqdm

    cases = [(m, s, r, d) for m in MACHINES for s in SCHEDULES for r in RECOMPUTE for d in (True, False)]
    rows = [row(*case) for case in tqdm(cases, desc="plans", leave=False)]
    print(f"{MODEL}, pp {PP}, seq {SEQ}, {MICROBATCHES} microbatches, bf16: peak GiB / step s / queue copies")
    heads = " ".join(f"{p:>22}" for p in POLICIES)
    print(f"{'machine':7} {'schedule':22} {'recompute':9} {'split':11} {heads}")
    for r in rows:
        cells = " ".join(
            f"{r[p]['peak_gib']:6.2f} / {r[p]['step_s']:5.3f} / {r[p]['queue_copies']:2d}".rjust(22)
            for p in POLICIES
        )
        print(f"{r['machine']:7} {r['schedule']:22} {r['recompute']:9} {r['split']:11} {cells}")
    meta = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": MODEL,
        "pp": PP,
        "seq_len": SEQ,
        "microbatches": MICROBATCHES,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "queue_plan.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
