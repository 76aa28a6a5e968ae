"""Hybrid pipeline x data parallelism at a fixed world size: pp 2 x dp 2 against pp 4, on 4 CPU processes.

Why: with a fixed number of devices, a pipeline can be made longer (pp 4) or be replicated (pp 2 x dp 2,
each stage sharded with FSDP2 over its data-parallel pair). The shorter pipeline has fewer, bigger stages
and half the microbatches per pipeline; this measures what that does to step time (bubble, FSDP's
collectives) and to peak activation memory per rank, schedule by schedule, on the same model and the same
global batch, side by side in one run.

Emulated part (default). The model is ``--layers`` layers (default 16), each costing ``--layer-costs``
F:I:W milliseconds per microbatch (slept, `pp_offload.emulate`: wall time independent of the cores) and
saving ``--layer-act-mib`` MiB of activations per microbatch, held from its forward until its weight-grad
pass (W, or B). It is cut into 8 chunks of L/8 layers, each a seeded `EmulatedStage`, so both layouts
compute the same function of the same weights:

- pp 4 x dp 1: 8 stages of one chunk, all ``--microbatches`` M microbatches through one pipeline;
- pp 2 x dp 2: 4 stages of two chunks, M/2 microbatches per pipeline (each pipeline takes half of the
  global batch); every stage module is an FSDP2 root over its dp pair (`pp_offload.parallel.apply_fsdp`,
  one unit per stage), so torch's runtime all-gathers it before its first pass and reduce-scatters its
  gradient once per step (sum over the pair: the summed loss gives the pp 4 gradient exactly).

Two stages per rank for every schedule (V placement for ours, loop placement for ScheduleInterleaved1F1B).
Per configuration: ``--warmup`` steps, then ``--steps`` timed steps (a barrier before each; median of the
makespan over all 4 ranks). Memory is measured: the peak, per rank, of the emulated activations alive at
once (`pp_offload.emulate.saved_activation_bytes`: freed when autograd frees them, so the order as torch
executed it, stage 0's deferred backward included); and simulated: the peak of the schedule's own
``pipeline_order`` read as torch executes it (`pp_offload.sim.as_executed_by_torch`) in chunk units, times
the bytes of a chunk (half a rank's layers). The simulator also predicts the step time (point-to-point
latency measured, FSDP collectives not modelled: the gap to the realized time shows what they cost).
Losses and gradients of every configuration are compared with pp 4's.

Recipe part (``--recipe``): ``recipes/finetune.py`` with ``recipes/configs/tiny_llama.yaml`` under
``torchrun --standalone --nproc-per-node 4`` for ``pipeline.dp`` = 1 (pp 4, 8 microbatches) and 2 (pp 2,
4 microbatches per pipeline; same global batch and microbatch size), reading tokens/s from the run's
``summary.json`` and ``metrics.csv`` (median over the steps after the first). This is real compute: the 4
processes share the machine's cores.

    python bench/bench_hybrid.py --recipe          # both parts: 5 schedules, M = 16, 3 rounds; the recipe
                                                   # with V-Half and Interleaved1F1B, 2 runs each (~8 min)
    python bench/bench_hybrid.py                   # the emulated part only (~3 min)
    python bench/bench_hybrid.py --quick --recipe  # 4 schedules, M = 8, 2 rounds; recipe V-Half once (~2 min)
    python bench/bench_hybrid.py --recipe-only     # only the recipe part

Writes bench/results/hybrid.json and bench/results/hybrid.png.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parent.parent
WORLD = 4
CHUNKS = 8  # the model's chunks: one per stage of pp 4 (2 stages per rank)
LAYOUTS: tuple[tuple[int, int], ...] = ((4, 1), (2, 2))  # (pp, dp), the reference first
SCHEDULES = (
    "ScheduleVHalf",
    "ScheduleVMin",
    "ScheduleVZB",
    "ScheduleZBVZeroBubble",
    "ScheduleInterleaved1F1B",
)
QUICK_SCHEDULES = ("ScheduleVHalf", "ScheduleVMin", "ScheduleVZB", "ScheduleInterleaved1F1B")
MIB = 1 << 20


@dataclass(frozen=True)
class Config:
    schedule: str
    pp: int
    dp: int

    @property
    def name(self) -> str:
        return f"pp{self.pp}" if self.dp == 1 else f"pp{self.pp}xdp{self.dp}"


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="4 schedules, M = 8, 2 rounds of 1 + 3 steps")
    p.add_argument("--schedules", nargs="+", default=None, help=f"default: {' '.join(SCHEDULES)}")
    p.add_argument("--layers", type=int, default=16, help="layers of the emulated model (a multiple of 8)")
    p.add_argument("--microbatches", type=int, default=None, help="M, the global batch (default 16; quick 8)")
    p.add_argument("--layer-costs", default="3:4:2", help="F:I:W of one layer and microbatch, in ms")
    p.add_argument(
        "--layer-act-mib", type=float, default=1.0, help="activations one layer saves per microbatch"
    )
    p.add_argument("--hidden", type=int, default=64, help="width of the emulated stages (their parameters)")
    p.add_argument("--microbatch-size", type=int, default=2)
    p.add_argument("--warmup", type=int, default=None, help="default 2 (quick 1)")
    p.add_argument(
        "--steps", type=int, default=None, help="timed steps per config and round (default 5; quick 3)"
    )
    p.add_argument("--rounds", type=int, default=None, help="passes over all configs (default 3; quick 2)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds for gloo ops and for any one config")
    p.add_argument("--recipe", action="store_true", help="also run the fine-tuning recipe (tokens/s)")
    p.add_argument("--recipe-only", action="store_true", help="only the recipe part")
    p.add_argument("--recipe-steps", type=int, default=8)
    p.add_argument("--recipe-schedules", nargs="+", default=None, help="default VHalf, Interleaved1F1B")
    p.add_argument(
        "--recipe-repeats", type=int, default=None, help="runs per config, interleaved (default 2)"
    )
    p.add_argument("--recipe-timeout", type=float, default=600.0, help="seconds for one recipe run")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    args.schedules = args.schedules or list(QUICK_SCHEDULES if args.quick else SCHEDULES)
    args.microbatches = args.microbatches or (8 if args.quick else 16)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    args.steps = args.steps or (3 if args.quick else 5)
    args.rounds = args.rounds or (2 if args.quick else 3)
    args.recipe_repeats = args.recipe_repeats or (1 if args.quick else 2)
    args.recipe_schedules = args.recipe_schedules or (
        ["ScheduleVHalf"] if args.quick else ["ScheduleVHalf", "ScheduleInterleaved1F1B"]
    )
    if args.layers % CHUNKS:
        p.error(f"--layers must be a multiple of {CHUNKS}")
    if args.microbatches % 2:
        p.error("--microbatches must be even (pp 2 x dp 2 gives each pipeline half)")
    args.recipe = args.recipe or args.recipe_only
    return args


def _layer_ms(args: argparse.Namespace) -> tuple[float, float, float]:
    f, i, w = (float(v) for v in args.layer_costs.split(":"))
    return f, i, w


# --------------------------------------------------------------------------------------------------------
# Worker side (one process per rank, `pp_offload.local_ranks.run_on_ranks`)


def _worker(rank: int, world: int, configs: list[Config], args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from pp_offload.emulate import measure_p2p_latency
    from pp_offload.local_ranks import send
    from pp_offload.parallel import build_mesh

    comm_s = measure_p2p_latency(shape=(args.microbatch_size, args.hidden))  # ranks 0 and 1: a pipeline pair
    meshes = {dp: build_mesh(WORLD // dp, dp, device_type="cpu") for _, dp in LAYOUTS if dp > 1}
    if rank == 0:
        send("ready")
    for round_ in range(args.rounds):  # interleaved rounds: load from other processes spreads over all
        for config in configs:
            record = _run_config(rank, config, args, comm_s, meshes.get(config.dp))
            if rank == 0:
                send("result", {**record, "round": round_})
    dist.barrier()


def _stage_module(stage: int, chunks_per_stage: int, args: argparse.Namespace) -> Any:
    """Chunks ``stage * k ... stage * k + k - 1`` in sequence (k = chunks per stage), seeded by chunk."""
    from torch import nn

    from pp_offload.emulate import EmulatedStage, PassCosts

    per_chunk = args.layers // CHUNKS
    f, i, w = _layer_ms(args)
    costs = PassCosts(F=f * per_chunk / 1e3, I=i * per_chunk / 1e3, W=w * per_chunk / 1e3)
    saved = int(args.layer_act_mib * MIB * per_chunk)
    chunks = [
        EmulatedStage(args.hidden, costs, first=(c == 0), seed=c, saved_bytes=saved)
        for c in range(stage * chunks_per_stage, (stage + 1) * chunks_per_stage)
    ]
    return chunks[0] if len(chunks) == 1 else nn.Sequential(*chunks)


def _run_config(rank: int, config: Config, args: argparse.Namespace, comm_s: float, mesh: Any) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    from pp_offload.emulate import emulated_modules, saved_activation_bytes
    from pp_offload.order import Costs
    from pp_offload.parallel import apply_fsdp, dp_rank, pp_rank
    from pp_offload.runtime.catalog import build_schedule, schedule_info, stage_indices

    info = schedule_info(config.schedule)
    pp, dp = config.pp, config.dp
    my_pp, my_dp = (pp_rank(mesh), dp_rank(mesh)) if mesh is not None else (rank, 0)
    group = mesh["pp"].get_group() if mesh is not None else None
    num_stages = 2 * pp
    chunks_per_stage = CHUNKS // num_stages
    microbatches = args.microbatches // dp
    modules = {s: _stage_module(s, chunks_per_stage, args) for s in stage_indices(my_pp, pp, info.placement)}
    if mesh is not None:
        # no decoder layers here: each stage module is one FSDP unit (its root)
        sharded = apply_fsdp(modules, mesh, split_backward=info.split_backward, layers=lambda stage: [])
        modules = sharded.modules

    def example(requires_grad: bool) -> torch.Tensor:
        return torch.zeros(args.microbatch_size, args.hidden, requires_grad=requires_grad)

    stages = [
        PipelineStage(
            module,
            s,
            num_stages,
            torch.device("cpu"),
            input_args=example(s != 0),
            output_args=example(True),
            group=group,
        )
        for s, module in modules.items()
    ]
    f, i, w = (v * chunks_per_stage * args.layers / CHUNKS for v in _layer_ms(args))  # ms per stage
    stage_costs = Costs(F=f, I=i, W=w, comm=comm_s * 1e3)
    kwargs: dict[str, Any] = {"loss_fn": torch.nn.functional.mse_loss, "scale_grads": False}
    if info.module == "pp_offload.runtime.schedules":
        kwargs["costs"] = stage_costs
    schedule = build_schedule(info, stages, microbatches, **kwargs)
    if mesh is not None:
        sharded.attach(schedule)
    from torch.distributed.tensor import DTensor

    fsdp_sharded = all(isinstance(p, DTensor) for m in modules.values() for p in m.parameters())

    gen = torch.Generator().manual_seed(1234)
    rows = args.microbatches * args.microbatch_size
    x_all, t_all = (
        torch.randn(rows, args.hidden, generator=gen),
        torch.randn(rows, args.hidden, generator=gen),
    )
    mine = slice(my_dp * rows // dp, (my_dp + 1) * rows // dp)
    x, target = x_all[mine], t_all[mine]
    has_first = any(st.is_first for st in stages)
    has_last = any(st.is_last for st in stages)
    chunks = emulated_modules(stages)
    meter = saved_activation_bytes()

    makespans: list[float] = []
    busy: list[list[float]] = []
    losses: list[float] = []
    peaks = [0] * WORLD
    leftover = 0
    for step in range(args.warmup + args.steps):
        for chunk in chunks:
            chunk.log.clear()
        for module in modules.values():
            module.zero_grad(set_to_none=True)
        step_losses: list[torch.Tensor] = []
        meter.reset_peak()
        before = meter.live
        dist.barrier()
        start = time.perf_counter()
        schedule.step(
            *((x,) if has_first else ()), **({"target": target, "losses": step_losses} if has_last else {})
        )
        end = time.perf_counter()
        done = sum(e - s for chunk in chunks for _, s, e in chunk.log)
        loss = float(torch.stack([v.detach() for v in step_losses]).sum()) if step_losses else 0.0
        row = torch.tensor([start, end, done, loss, meter.peak - before, meter.live], dtype=torch.float64)
        gathered = [torch.zeros_like(row) for _ in range(WORLD)]
        dist.all_gather(gathered, row)
        if step < args.warmup:
            continue
        makespans.append(max(g[1].item() for g in gathered) - min(g[0].item() for g in gathered))
        busy.append([g[2].item() for g in gathered])
        losses.append(sum(g[3].item() for g in gathered))  # every pipeline's last stage: the global loss
        peaks = [max(p, int(g[4].item())) for p, g in zip(peaks, gathered, strict=True)]
        leftover = max(leftover, *(int(g[5].item()) for g in gathered))

    grads = _full_grads(
        modules, chunks_per_stage
    )  # of the last step; collective over dp (same calls on both replicas)
    every: list[dict[int, Any]] = [{} for _ in range(WORLD)]
    dist.all_gather_object(every, grads)
    dist.barrier()
    if rank != 0:
        return {}

    from pp_offload.sim import as_executed_by_torch, simulate

    predicted = simulate(as_executed_by_torch(schedule.pipeline_order), stage_costs)
    unit_bytes = args.layer_act_mib * MIB * args.layers / (2 * pp)  # a sim chunk: half a rank's layers
    return {
        "config": config.name,
        "schedule": config.schedule,
        "pp": pp,
        "dp": dp,
        "microbatches_per_pipeline": microbatches,
        "stage_ms": {"F": f, "I": i, "W": w},
        "comm_ms": comm_s * 1e3,
        "realized_steps_ms": [m * 1e3 for m in makespans],
        "realized_step_bubbles": [1.0 - max(b) / m for b, m in zip(busy, makespans, strict=True)],
        "predicted_ms": predicted.makespan,
        "predicted_bubble": predicted.bubble,
        "peak_mib_per_rank": [p / MIB for p in peaks],
        "peak_mib": max(peaks) / MIB,
        "sim_peak_chunks_per_pp_rank": [predicted.peak_memory[r] for r in sorted(predicted.peak_memory)],
        "sim_peak_mib_per_pp_rank": [
            predicted.peak_memory[r] * unit_bytes / MIB for r in sorted(predicted.peak_memory)
        ],
        "sim_peak_mib": predicted.peak * unit_bytes / MIB,
        "leftover_mib": leftover / MIB,
        "fsdp_sharded": fsdp_sharded,
        "loss": statistics.median(losses),
        "grads": {c: g for rank_grads in every for c, g in rank_grads.items()},
    }


def _full_grads(modules: dict[int, Any], chunks_per_stage: int) -> dict[int, Any]:
    """Chunk index -> its weight's whole gradient (FSDP shards gathered)."""
    from torch.distributed.tensor import DTensor

    from pp_offload.emulate import emulated_modules

    out = {}
    for s in sorted(modules):
        for k, chunk in enumerate(emulated_modules([modules[s]])):
            grad = chunk.weight.grad
            if isinstance(grad, DTensor):
                grad = grad.full_tensor()
            out[s * chunks_per_stage + k] = grad.detach().clone()
    return out


# --------------------------------------------------------------------------------------------------------
# Recipe part


def _recipe_run(dp: int, schedule: str, args: argparse.Namespace) -> dict[str, Any]:
    """One torchrun of the recipe on 4 processes; tokens/s and losses, or the error it stopped with."""
    microbatches = 8 // dp  # global batch 16 in 8 microbatches of 2 (pp 4) or 2 x 4 microbatches of 2
    record: dict[str, Any] = {
        "config": "pp4" if dp == 1 else f"pp{WORLD // dp}xdp{dp}",
        "schedule": schedule,
        "dp": dp,
        "pp": WORLD // dp,
        "microbatches_per_pipeline": microbatches,
        "steps": args.recipe_steps,
    }
    with tempfile.TemporaryDirectory(prefix="bench_hybrid_") as tmp:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD),
            "recipes/finetune.py", "--config", "recipes/configs/tiny_llama.yaml", "--no-progress",
            "--output-dir", tmp,
            "--set", f"train.steps={args.recipe_steps}",
            "--set", "output.save_every=0",
            "--set", "output.export=false",
            "--set", "output.timeline=false",
            "--set", f"pipeline.dp={dp}",
            "--set", f"pipeline.microbatches={microbatches}",
            "--set", f"pipeline.schedule={schedule}",
        ]  # fmt: skip
        record["command"] = " ".join(cmd[2:])
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        start = time.monotonic()
        try:
            done = subprocess.run(
                cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.recipe_timeout
            )
        except subprocess.TimeoutExpired:
            record["error"] = f"timed out after {args.recipe_timeout:.0f} s"
            return record
        record["wall_s"] = time.monotonic() - start
        summary = Path(tmp) / "summary.json"
        if done.returncode != 0 or not summary.exists():
            record["error"] = _recipe_error(done.stderr + done.stdout, done.returncode)
            return record
        data = json.loads(summary.read_text())
        record["tokens_per_s"] = data["tokens_per_s"]
        record["final_loss"] = data["losses"][-1] if data.get("losses") else None
        metrics = Path(tmp) / "metrics.csv"
        if metrics.exists():
            with metrics.open() as fh:
                rows = [r for r in csv.DictReader(fh) if r.get("tokens_per_s")]
            per_step = [float(r["tokens_per_s"]) for r in rows]
            record["tokens_per_s_steps"] = per_step
            # process max RSS of rank 0 on CPU (libraries included): not an activation measure
            record["rank0_max_rss_mib"] = max((float(r["device_peak_mib"]) for r in rows), default=None)
            if len(per_step) > 1:
                record["tokens_per_s_after_first"] = statistics.median(per_step[1:])
    return record


def _recipe_error(output: str, returncode: int) -> str:
    """The ranks' own error line, not torchrun's report that follows it."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    cut = next((i for i, ln in enumerate(lines) if "torch/distributed/elastic" in ln), len(lines))
    ours = lines[:cut]
    errors = [ln for ln in ours if "rror" in ln]
    found = errors[-1] if errors else (ours[-1] if ours else f"exit code {returncode}")
    return found[:400]


# --------------------------------------------------------------------------------------------------------
# Driver side


def _check(records: list[dict[str, Any]]) -> list[str]:
    """Every configuration computes the same function: its loss and gradients must be pp 4's."""
    import torch

    problems = []
    ref = next((r for r in records if r["dp"] == 1), None)
    for r in records:
        if ref is None or r is ref:
            continue
        if abs(r["loss"] - ref["loss"]) > 1e-4 * max(1.0, abs(ref["loss"])):
            problems.append(f"{r['config']} {r['schedule']}: loss {r['loss']:.6f} != {ref['loss']:.6f}")
        worst = max(
            float((r["grads"][c] - g).abs().max() / g.abs().max().clamp_min(1e-12))
            for c, g in ref["grads"].items()
        )
        r["grad_max_rel_diff_vs_ref"] = worst
        if not torch.isfinite(torch.tensor(worst)) or worst > 1e-4:
            problems.append(
                f"{r['config']} {r['schedule']}: gradients differ from the reference by {worst:.2e}"
            )
    return problems


def _merge(raw: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """One record per (config, schedule) from its rounds: step times and bubbles pooled (median), memory
    peaks the largest seen, predictions from the first round (every round builds the same order)."""
    merged: dict[tuple[str, str], dict[str, Any]] = {}
    for r in raw:
        key = (r["config"], r["schedule"])
        if key not in merged:
            merged[key] = {k: v for k, v in r.items() if k not in ("grads", "round")}
            merged[key]["round_medians_ms"] = []
            continue
        m = merged[key]
        m["realized_steps_ms"] = m["realized_steps_ms"] + r["realized_steps_ms"]
        m["realized_step_bubbles"] = m["realized_step_bubbles"] + r["realized_step_bubbles"]
        m["peak_mib_per_rank"] = [
            max(a, b) for a, b in zip(m["peak_mib_per_rank"], r["peak_mib_per_rank"], strict=True)
        ]
        m["peak_mib"] = max(m["peak_mib"], r["peak_mib"])
        m["leftover_mib"] = max(m["leftover_mib"], r["leftover_mib"])
    for (name, schedule), m in merged.items():
        rounds = [r for r in raw if (r["config"], r["schedule"]) == (name, schedule)]
        m["round_medians_ms"] = [statistics.median(r["realized_steps_ms"]) for r in rounds]
        m["rounds"] = len(rounds)
        m["realized_ms"] = statistics.median(m["realized_steps_ms"])
        m["realized_bubble"] = statistics.median(m["realized_step_bubbles"])
        m["samples_per_s"] = args.microbatches * args.microbatch_size / (m["realized_ms"] / 1e3)
        diffs = [r["grad_max_rel_diff_vs_ref"] for r in rounds if "grad_max_rel_diff_vs_ref" in r]
        if diffs:
            m["grad_max_rel_diff_vs_ref"] = max(diffs)
    return list(merged.values())


def _merge_recipe(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per (config, schedule) from its repeated runs: the median of the runs' summary tokens/s,
    and the median of every run's per-step figures from step 2 on; a failed run's error is kept."""
    merged: dict[tuple[str, str], dict[str, Any]] = {}
    for run in runs:
        key = (run["config"], run["schedule"])
        m = merged.setdefault(
            key, {k: run[k] for k in ("config", "schedule", "dp", "pp", "microbatches_per_pipeline", "steps")}
        )
        m.setdefault("runs", []).append(run)
    for m in merged.values():
        good = [r for r in m["runs"] if "tokens_per_s" in r]
        failed = [r for r in m["runs"] if "error" in r]
        if failed:
            m["error"] = failed[-1]["error"]
        if not good:
            continue
        m["tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in good)
        steps = [t for r in good for t in r.get("tokens_per_s_steps", [])[1:]]
        if steps:
            m["tokens_per_s_after_first"] = statistics.median(steps)
        losses = [r["final_loss"] for r in good if r.get("final_loss") is not None]
        m["final_loss"] = losses[-1] if losses else None
        m["wall_s"] = statistics.median(r["wall_s"] for r in good)
        m["repeats"] = len(good)
    return list(merged.values())


def _table(records: list[dict[str, Any]]) -> str:
    ref = {r["schedule"]: r for r in records if r["dp"] == 1}
    head = (
        f"{'config':<9}{'schedule':<25}{'m/pipe':>6}{'step ms':>9}{'pred ms':>9}{'real/pred':>10}"
        f"{'bubble sim':>11}{'real':>6}{'peak MiB':>9}{'sim':>6}{'vs pp4':>7}  {'per rank (MiB)':<20}"
        f"{'samples/s':>10}"
    )
    lines = [head, "-" * len(head)]
    for r in records:
        base = ref.get(r["schedule"])
        rel = r["peak_mib"] / base["peak_mib"] if base and base["peak_mib"] else float("nan")
        per_rank = "/".join(f"{p:.0f}" for p in r["peak_mib_per_rank"])
        lines.append(
            f"{r['config']:<9}{r['schedule']:<25}{r['microbatches_per_pipeline']:>6}{r['realized_ms']:>9.1f}"
            f"{r['predicted_ms']:>9.1f}{r['realized_ms'] / r['predicted_ms']:>10.3f}"
            f"{r['predicted_bubble']:>11.3f}{r['realized_bubble']:>6.3f}{r['peak_mib']:>9.1f}"
            f"{r['sim_peak_mib']:>6.0f}{rel:>7.2f}  {per_rank:<20}{r['samples_per_s']:>10.1f}"
        )
    return "\n".join(lines)


def _recipe_table(records: list[dict[str, Any]]) -> str:
    head = (
        f"{'config':<9}{'schedule':<25}{'m/pipe':>6}{'runs':>5}{'tokens/s':>10}{'after 1st':>11}{'vs pp4':>8}"
        f"{'loss':>8}{'wall s':>8}"
    )
    lines = [head, "-" * len(head)]
    ref = {r["schedule"]: r.get("tokens_per_s_after_first") for r in records if r["dp"] == 1}
    for r in records:
        if "tokens_per_s" not in r:
            lines.append(
                f"{r['config']:<9}{r['schedule']:<25}{r['microbatches_per_pipeline']:>6}  {r.get('error')}"
            )
            continue
        after, loss, base = r.get("tokens_per_s_after_first"), r.get("final_loss"), ref.get(r["schedule"])
        rel = after / base if after and base else float("nan")
        lines.append(
            f"{r['config']:<9}{r['schedule']:<25}{r['microbatches_per_pipeline']:>6}{r['repeats']:>5}"
            f"{r['tokens_per_s']:>10.0f}{'-' if after is None else format(after, '.0f'):>11}{rel:>8.2f}"
            f"{'-' if loss is None else format(loss, '.4f'):>8}{r['wall_s']:>8.0f}"
        )
    return "\n".join(lines)


def _plot(records: list[dict[str, Any]], recipe: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in recipe if "tokens_per_s" in r]
    panels = (2 if records else 0) + (1 if ok else 0)
    if not panels:
        return
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 5.5), squeeze=False)
    axes = list(axes[0])
    order = [f"pp{pp}" if dp == 1 else f"pp{pp}xdp{dp}" for pp, dp in LAYOUTS]
    colours = {c: plt.cm.tab10(i) for i, c in enumerate(order)}
    if records:
        names = list(dict.fromkeys(r["schedule"] for r in records))
        configs = [c for c in order if any(r["config"] == c for r in records)]
        width = 0.8 / max(1, len(configs))
        by = {(r["schedule"], r["config"]): r for r in records}
        for ax, key, sim_key, label in (
            (
                axes[0],
                "realized_ms",
                "predicted_ms",
                "emulated step time, ms (bars: realized median; x: sim)",
            ),
            (
                axes[1],
                "peak_mib",
                "sim_peak_mib",
                "peak activation memory per rank, MiB (bars: measured; x: sim)",
            ),
        ):
            for j, c in enumerate(configs):
                xs = [i + (j - (len(configs) - 1) / 2) * width for i in range(len(names))]
                vals = [by[(n, c)][key] if (n, c) in by else 0.0 for n in names]
                sims = [by[(n, c)][sim_key] if (n, c) in by else float("nan") for n in names]
                ax.bar(xs, vals, width, color=colours[c], label=c)
                ax.scatter(xs, sims, color="black", marker="x", zorder=3, s=30)
            ax.set_xticks(range(len(names)))
            ax.set_xticklabels([n.removeprefix("Schedule") for n in names], rotation=20, ha="right")
            ax.set_title(label, fontsize=10)
            ax.legend(fontsize=8)
    if ok:
        ax = axes[-1]
        steady = [r.get("tokens_per_s_after_first", r["tokens_per_s"]) for r in ok]
        ax.bar(range(len(ok)), steady, color=[colours.get(r["config"], "grey") for r in ok])
        ax.scatter(range(len(ok)), [r["tokens_per_s"] for r in ok], color="black", marker="x", zorder=3, s=30)
        ax.set_xticks(range(len(ok)))
        ax.set_xticklabels([f"{r['config']}\n{r['schedule'].removeprefix('Schedule')}" for r in ok])
        ax.set_title(
            "recipe, tiny Llama on 4 CPU processes: tokens/s\n(bars: steps 2+ median; x: summary)",
            fontsize=10,
        )
    fig.suptitle("pp 4 vs pp 2 x dp 2 on 4 processes: same model, same global batch", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    from tqdm import tqdm

    from pp_offload.local_ranks import run_on_ranks

    configs = [] if args.recipe_only else [Config(s, pp, dp) for s in args.schedules for pp, dp in LAYOUTS]
    recipe_runs = [
        (dp, s) for _ in range(args.recipe_repeats) for s in args.recipe_schedules for _, dp in LAYOUTS
    ]
    recipe_runs = recipe_runs if args.recipe else []
    records: list[dict[str, Any]] = []
    recipe: list[dict[str, Any]] = []
    bar = tqdm(
        total=len(configs) * args.rounds + len(recipe_runs),
        desc="configs",
        unit="cfg",
        disable=args.no_progress,
        file=sys.stderr,
    )

    def on_message(rank: int, kind: str, record: Any) -> None:
        if kind == "result":
            records.append(record)
            bar.set_postfix_str(f"{record['config']} {record['schedule']}")
            bar.update(1)

    start = time.monotonic()
    load_start = os.getloadavg()
    try:
        if configs:
            run_on_ranks(
                _worker,
                WORLD,
                configs,
                args,
                timeout=(len(configs) * args.rounds + 2) * args.timeout,
                idle_timeout=args.timeout,
                op_timeout=args.timeout,
                on_message=on_message,
            )
        for dp, schedule in recipe_runs:
            bar.set_postfix_str(f"recipe dp={dp} {schedule}")
            recipe.append(_recipe_run(dp, schedule, args))
            bar.update(1)
    except Exception:
        bar.close()
        traceback.print_exc()
        return 1
    bar.close()

    problems = _check(records)
    records = _merge(records, args)
    recipe = _merge_recipe(recipe)
    if records:
        print(_table(records))
        print(
            "step ms: realized median makespan over 4 ranks; pred ms: simulator on the schedule's order as "
            "torch runs it (p2p latency measured, FSDP collectives not modelled); bubble: 1 - busiest rank's "
            "emulated compute / step; peak MiB: measured peak of live saved activations, fullest rank; sim: "
            "the simulator's peak (chunk units x chunk bytes); vs pp4: measured peak / pp4's with the same "
            "schedule; per rank: measured peaks of ranks 0-3 (pp2xdp2: rank = dp * 2 + pp)."
        )
        for p in problems:
            print("MISMATCH:", p)
    if recipe:
        print()
        print(_recipe_table(recipe))
        print(
            "tokens/s: median over the runs of the recipe's summary figure (all steps); after 1st: median of "
            "the runs' metrics.csv per-step figures from step 2 on; vs pp4: after 1st / pp4's; loss: final "
            "step's; 4 processes share this machine's cores (real compute, not emulated)."
        )

    args.out.mkdir(parents=True, exist_ok=True)
    f, i, w = _layer_ms(args)
    meta = {
        "world": WORLD,
        "layers": args.layers,
        "chunks": CHUNKS,
        "layer_ms": {"F": f, "I": i, "W": w},
        "layer_act_mib": args.layer_act_mib,
        "global_microbatches": args.microbatches,
        "microbatch_size": args.microbatch_size,
        "hidden": args.hidden,
        "warmup": args.warmup,
        "steps": args.steps,
        "rounds": args.rounds,
        "quick": args.quick,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "torch": __import__("torch").__version__,
        "wall_s": time.monotonic() - start,
        "loadavg_1_5_15_start": load_start,
        "loadavg_1_5_15_end": os.getloadavg(),
        "losses_and_grads_agree": not problems,
        "problems": problems,
    }
    doc = {"meta": meta, "configs": [asdict(c) for c in configs], "emulated": records, "recipe": recipe}
    (args.out / "hybrid.json").write_text(json.dumps(doc, indent=1))
    _plot(records, recipe, args.out / "hybrid.png")
    print(f"wrote {args.out / 'hybrid.json'} and {args.out / 'hybrid.png'} ({meta['wall_s']:.0f} s)")
    failed = [f"{r['config']} {r['schedule']}" for r in recipe if "tokens_per_s" not in r]
    if failed:
        print("RECIPE FAILED:", ", ".join(failed))
    return 1 if problems or failed else 0


if __name__ == "__main__":
    sys.exit(main())
