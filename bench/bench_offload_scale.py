"""PipeOffload at real model sizes: what each offload policy buys on Llama-3 configs (planner model).

Every figure is the planner's (`pp_offload.plan.evaluate`): orders as the schedule classes build them,
offload placed by `pp_offload.order.offload.plan_offload`, replayed by `pp_offload.sim.simulate` with the
per-stage pass times (matmul FLOPs / (peak x MFU)), per-stage saved bytes (`pp_offload.plan.memory`) and
the machine's host link. Activation peak = the largest per-rank peak of saved activations (GiB), step =
the pipeline makespan (dp = 1).

Two parts:

(a) Llama-3-8B (32 layers, h 4096, MLP 14336, vocab 128256, 8 KV heads), pp 4, m 16, seq 4096 and 16384,
    for V-Half, V-ZB and Interleaved1F1B, on the H100 preset (21 GB/s host link), GH200 (NVLink-C2C,
    450 GB/s) and A100 (15 GB/s) (``--quick``: H100 at seq 4096 only). Without recompute: no offload,
    the budgeted layer-by-layer policies (budget = as many layers as hide within 3% step time,
    budget:auto:0.1 within 10%, budget:1 = every layer each chunk's window hides whatever the time: the
    ceiling the windows set) and on H100 also the whole-chunk policies (selective:0.5, full) and
    budget:no-IW-drop (budget without leaving the device between I and W).
    With selective and with full activation recompute (`pp_offload.plan.memory`): alone, and with budget
    offload within what the recompute leaves of 3% and of 10% (``sel+budget@0.1``). On H100 also the
    recompute plans (`pp_offload.recompute_plan`): MLP-only recompute (``mlp``), selective on the first
    share of each stage's layers (``sel:0.75``), and that with ``mlp`` on the other layers
    (``sel:0.75,mlp``), each alone and with budget offload; and sub-layer offload units (``:sublayer``:
    each layer's attention half, then the rest, `pp_offload.order.offload.OffloadPolicy.granularity`)
    without recompute and with ``mlp``, ``mlp:0.75`` and ``sel:0.75,mlp``. Printed first: selective
    recompute's bytes and HBM traffic per op group (`pp_offload.plan.recompute_groups`); last, the H100
    targets before (none, selective or full on every layer) and after the recompute plans, then with
    whole-layer vs sub-layer offload units.
    Targets: peak cut >= 30% at <= +3% step time and >= 50% at <= +10%, against no offload and no
    recompute.
(b) Llama-3-70B (80 layers, h 8192, MLP 28672), seq 8192, H100, pp 4, 8, 16 (``--quick``: 4, 8), m = 2 pp:
    V-Half and Interleaved1F1B, the lowest peak within +10% step time searched by
    `pp_offload.plan.within.lowest_peak_within`: the recompute plan families none, mlp, selective:S,
    selective:S,mlp, full:S,selective and full:S at every share S the stages' layer counts express, each
    family's lowest-peak plan that fits alone, then with budget offload within what it leaves of 10%,
    in whole-layer and in sub-layer units (``budget@0.1:sublayer``; plans that checkpoint every layer
    whole have no sub-layer split and get the layer trial only; trials skipped where the link bound shows
    they cannot beat the best found so far). Target: that peak stays flat from pp 4 to pp 16. Then, at
    pp 8 and 16, the link bound on holding pp 4's best peak (`pp_offload.plan.link_bound`): for every plan
    that fits alone, at the tightest moment of its order, the bytes that must be off the device vs the
    most any placement can have off then (need/can), and vs what one direction of the link carries in
    the +10% step (need/cap); where the target is missed, the split of the gap at that moment
    (`pp_offload.plan.within.WithinResult.gap`): what the best plan's placement has off, what any
    placement could have off in the plain order's timing, and with the step-time room.

Physical bound, printed beside every row that misses a target: cutting a rank's peak by a share X needs
at least X of the bytes its chunks save to be off the device while they wait (every chunk passes through
the peak in a steady pipeline), i.e. X x (bytes the rank's chunks save in a step) copied out *and* back,
while one direction of the host link carries at most step time x bandwidth (with recompute: the share
the offload must still cut after the recompute's own). ``need/cap`` > 1 means the
target is out of reach at that step time, whatever the schedule.

    python bench/bench_offload_scale.py            # all parts (~11 min, 2 busy cores; part (b) ~5 min on one)
    python bench/bench_offload_scale.py --quick    # H100, seq 4096 and pp 4, 8 only (~1 min)
    python bench/bench_offload_scale.py --from-json bench/results/offload_scale.json

Writes ``offload_scale.json`` and ``offload_scale.png`` to ``bench/results`` (or ``--out DIR``).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from offload_scale_report import DEPTH_SLOWDOWN, SHORT, TARGETS, plot, report

from pp_offload.plan.shapes import SHAPES

RESULTS = Path(__file__).resolve().parent / "results"
GIB = float(1 << 30)
LLAMA_8B = SHAPES["llama-3-8b"]
LLAMA_70B = SHAPES["llama-3-70b"]
SCHEDULES = ("ScheduleVHalf", "ScheduleVZB", "ScheduleInterleaved1F1B")
OLD = ("selective:0.5", "full")
NEW = ("budget", "budget:auto:0.1", "budget:1", "budget:no-IW-drop")
# zero-bubble orders keep a chunk from I to W: the same budget without dropping it in between, to measure
# what the I-to-W drop buys
VARIANTS = {"budget:no-IW-drop": {"mode": "budget", "drop_after_i": False}}
# with recompute: none, then budget offload within what the recompute leaves of 3% and of 10%
RECOMPUTE_POLICIES = ("budget@0.03", "budget@0.1")
# H100 rows: every layer's MLP only, selective on a share of each stage's layers (earliest first), alone
# and with the MLP-only recompute on the other layers, every layer, full (pp_offload.recompute_plan)
H100_RECOMPUTE = (
    "mlp",
    "mlp:0.75",
    "selective:0.25",
    "selective:0.5",
    "selective:0.75",
    "selective:0.25,mlp",
    "selective:0.5,mlp",
    "selective:0.75,mlp",
    "selective",
    "full",
)
# sub-layer offload units (each layer's attention half, then the rest: OffloadPolicy.granularity), on the
# H100 rows: without recompute, and with the recompute plans whose bytes and time leave room to offload
SUBLAYER = ("budget:sublayer", "budget:auto:0.1:sublayer")
SUBLAYER_RECOMPUTE = ("mlp", "mlp:0.75", "selective:0.75,mlp")
SUBLAYER_POLICIES = ("budget@0.03:sublayer", "budget@0.1:sublayer")
BASE_STEP: dict[tuple, float] = {}  # (machine, seq, pp, schedule) -> step without recompute or offload
MACHINES_8B = ("H100", "GH200", "A100")
BUDGETS = ("budget", "budget:auto:0.1")  # the GH200/A100 rows (with budget:1)
DEPTH_SCHEDULES = ("ScheduleVHalf", "ScheduleInterleaved1F1B")


def evaluate(
    config: dict, *, machine: str, seq: int, pp: int, m: int, schedule: str, policies, recompute: str = "none"
) -> list[dict]:
    """One schedule with one recompute mode under every policy: step time, activation peak, bytes moved.
    A policy ``"budget@X"`` is budget offload within a step ``X`` slower than ``base_step_s`` (the
    schedule without recompute or offload: the caller's), i.e. what is left of X after the recompute;
    ``"budget@X:sublayer"`` the same with sub-layer units."""
    from pp_offload.plan.evaluate import build_orders, predict, simulation_sizes
    from pp_offload.plan.handoff import planner_setup

    setup = planner_setup(
        config, schedule=schedule, pp=pp, seq_len=seq, microbatch_size=1, num_microbatches=m,
        machine=machine, recompute=recompute,
    )  # fmt: skip
    sizes = simulation_sizes(pp, m, schedule)
    orders = build_orders(setup, sizes, search="auto", virtual_stages=2)
    if orders.error:
        raise RuntimeError(f"{schedule} pp {pp}: {orders.error}")
    # bytes one rank's chunks save over the step (the largest rank)
    rank_saved = max(
        m * sum(setup.stages[s].activation.saved for s in setup.layout.stages_of(r)) for r in range(pp)
    )
    rows = []
    plain_step = None
    for policy in ("none", *policies):
        start = time.perf_counter()
        spec = VARIANTS.get(policy, policy)
        if isinstance(spec, str) and spec.startswith("budget@"):  # room left to a total slowdown
            total, _, unit = spec.removeprefix("budget@").partition(":")
            room = (1.0 + float(total)) * BASE_STEP[(machine, seq, pp, schedule)] / plain_step - 1.0
            if room <= 0:
                continue  # the recompute alone costs more than the total
            spec = {"mode": "budget", "max_slowdown": room} | ({"granularity": unit} if unit else {})
        summary, _ = predict(setup, orders, spec, m)
        if policy == "none":
            plain_step = summary["makespan"]
            if recompute == "none":
                BASE_STEP[(machine, seq, pp, schedule)] = plain_step
        rows.append(
            {
                "schedule": SHORT.get(schedule, schedule),
                "recompute": recompute,
                "policy": policy,
                "step_s": summary["makespan"],
                "activation_gib": max(summary["activation"]) / GIB,
                "activation_per_rank_gib": [a / GIB for a in summary["activation"]],
                "moved_share": summary["moved_share"],
                "chunks_share": summary["offloaded_share"],
                "rank_saved_gib": rank_saved / GIB,
                "plan_seconds": time.perf_counter() - start,
            }
        )
    return rows


def finish(rows: list[dict], host_bandwidth: float) -> list[dict]:
    """Slowdown and cut against the first row (no recompute, no offload) and the link bound of each row:
    the share of the row's saved bytes its offload must still move for each target cut (after what its
    recompute already cut), over what one direction of the link carries in the row's step."""
    base = rows[0]
    plain = {r["recompute"]: r for r in rows if r["policy"] == "none"}
    for row in rows:
        row["slowdown"] = row["step_s"] / base["step_s"] - 1.0
        row["cut"] = 1.0 - row["activation_gib"] / base["activation_gib"]
        cap = row["step_s"] * host_bandwidth / GIB  # GiB one direction of the link carries in the step
        row["link_capacity_gib"] = cap
        own = plain[row["recompute"]]["activation_gib"]
        row["need_ratio"] = {
            f"{cut:.0%}": max(0.0, 1.0 - (1.0 - cut) * base["activation_gib"] / own)
            * row["rank_saved_gib"]
            / cap
            for _, cut in TARGETS
        }
    return rows


def _group(config, *, machine, seq, pp, m, schedule, policies, recompute=None) -> list[dict]:
    """Every recompute plan of one schedule: without recompute under ``policies``, with each plan of
    ``recompute`` (default: selective and full) alone and with budget offload within what it leaves of 3%
    and 10% (``recompute``: plan -> policies)."""
    from pp_offload.plan.machines import resolve_machine

    kw = {"machine": machine, "seq": seq, "pp": pp, "m": m, "schedule": schedule}
    rows = evaluate(config, **kw, policies=policies)
    default = {"selective": RECOMPUTE_POLICIES, "full": RECOMPUTE_POLICIES}
    for mode, more in (recompute or default).items():
        rows += evaluate(config, **kw, policies=more, recompute=mode)
    for row in rows:
        row.update(machine=machine, seq=seq, pp=pp)
    return finish(rows, resolve_machine(machine).host_bandwidth)


def recompute_group_rows(seq: int = 4096) -> list[dict]:
    """Per group of ops selective recompute re-runs in a Llama-3-8B layer (bf16): bytes it frees and HBM
    traffic it costs, per token per hidden unit (`pp_offload.plan.recompute_groups`)."""
    from pp_offload.plan.model import model_spec
    from pp_offload.plan.recompute_groups import recompute_groups

    spec = model_spec(LLAMA_8B)
    unit = seq * spec.hidden_size
    groups = recompute_groups(spec, "bf16", microbatch_size=1, seq_len=seq)
    freed, traffic = sum(g.freed for g in groups), sum(g.traffic for g in groups)
    return [
        {
            "group": g.name,
            "freed_per_token_hidden": g.freed / unit,
            "traffic_per_token_hidden": g.traffic / unit,
            "freed_per_traffic": g.freed_per_traffic,
            "share_of_selective_bytes": g.freed / freed,
            "share_of_selective_time": g.traffic / traffic,
        }
        for g in groups
    ]


def run(quick: bool) -> dict[str, Any]:
    from pp_offload.plan.machines import resolve_machine

    out: dict[str, Any] = {
        "part_a": [],
        "part_b": [],
        "part_b_pruned": [],
        "part_b_seconds": [],
        "part_c": [],
    }
    out["groups"] = recompute_group_rows()
    seqs = (4096,) if quick else (4096, 16384)
    for machine in ("H100",) if quick else MACHINES_8B:
        # the H100 rows with every offload policy; the other machines with the budget ones
        policies = OLD + NEW + SUBLAYER if machine == "H100" else (*BUDGETS, "budget:1")
        plans = H100_RECOMPUTE if machine == "H100" else ("selective", "full")
        extra = SUBLAYER_POLICIES if machine == "H100" else ()
        for seq in seqs:
            for schedule in SCHEDULES:
                out["part_a"] += _group(
                    LLAMA_8B,
                    machine=machine,
                    seq=seq,
                    pp=4,
                    m=16,
                    schedule=schedule,
                    policies=policies,
                    recompute={
                        plan: RECOMPUTE_POLICIES + (extra if plan in SUBLAYER_RECOMPUTE else ())
                        for plan in plans
                    },
                )
                print(f"  8B {machine} seq {seq} {SHORT[schedule]}: done", file=sys.stderr)
    pps = (4, 8) if quick else (4, 8, 16)
    found = {}
    for pp in pps:
        for schedule in DEPTH_SCHEDULES:
            start = time.perf_counter()
            found[(schedule, pp)] = depth_search(schedule, pp)
            rows = _within_rows(found[(schedule, pp)], schedule=schedule, pp=pp)
            out["part_b"] += finish(rows, resolve_machine("H100").host_bandwidth)
            out["part_b_pruned"] += [
                {"schedule": SHORT[schedule], "pp": pp, "plan": plan, "need_can": ratio}
                for plan, ratio in found[(schedule, pp)].pruned.items()
            ]
            seconds = time.perf_counter() - start
            out["part_b_seconds"].append({"schedule": SHORT[schedule], "pp": pp, "seconds": seconds})
            print(f"  70B pp {pp} {SHORT[schedule]}: {seconds:.0f} s", file=sys.stderr)
    out["part_b_bound"] = depth_bounds(found, pps)
    if not quick:
        out["part_c"] = depth_on_other_links()
    return out


def depth_search(schedule: str, pp: int) -> Any:
    """Llama-3-70B part (b): the lowest peak within +10% over the recompute plans (each family at every
    share the stages express, `pp_offload.plan.within`), alone and with budget offload in what they leave."""
    from pp_offload.plan.within import lowest_peak_within

    return lowest_peak_within(
        LLAMA_70B, schedule=schedule, slowdown=DEPTH_SLOWDOWN, pp=pp, seq_len=8192, microbatch_size=1,
        num_microbatches=2 * pp, machine="H100",
    )  # fmt: skip


def _within_rows(found: Any, *, schedule: str, pp: int) -> list[dict]:
    """`lowest_peak_within`'s rows as the bench's rows (the plain one first; ``budget@0.1``: budget offload
    within what the plan leaves of +10%, ``:sublayer`` in sub-layer units)."""
    return [
        {
            "schedule": SHORT[schedule],
            "recompute": r.recompute,
            "policy": "none"
            if r.offload == "none"
            else f"budget@{DEPTH_SLOWDOWN:g}" + (":sublayer" if r.granularity == "sublayer" else ""),
            "units": r.units,
            "step_s": r.step_s,
            "activation_gib": r.peak / GIB,
            "activation_per_rank_gib": [a / GIB for a in r.activation],
            "moved_share": r.moved_share,
            "rank_saved_gib": r.rank_saved / GIB,
            "machine": "H100",
            "seq": 8192,
            "pp": pp,
        }
        for r in found.rows
    ]


def depth_bounds(found: dict, pps: tuple[int, ...]) -> list[dict]:
    """Per schedule and pp beyond the first: whether holding the peak at the first pp's best (with the
    plans and offload within +10%) is within the host link's reach (`pp_offload.plan.link_bound`), for each
    recompute plan that fits alone, in the plain order's timing with the plan's room left as slack; the
    plan with the lowest need/can first. Also the issue's whole-step form: the bytes that must be off the
    device at the tightest moment vs what one direction of the link carries in the step at +10%. Where
    the best misses the target, ``gap``: `WithinResult.gap` of the best row (bytes needed off at the best
    plan's tightest pass, what its placement has off there, what any placement could in the plain timing
    and with the room; GiB), and the stall it implies: the seconds of lane time the plain timing lacks."""
    from pp_offload.plan.machines import resolve_machine

    bandwidth = resolve_machine("H100").host_bandwidth
    out = []
    for schedule in DEPTH_SCHEDULES:
        target = found[(schedule, pps[0])].best.peak
        for pp in pps[1:]:
            result = found[(schedule, pp)]
            plans = []
            for row in result.rows:
                if row.offload != "none" or not result.fits(row):
                    continue
                bound = result.bound(row, target=target, bandwidth=bandwidth)
                plans.append((bound.ratio, row, bound))
            ratio, row, bound = min(plans, key=lambda x: (x[0], x[1].step_s))
            out.append(
                {
                    "schedule": SHORT[schedule],
                    "pp": pp,
                    "target_gib": target / GIB,
                    "reached_gib": result.best.peak / GIB,
                    "plan": row.recompute,
                    "need_can": ratio,
                    "rank": bound.rank,
                    "time_s": bound.time_s,
                    "need_gib": bound.need / GIB,
                    "can_gib": bound.can / GIB,
                    "live_gib": bound.live / GIB,
                    "step_cap_gib": result.limit_s * bandwidth / GIB,
                    "plans": {r.recompute: x for x, r, _ in plans},
                    "gap": _gap(result, target, bandwidth),
                }
            )
    return out


def _gap(result: Any, target: float, bandwidth: float) -> dict | None:
    """`depth_bounds`' ``gap`` (None where the best meets the target or moves nothing)."""
    best = result.best
    if best.peak <= target * (1 + 1e-3) or best.offload == "none":
        return None
    g = result.gap(best, target=target, bandwidth=bandwidth)
    return {
        "plan": best.recompute,
        "units": best.units,
        "rank": g.rank,
        "chunk": list(g.chunk),
        "need_gib": g.need / GIB,
        "off_gib": g.off / GIB,
        "can_plain_gib": g.can_plain / GIB,
        "can_gib": g.can / GIB,
        "stall_s": max(0.0, g.need - g.can_plain) / bandwidth,
        "idle_after_s": g.idle_after,
    }


def depth_on_other_links() -> list[dict]:
    """Llama-3-70B (seq 8192, m = 2 pp) with budget offload and no recompute on the GH200 and A100 presets:
    whether the peak stops growing with depth where the host link is fast (the PipeOffload paper's claim;
    on the H100 preset k = 1.37 > 1, full offload is not free and Interleaved1F1B's peak grows)."""
    from pp_offload.plan.machines import resolve_machine

    rows = []
    for machine in ("GH200", "A100"):
        for pp in (4, 8, 16):
            for schedule in ("ScheduleVHalf", "ScheduleInterleaved1F1B"):
                kw = {"machine": machine, "seq": 8192, "pp": pp, "m": 2 * pp, "schedule": schedule}
                found = evaluate(LLAMA_70B, **kw, policies=("budget",))
                for row in found:
                    row.update(machine=machine, seq=8192, pp=pp)
                rows += finish(found, resolve_machine(machine).host_bandwidth)
            print(f"  70B {machine} pp {pp}: done", file=sys.stderr)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--from-json", type=Path)
    args = parser.parse_args(argv)
    if args.from_json:
        data = json.loads(args.from_json.read_text())
        out = data["results"]
    else:
        start = time.perf_counter()
        out = run(args.quick)
        data = {
            "bench": "offload_scale",
            "quick": args.quick,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "python": platform.python_version(),
            "seconds": time.perf_counter() - start,
            "results": out,
        }
    print(report(out))
    args.out.mkdir(parents=True, exist_ok=True)
    name = "offload_scale_quick" if data.get("quick") else "offload_scale"
    if not args.from_json:
        (args.out / f"{name}.json").write_text(json.dumps(data, indent=1))
    plot(out, args.out / f"{name}.png")
    print(f"\nwrote {args.out / (name + '.json')} and {args.out / (name + '.png')}")


if __name__ == "__main__":
    main()
