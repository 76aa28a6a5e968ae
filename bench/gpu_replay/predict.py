"""The planner's side of the replay (`bench/bench_gpu_replay.py`): its prediction for a rank, the chunk
costs and offload figures a schedule is built with, the simulator's offload makespan, and the planner's
``mfu`` calibrated to the forward measured here."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import torch

from .measure import pass_times
from .rank import Config, free, ready_rank


def planner_prediction(
    shape: dict[str, Any],
    config: Config,
    *,
    pp: int,
    seq: int,
    microbatches: int,
    machine: str,
    host_bandwidth: float | None,
    rank: int,
    mfu: float | None = None,
) -> dict[str, Any]:
    """The planner's figures for this rank: activation, receive buffers, weights+grads, transient bytes."""
    from pp_offload.plan import plan

    kwargs: dict[str, Any] = {}
    if host_bandwidth is not None and host_bandwidth == host_bandwidth:
        kwargs["host_bandwidth"] = host_bandwidth
    if mfu is not None:
        kwargs["mfu"] = mfu
    result = plan(
        shape,
        seq_len=seq,
        microbatch_size=1,
        num_microbatches=microbatches,
        pp=pp,
        machine=machine,
        schedules=[config.schedule],
        offload=[config.offload],
        recompute=[config.recompute],
        evaluate_dominated=True,
        jobs=1,
        suggest=False,
        gpu_memory_gib=10_000,
        **kwargs,
    )
    cand = result.candidate(config.schedule, config.offload, config.recompute)
    if cand.error:
        raise RuntimeError(f"planner failed for {config.label}: {cand.error}")
    parts = cand.breakdown[rank]
    details = result.schedules[cand.schedule]
    return {
        "layers_per_stage": list(details["layers_per_stage"]),
        "activation_bytes": int(parts["activations"]),
        "transient_bytes": int(parts["transient"]),
        "recv_buffer_bytes": int(parts["recv_buffers"]),
        "params_bytes": int(parts["params"]),
        "grads_bytes": int(parts["grads"]),
        "step_time_s": cand.step_time,
        "bubble": cand.bubble,
        "moved_share": cand.moved_share,
        "offloaded_share": cand.offloaded_share,
        "chunk_costs_s": dict(details["chunk_costs_s"]),
    }


def predict(
    shape: dict[str, Any],
    config: Config,
    args: argparse.Namespace,
    *,
    host_bandwidth: float | None = None,
    mfu: float | None = None,
) -> dict[str, Any]:
    return planner_prediction(
        shape,
        config,
        pp=args.pp,
        seq=args.seq,
        microbatches=args.microbatches,
        machine=args.machine,
        host_bandwidth=host_bandwidth,
        rank=args.rank,
        mfu=mfu,
    )


def simulated_offload(schedule: Any, rank: int) -> dict[str, float] | None:
    """The runtime's own offload plan as the simulator replayed it, with the costs the schedule was built
    with (the planner's, calibrated to the pass times measured here): makespan and this rank's reload wait
    (seconds)."""
    runtime = getattr(schedule, "offload", None)
    if runtime is None or runtime.plan.sim is None:
        return None
    sim = runtime.plan.sim
    return {"makespan_s": float(sim.makespan), "reload_wait_s": float(sim.reload_wait.get(rank, 0.0))}


def prepare(
    shape: dict[str, Any],
    config: Config,
    args: argparse.Namespace,
    mfu: float | None,
    bandwidth: dict[str, float],
) -> tuple[dict[str, Any], Any, Any]:
    """The planner's prediction for ``config`` on this rank, the chunk costs the schedule is built with and,
    for an offload policy, the planner's figures the runtime places its copies with. Returns (prediction,
    costs, offload inputs or None)."""
    from pp_offload.order.actions import Costs

    mean_bw = (bandwidth["d2h"] + bandwidth["h2d"]) / 2
    predicted = predict(shape, config, args, host_bandwidth=None if mean_bw != mean_bw else mean_bw, mfu=mfu)
    costs = Costs(**predicted["chunk_costs_s"])
    inputs = None
    if config.offload != "none":
        from pp_offload.plan import offload_inputs, resolve_machine

        machine = resolve_machine(args.machine)
        machine = dataclasses.replace(
            machine,
            mfu=mfu if mfu is not None else machine.mfu,
            host_bandwidth=machine.host_bandwidth if mean_bw != mean_bw else mean_bw,
        )
        inputs = offload_inputs(
            shape,
            schedule=config.schedule,
            offload=config.offload,
            pp=args.pp,
            seq_len=args.seq,
            microbatch_size=1,
            num_microbatches=args.microbatches,
            machine=machine,
            recompute=config.recompute,
            layers_per_stage=predicted["layers_per_stage"],
        )
    return predicted, costs, inputs


def calibrate_mfu(
    shape: dict[str, Any], args: argparse.Namespace, device: torch.device, dtype: torch.dtype
) -> tuple[float, dict[str, float]]:
    """The planner's model FLOPs utilisation that reproduces the forward time measured here.

    One V-Half step without offload is timed pass by pass; the planner's ``mfu`` is scaled so that its
    chunk forward time equals the measured median. The planner's I and W then follow its own FLOP ratios,
    which the table reports next to the measured ones. Returns (mfu, measured median pass seconds)."""
    from pp_offload.plan import resolve_machine

    config = Config("ScheduleVHalf", "none", "none")
    predicted = predict(shape, config, args)
    schedule, stages, step_args, step_kwargs = ready_rank(
        shape, config, args, device, dtype, predicted["layers_per_stage"], costs=None
    )
    times = pass_times(schedule, step_args, step_kwargs, device)
    del schedule, stages
    free(device)
    preset = resolve_machine(args.machine).mfu
    mfu = preset * predicted["chunk_costs_s"]["F"] / times["F"]
    return min(1.0, mfu), times
