"""One pipeline rank executed for real on one GPU: memory, step time and copy overlap of offload policies.

Why: every offload claim (device memory saved, copies hidden behind compute) rests on the planner's model
and the simulator. This runs what a rank of a real pipeline runs, on the real model size, and puts the
measurements next to the predictions. One GPU cannot hold a whole Llama-3-8B pipeline, but it can hold
one rank: the rank's stages of a Llama-3-8B-shaped model (bf16, the planner's layer split), driven by
torch's pipelining runtime through the rank's lowered order, OFFLOAD/RELOAD actions included. The other
ranks are absent: a fake process group (`pp_offload.runtime.compat.init_fake_process_group`) completes
every send and receive at once, so receives keep the values the bench puts in their buffers and sends
are dropped. Compute, device memory and host copies are the real ones. Alone, the rank never waits for
a peer, so its bubbles vanish and a copy has less time to hide than in the pipeline: "paced" steps
(`Pacer`) hold each pass whose input comes from another rank until the simulated time it would arrive.
Steps pass ``return_outputs=False`` as the recipe does (the last stage keeps no logits for the step's
return value).

For each (schedule, offload, recompute) configuration it measures:

- device memory: ``torch.cuda.max_memory_allocated`` during a step, above the state held between steps
  (weights, gradients, receive buffers), and whole, next to the planner's prediction for that rank
  (`pp_offload.plan`, same model, machine preset, split, calibrated mfu and measured host bandwidth);
- step time alone and paced (medians of ``--steps``), and the paced offload overhead against the same
  schedule without offload, next to the simulator's: the runtime's own offload plan (placed with the
  planner's figures, `pp_offload.plan.offload_inputs`) replayed with those costs;
- from a torch profiler trace of one step: the share of device<->host copy time during which a compute
  kernel ran, kernel time per class (matmul, attention, other), and a timeline plot;
- the synchronizing CUDA calls of one step with their call sites (torch's sync debug mode);
- a memory timeline (allocated bytes after every action of one synchronized step).

The planner's ``mfu`` is calibrated so that its forward time equals the median forward measured in a
first V-Half step (each action timed with the device synchronized,
`pp_offload.runtime.timing.record_actions`); the host bandwidth comes from pinned copies of 1 GiB each way.

    python bench/bench_gpu_replay.py                        # on a CUDA machine: bench/results/gpu/
    python bench/bench_gpu_replay.py --tiny --device cpu    # a smoke run of the same code on CPU
    python bench/bench_gpu_replay.py --replan bench/results/gpu/replay_seq4096.json   # no GPU: re-predict
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from gpu_replay.measure import (
    Pacer,
    copy_overlap,
    host_syncs,
    measure_host_bandwidth,
    memory_timeline,
    pass_times,
    run_step,
    state_bytes,
    sync_check,
)
from gpu_replay.predict import calibrate_mfu, prepare, simulated_offload
from gpu_replay.rank import GIB, TINY_SHAPE, Config, free, ready_rank, synchronize
from gpu_replay.report import compiled_table, git_commit, plot, replan, tables, write_results

RESULTS = Path(__file__).resolve().parent / "results" / "gpu"


DEFAULT_CONFIGS = (
    "ScheduleVHalf/none/none",
    "ScheduleVHalf/full/none",
    "ScheduleVHalf/budget:auto:0.1/none",
    "ScheduleVHalf/none/selective",
    "ScheduleVHalf/budget:auto:0.1/selective",
    "ScheduleVHalf/none/full",
    "ScheduleVHalf/none/mlp",
    "ScheduleVHalf/budget:auto:0.1/selective:0.75,mlp",
    "ScheduleVZB/none/none",
    "ScheduleVZB/budget:auto:0.1/selective",
    "ScheduleVZB/budget:sublayer/mlp",
    "Interleaved1F1B/none/none",
    "Interleaved1F1B/full/none",
    "Interleaved1F1B/budget:auto:0.1/none",
)
"""schedule/offload/recompute triples measured by default."""


def validate_configs(texts: list[str], *, compiled: bool = False) -> list[Config]:
    """Every configuration parsed and its schedule, offload policy and recompute plan checked before anything
    is built (``compiled``: also that the recompute plan compiles). Why: a typo found after the calibration
    (or after an hour of other configurations) costs device time that a GPU session does not have.
    ValueError naming every bad configuration."""
    from pp_offload.order.offload import resolve_offload
    from pp_offload.recompute_plan import parse_recompute
    from pp_offload.runtime.catalog import schedule_info
    from pp_offload.runtime.compile import check_recompute_compiles  # the recipe's refusal (+once)

    configs, bad = [], []
    for text in texts:
        try:
            config = Config.parse(text)
            schedule_info(config.schedule)
            resolve_offload(config.offload)
            parse_recompute(config.recompute)
            if compiled:
                check_recompute_compiles(None if config.recompute == "none" else config.recompute)
        except Exception as e:
            bad.append(f"{text!r}: {e}")
            continue
        configs.append(config)
    if bad:
        raise ValueError("bad configuration(s): " + "; ".join(bad))
    return configs


def run_config(
    shape: dict[str, Any],
    config: Config,
    args: argparse.Namespace,
    device: torch.device,
    dtype: torch.dtype,
    mfu: float | None,
    bandwidth: dict[str, float],
) -> dict[str, Any]:
    from pp_offload.runtime import compat

    predicted, costs, inputs = prepare(shape, config, args, mfu, bandwidth)
    start = time.perf_counter()
    compiling, compiled_before = compat.compile_counters()
    schedule, stages, step_args, step_kwargs = ready_rank(
        shape,
        config,
        args,
        device,
        dtype,
        predicted["layers_per_stage"],
        costs=costs,
        inputs=inputs,
        compile_options=_compile_options(args),
    )
    build_s = time.perf_counter() - start
    first = compat.compile_counters()
    schedule.step(*step_args, **step_kwargs)
    synchronize(device)
    record: dict[str, Any] = {"config": config.__dict__, "build_s": build_s, "predicted": predicted}
    if args.compile:
        record["compiled"] = True
    record["stages"] = [stage.stage_index for stage in stages]  # this rank's (the last holds the LM head)
    record["num_stages"] = stages[0].num_stages
    times, peaks, paced = [], [], []
    held = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    pacer = Pacer(schedule, costs, device)
    for _ in range(args.steps):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        synchronize(device)
        start = time.perf_counter()
        schedule.step(*step_args, **step_kwargs)
        synchronize(device)
        times.append(time.perf_counter() - start)
        if device.type == "cuda":
            peaks.append(torch.cuda.max_memory_allocated(device))
    for _ in range(args.steps):
        pacer.begin()
        run_step(schedule, step_args, step_kwargs, before=pacer.before)
        synchronize(device)
        paced.append(time.perf_counter() - pacer.start)
    record["step_s"] = statistics.median(times)
    record["step_s_all"] = times
    record["paced_step_s"] = statistics.median(paced)
    record["paced_step_s_all"] = paced
    record["simulated_makespan_s"] = pacer.makespan  # this schedule without offload, the same costs
    record["held_bytes"] = held
    record["outputs_kept"] = "return_outputs" not in step_kwargs
    record["state_bytes"] = state_bytes(stages)
    record["peak_bytes"] = max(peaks) if peaks else None
    record["above_held_bytes"] = (max(peaks) - held) if peaks else None
    record["pass_s"] = pass_times(schedule, step_args, step_kwargs, device)
    record["simulated_offload"] = simulated_offload(schedule, args.rank)
    runtime = getattr(schedule, "offload", None)
    if runtime is not None:
        stats = runtime.store.stats()
        record["host_pool_bytes"] = stats.host_pool_bytes
        record["offloaded_chunks"] = len(runtime.offloaded) + len(runtime.moved)
        record["moved_layers"] = sum(runtime.moved.values())
    record["memory_timeline"] = memory_timeline(schedule, step_args, step_kwargs, device)
    record["copies"] = copy_overlap(schedule, step_args, step_kwargs, device)
    record["host_syncs"] = host_syncs(schedule, step_args, step_kwargs, device)
    if args.compile:  # the first step compiled; every graph after it is a recompilation
        seconds, graphs = compat.compile_counters()
        record["compile"] = {
            "first_step_s": first[0] - compiling,
            "graphs": first[1] - compiled_before,
            "graphs_after_first_step": graphs - first[1],
        }
    del schedule, stages, pacer
    free(device)
    return record


def _compile_options(args: argparse.Namespace) -> Any:
    """``--compile``: each decoder layer compiled in place (`pp_offload.runtime.compile`), else None."""
    if not args.compile:
        return None
    from pp_offload.runtime.compile import CompileOptions

    return CompileOptions(backend=args.compile_backend)


def sync_check_config(
    shape: dict[str, Any],
    config: Config,
    args: argparse.Namespace,
    device: torch.device,
    dtype: torch.dtype,
    bandwidth: dict[str, float],
) -> dict[str, Any]:
    """``config``'s rank built as for the replay, one step to warm up, then `sync_check` of one more step
    (the planner's preset mfu: the costs only place the copies, nothing is timed)."""
    predicted, costs, inputs = prepare(shape, config, args, None, bandwidth)
    schedule, stages, step_args, step_kwargs = ready_rank(
        shape, config, args, device, dtype, predicted["layers_per_stage"], costs=costs, inputs=inputs
    )
    schedule.step(*step_args, **step_kwargs)
    synchronize(device)
    result = sync_check(schedule, step_args, step_kwargs, device)
    del schedule, stages
    free(device)
    return {"config": config.__dict__, "sync_check": result}


def _earlier_run(path: Path | None) -> dict[str, Any] | None:
    """``--calibration``: an earlier replay's results, when they hold a calibration (None: measure here)."""
    if path is None:
        return None
    try:
        data = json.loads(path.read_text())
        if data["meta"]["calibrated_mfu"] is None:
            raise ValueError("it has no calibrated mfu (a --sync-check run?)")
    except (OSError, ValueError, KeyError) as e:
        print(f"--calibration {path}: not used ({type(e).__name__}: {e}); measuring here", flush=True)
        return None
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama-3-8b", help="a shape of pp_offload.plan.shapes")
    parser.add_argument("--tiny", action="store_true", help="a tiny Llama (CPU smoke run)")
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument(
        "--rank",
        type=int,
        default=0,
        help="the pipeline rank to run, 0 .. pp-1 (the LM head and loss: rank 0 in V placement, rank pp-1 in "
        "loop placement)",
    )
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--machine", default="H100", help="planner machine preset")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument(
        "--configs", nargs="*", default=list(DEFAULT_CONFIGS), help="schedule/offload/recompute triples"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--name", default="replay", help="result file stem")
    parser.add_argument(
        "--sync-check",
        action="store_true",
        help="instead of measuring: one step of each configuration under torch.cuda.set_sync_debug_mode"
        "('error'), recording pass or the first synchronizing call and where it was made",
    )
    parser.add_argument(
        "--limit", type=int, metavar="N", help="run only the first N configurations (all are still checked)"
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        metavar="S",
        help="start no configuration after S seconds minus 1.25 times the longest one so far (the rest are "
        "recorded as skipped): ends on time under an outer time limit instead of being killed mid-way",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="compile each decoder layer in place (pp_offload.runtime.compile, the recipe's train.compile); "
        "each record gets the first step's compile time and the graphs compiled after it",
    )
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend for --compile")
    parser.add_argument(
        "--calibration",
        type=Path,
        metavar="JSON",
        help="take the planner's mfu and the host bandwidth from an earlier replay's result file instead of "
        "measuring them (the compiled rows then share the eager rows' costs), and print its rows beside "
        "these (compiled over eager)",
    )
    parser.add_argument(
        "--check-only",
        action="store_true",
        help="check the arguments and every configuration, then exit (no device needed): a dry run",
    )
    parser.add_argument(
        "--replan",
        type=Path,
        metavar="JSON",
        help="no GPU: the planner's predictions again (as it is now) for a committed measurement",
    )
    args = parser.parse_args(argv)
    if args.replan is not None:
        return replan(args.replan)
    started = time.perf_counter()

    from pp_offload.plan.shapes import shape as known_shape
    from pp_offload.runtime import compat

    shape = dict(TINY_SHAPE) if args.tiny else known_shape(args.model)
    if shape is None:
        parser.error(f"unknown model shape {args.model!r}")
    if not 0 <= args.rank < args.pp:
        parser.error(f"--rank {args.rank} is not a rank of --pp {args.pp}: use 0 .. {args.pp - 1}")
    if args.limit is not None and args.limit < 1:
        parser.error(f"--limit {args.limit}: run at least 1 configuration")
    try:
        configs = validate_configs(args.configs, compiled=args.compile)
    except ValueError as e:
        parser.error(str(e))
    if args.check_only:
        print(f"{len(configs)} configuration(s) checked; arguments ok", flush=True)
        return 0
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU; use --tiny --device cpu for a smoke run")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    if device.type == "cuda":
        torch.cuda.set_device(device)
    compat.init_fake_process_group(args.rank, args.pp)
    earlier = _earlier_run(args.calibration)
    if earlier is not None:
        bandwidth = earlier["meta"]["host_bandwidth_Bps"]
        mfu, calib = earlier["meta"]["calibrated_mfu"], earlier["meta"]["pass_s"]
    else:
        bandwidth = measure_host_bandwidth(device)
        if args.sync_check:
            mfu, calib = None, {}
        else:
            mfu, calib = calibrate_mfu(shape, args, device, dtype)
    meta = {
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "git_commit": git_commit(),
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "argv": sys.argv[1:] if argv is None else list(argv),
        "mode": "sync_check" if args.sync_check else "replay",
        "model": "tiny" if args.tiny else args.model,
        "pp": args.pp,
        "rank": args.rank,
        "seq": args.seq,
        "microbatches": args.microbatches,
        "dtype": args.dtype,
        "machine_preset": args.machine,
        "host_bandwidth_Bps": bandwidth,
        "pass_s": calib,
        "calibrated_mfu": mfu,
        "calibration_from": None if earlier is None else str(args.calibration),
        "compile": None if not args.compile else {"backend": args.compile_backend},
    }
    print(
        f"{meta['device']} torch {meta['torch']} commit {meta['git_commit']}: host copies d2h "
        f"{bandwidth['d2h'] / 1e9:.1f} GB/s, h2d {bandwidth['h2d'] / 1e9:.1f} GB/s"
        + ("" if mfu is None else f"; planner mfu {mfu:.3f}; passes (ms) ")
        + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in calib.items()),
        flush=True,
    )
    records: list[dict[str, Any]] = []
    write_results(args.out, args.name, meta, records)
    longest = 0.0
    for index, config in enumerate(configs):
        elapsed = time.perf_counter() - started
        reason = None
        if args.limit is not None and index >= args.limit:
            reason = f"skipped: --limit {args.limit}"
        elif args.budget_s is not None and elapsed + 1.25 * longest > args.budget_s:
            reason = f"skipped: time budget ({elapsed:.0f} s gone, longest configuration {longest:.0f} s)"
        if reason is not None:
            print(f"{config.label}: {reason}", flush=True)
            records.append({"config": config.__dict__, "skipped": reason})
            continue
        begin = time.perf_counter()
        # on disk before it runs: a configuration that hangs until the outer time limit shows as "started"
        write_results(args.out, args.name, meta, [*records, {"config": config.__dict__, "started": True}])
        try:
            if args.sync_check:
                record = sync_check_config(shape, config, args, device, dtype, bandwidth)
            else:
                record = run_config(shape, config, args, device, dtype, mfu, bandwidth)
        except Exception as e:  # one configuration failing must not lose the others' results
            print(f"{config.label}: FAILED {type(e).__name__}: {e}", flush=True)
            record = {"config": config.__dict__, "error": f"{type(e).__name__}: {e}"}
            free(device)
        record["wall_s"] = time.perf_counter() - begin
        # the next configuration reuses the compiled code (a warm cache): its compile time is not a guide
        longest = max(longest, record["wall_s"] - record.get("compile", {}).get("first_step_s", 0.0))
        records.append(record)
        write_results(args.out, args.name, meta, records)
        if "error" in record:
            continue
        if args.sync_check:
            check = record["sync_check"]
            detail = check.get("reason") or check.get("error", "")
            where = f" at {check['where']}" if check.get("where") else ""
            print(f"{config.label}: sync check {check['status']} {detail[:200]}{where}", flush=True)
            continue
        print(
            f"{config.label}: step {record['step_s'] * 1e3:.0f} ms, above held "
            f"{(record['above_held_bytes'] or 0) / GIB:.2f} GiB (planner "
            f"{(record['predicted']['activation_bytes'] + record['predicted']['transient_bytes']) / GIB:.2f})"
            f" [{record['wall_s']:.0f} s]",
            flush=True,
        )
        for site in record["host_syncs"][:3]:
            print(f"    host sync x{site['count']}: {site['where']}: {site['message'][:80]}", flush=True)
    write_results(args.out, args.name, meta, records)
    done = [r for r in records if "error" not in r and "skipped" not in r]
    failed = [r for r in records if "error" in r]
    if args.sync_check:  # a synchronizing call found is a result (in the JSON); a step that broke is not
        failed += [r for r in done if r["sync_check"]["status"] == "error"]
    elif done:
        print(tables(done))
        if args.compile and earlier is not None:
            print(compiled_table(earlier["records"], done))
        plot(done, args.out / f"{args.name}.png", meta)
    print(
        f"{len(done)} of {len(records)} configuration(s) done, {len(failed)} failed, "
        f"{len(records) - len(done) - len([r for r in records if 'error' in r])} skipped; "
        f"{args.out / (args.name + '.json')} [{time.perf_counter() - started:.0f} s]",
        flush=True,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
