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
import dataclasses
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results" / "gpu"
GIB = 1024**3

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

TINY_SHAPE = {
    "model_type": "llama",
    "vocab_size": 512,
    "num_key_value_heads": 2,
    "num_hidden_layers": 8,
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_attention_heads": 4,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}


@dataclass(frozen=True)
class Config:
    schedule: str
    offload: str
    recompute: str

    @classmethod
    def parse(cls, text: str) -> Config:
        parts = text.split("/")
        if len(parts) != 3:
            raise ValueError(f"a configuration is schedule/offload/recompute, got {text!r}")
        return cls(*parts)

    @property
    def label(self) -> str:
        return f"{self.schedule} / {self.offload} / {self.recompute}"


# --- the rank ----------------------------------------------------------------------------------------


def _hf_config(shape: dict[str, Any], num_layers: int, dtype: torch.dtype) -> Any:
    from transformers import AutoConfig

    values = dict(shape)
    model_type = values.pop("model_type")
    values["num_hidden_layers"] = num_layers
    config = AutoConfig.for_model(model_type, **values)
    config.use_cache = False
    config.dtype = dtype
    return config


def build_rank(
    shape: dict[str, Any],
    config: Config,
    *,
    layers_per_stage: list[int],
    pp: int,
    rank: int,
    seq: int,
    microbatches: int,
    device: torch.device,
    dtype: torch.dtype,
    costs: Any,
    inputs: Any = None,
) -> tuple[Any, list[Any], Any]:
    """This rank's stages (only its layers exist: the model is built with the rank's layer count and the
    other stages get zero layers) and the schedule on the fake process group. Returns
    (schedule, stages, loss_fn)."""
    from torch.distributed.pipelining import PipelineStage
    from transformers import AutoModelForCausalLM

    from pp_offload.models.loss import TokenCrossEntropy
    from pp_offload.models.split import split_model
    from pp_offload.parallel import activation_checkpointing
    from pp_offload.runtime import compat
    from pp_offload.runtime.catalog import build_schedule, schedule_info, stage_indices
    from pp_offload.runtime.offload import enable_offload

    info = schedule_info(config.schedule)
    per_rank = info.stages_per_rank(None)
    num_stages = pp * per_rank
    held = stage_indices(rank, pp, info.placement, per_rank)
    mine = [layers_per_stage[s] if s in held else 0 for s in range(num_stages)]
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(_hf_config(shape, sum(mine), dtype), dtype=dtype)
    model.train()
    split = split_model(model, num_stages=num_stages, stage_indices=held, layers_per_stage=mine, verify=False)
    if config.recompute != "none":
        activation_checkpointing(split, mode=config.recompute)
    hidden = int(shape["hidden_size"])
    stages = []
    for s in split.stage_indices:
        if s == 0:
            example = torch.zeros(1, seq, dtype=torch.long, device=device)
        else:
            example = torch.zeros(1, seq, hidden, dtype=dtype, device=device, requires_grad=True)
        out = split.stages[s](example)  # the stage's output metadata (static: no handshake with peers)
        stages.append(
            PipelineStage(
                split.stages[s],
                s,
                num_stages,
                device,
                input_args=example,
                output_args=out.detach().requires_grad_(out.requires_grad),
            )
        )
        del out
    loss_fn = TokenCrossEntropy()
    loss_fn.num_target_tokens = microbatches * (seq - 1)
    kwargs: dict[str, Any] = {"loss_fn": loss_fn, "scale_grads": False}
    ours = info.module == "pp_offload.runtime.schedules"
    if ours:
        kwargs["costs"] = costs
        kwargs["spread_search"] = False  # the peers are not there: this rank searches its order alone
        if config.offload != "none":
            kwargs["offload"] = config.offload
            if inputs is not None:  # the planner's figures: the runtime places what the planner predicts
                kwargs["costs"] = None
                kwargs["offload_inputs"] = inputs
    schedule = build_schedule(info, stages, microbatches, **kwargs)
    if not ours and config.offload != "none":
        if inputs is not None:
            enable_offload(schedule, config.offload, inputs=inputs, device=device)
        else:
            enable_offload(schedule, config.offload, costs=costs, device=device)
    compat.use_static_stage_metadata(schedule)
    return schedule, stages, loss_fn


def _step_inputs(stages: list[Any], num_stages: int, microbatches: int, seq: int, vocab: int, device: Any):
    has_first = any(st.stage_index == 0 for st in stages)
    has_last = any(st.stage_index == num_stages - 1 for st in stages)
    gen = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(0, vocab, (microbatches, seq), generator=gen).to(device)
    args = (ids,) if has_first else ()
    kwargs = {"target": ids} if has_last else {}
    return args, kwargs


def _no_outputs(schedule: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The step keywords the recipe uses: the last stage keeps no logits for the step's return value."""
    from pp_offload.runtime import compat

    return {**kwargs, **compat.no_output_kwargs(schedule)}


def _fill_receive_buffers(stages: list[Any]) -> None:
    """Peers never send: give every receive buffer finite activation-like values once."""
    from pp_offload.runtime import compat

    gen = torch.Generator(device="cpu").manual_seed(2)
    for stage in stages:
        for buffer in compat.receive_buffers(stage):
            with torch.no_grad():
                buffer.copy_(torch.randn(buffer.shape, generator=gen).mul_(0.5).to(buffer.dtype))


def ready_rank(
    shape: dict[str, Any],
    config: Config,
    args: argparse.Namespace,
    device: torch.device,
    dtype: torch.dtype,
    layers_per_stage: list[int],
    *,
    costs: Any,
    inputs: Any = None,
) -> tuple[Any, list[Any], tuple, dict[str, Any]]:
    """`build_rank`, then one step (it allocates the receive buffers and gradients) and finite values in
    the receive buffers. Returns (schedule, stages, step args, step kwargs)."""
    from pp_offload.runtime.catalog import schedule_info

    schedule, stages, _ = build_rank(
        shape,
        config,
        layers_per_stage=layers_per_stage,
        pp=args.pp,
        rank=args.rank,
        seq=args.seq,
        microbatches=args.microbatches,
        device=device,
        dtype=dtype,
        costs=costs,
        inputs=inputs,
    )
    num_stages = args.pp * schedule_info(config.schedule).stages_per_rank(None)
    step_args, step_kwargs = _step_inputs(
        stages, num_stages, args.microbatches, args.seq, int(shape["vocab_size"]), device
    )
    step_kwargs = _no_outputs(schedule, step_kwargs)
    schedule.step(*step_args, **step_kwargs)
    _fill_receive_buffers(stages)
    return schedule, stages, step_args, step_kwargs


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- measurements ------------------------------------------------------------------------------------


def measure_host_bandwidth(device: torch.device, nbytes: int = GIB) -> dict[str, float]:
    """Pinned host <-> device copy bandwidth (bytes/s), best of 3 copies each way."""
    if device.type != "cuda":
        return {"d2h": float("nan"), "h2d": float("nan")}
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out = {}
    for name, dst, src in (("d2h", host, dev), ("h2d", dev, host)):
        best = float("inf")
        for _ in range(4):
            _sync(device)
            start = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            _sync(device)
            best = min(best, time.perf_counter() - start)
        out[name] = nbytes / best
    del dev, host
    return out


def pass_times(schedule: Any, args: tuple, kwargs: dict, device: torch.device) -> dict[str, float]:
    """Median seconds of this rank's F, I, W and B passes in one step timed action by action."""
    from pp_offload.runtime.timing import parse_action, record_actions

    with record_actions(schedule, sync_cuda=True) as rec:
        schedule.step(*args, **kwargs)
    by_kind: dict[str, list[float]] = {}
    for event in rec.events:
        parsed = parse_action(event.action)
        if parsed is not None and parsed[1] in ("F", "I", "W", "B"):
            by_kind.setdefault(parsed[1], []).append(event.end - event.start)
    return {kind: statistics.median(values) for kind, values in by_kind.items()}


class _WrappedActions(list):
    """This rank's lowered order, calling ``before(action)``/``after(action)`` around each action once."""

    def __init__(self, actions: list[Any], before: Any, after: Any):
        super().__init__(actions)
        self._hooks: tuple[Any, Any] | None = (before, after)

    def __iter__(self):
        hooks, self._hooks = self._hooks, None
        if hooks is None:
            yield from list.__iter__(self)
            return
        before, after = hooks
        for action in list.__iter__(self):
            before(action)
            yield action
            after(action)

    def __reduce_ex__(self, protocol: Any) -> Any:  # torch deep-copies orders to print them on errors
        return list, (list(list.__iter__(self)),)


def run_step(schedule: Any, args: tuple, kwargs: dict, *, before: Any = None, after: Any = None) -> None:
    """One ``schedule.step`` with hooks around every action of this rank's lowered order."""
    from pp_offload.runtime import compat

    order = compat.lowered_order(schedule)
    actions = order[schedule.rank]
    order[schedule.rank] = _WrappedActions(actions, before or (lambda a: None), after or (lambda a: None))
    try:
        schedule.step(*args, **kwargs)
    finally:
        order[schedule.rank] = actions


class Pacer:
    """Makes this rank wait for its peers as it would in the real pipeline.

    Alone on a fake process group, a rank never waits for a receive, so its bubbles vanish and an offload
    copy has less time to hide than it would have. The pacer replays the schedule's order with the costs
    (the simulator, no offload) and holds each compute pass whose input comes from another rank until the
    simulated time that input arrives, counted from the step's start; the compute stream is drained first,
    as a real receive would stall it. A rank that runs late (offload waits) does not wait at all."""

    def __init__(self, schedule: Any, costs: Any, device: torch.device):
        from pp_offload.runtime.timing import parse_action
        from pp_offload.sim import dependency, simulate

        order = {r: list(a) for r, a in schedule.pipeline_order.items()}
        sim = simulate(order, costs)
        self.makespan = sim.makespan
        self.rank = schedule.rank
        self.device = device
        ends: dict[tuple[int, str, int], float] = {}
        owner: dict[int, int] = {}
        for rank, spans in sim.timeline.items():
            for (stage, kind, mb), _, end in spans:
                ends[(stage, kind, mb)] = end
                if kind == "B":
                    ends[(stage, "I", mb)] = end
                owner[stage] = rank
        num_stages = 1 + max(owner)
        self._ready: dict[tuple[int, str, int], float] = {}
        for (stage, kind, mb), _, _ in sim.timeline[self.rank]:
            producer = dependency(stage, kind, mb, num_stages)
            if producer is not None and owner.get(producer[0]) != self.rank and producer in ends:
                self._ready[(stage, kind, mb)] = ends[producer]
        self.start = 0.0
        self._parse = parse_action  # called before every action: looked up once here

    def begin(self) -> None:
        _sync(self.device)
        self.start = time.perf_counter()

    def before(self, action: Any) -> None:
        parsed = self._parse(str(action))
        if parsed is None or parsed[2] is None:
            return
        stage, kind, mb = parsed
        ready = self._ready.get((stage, "I" if kind == "B" else kind, mb))
        if ready is None:
            return
        deadline = self.start + ready
        if time.perf_counter() >= deadline:
            return
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        while time.perf_counter() < deadline:
            pass


def memory_timeline(schedule: Any, args: tuple, kwargs: dict, device: torch.device) -> list[tuple[str, int]]:
    """Allocated device bytes after every action of one synchronized step (CUDA only)."""
    if device.type != "cuda":
        return []
    samples: list[tuple[str, int]] = []

    def after(action: Any) -> None:
        torch.cuda.synchronize(device)
        samples.append((str(action), torch.cuda.memory_allocated(device)))

    run_step(schedule, args, kwargs, after=after)
    return samples


def copy_overlap(schedule: Any, args: tuple, kwargs: dict, device: torch.device) -> dict[str, Any]:
    """Profile one step: device<->host copy time, and the share of it during which compute kernels ran."""
    if device.type != "cuda":
        return {}
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        schedule.step(*args, **kwargs)
        _sync(device)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    kernels, d2h, h2d = [], [], []
    by_kind: dict[str, tuple[float, int]] = {}
    for event in trace.get("traceEvents", []):
        if event.get("ph") != "X" or "dur" not in event:
            continue
        span = (float(event["ts"]), float(event["ts"]) + float(event["dur"]))
        cat, name = event.get("cat", ""), event.get("name", "")
        if cat == "kernel":
            kernels.append(span)
            kind = _kernel_kind(name)
            ms, count = by_kind.get(kind, (0.0, 0))
            by_kind[kind] = (ms + (span[1] - span[0]) / 1e3, count + 1)
        elif cat == "gpu_memcpy" and "DtoH" in name:
            d2h.append(span)
        elif cat == "gpu_memcpy" and "HtoD" in name:
            h2d.append(span)
    busy = _merge(kernels, gap=50.0)  # µs: launch gaps inside a pass are not idle time worth drawing
    t0 = min((s for s, _ in kernels + d2h + h2d), default=0.0)

    def overlapped(spans: list[tuple[float, float]]) -> float:
        total = sum(e - s for s, e in spans)
        hidden = sum(_intersection(span, busy) for span in spans)
        return hidden / total if total else float("nan")

    def shifted(spans: list[tuple[float, float]]) -> list[list[float]]:
        return [[(s - t0) / 1e3, (e - s) / 1e3] for s, e in spans]  # ms: start, duration

    return {
        "d2h_ms": sum(e - s for s, e in d2h) / 1e3,
        "h2d_ms": sum(e - s for s, e in h2d) / 1e3,
        "compute_ms": sum(e - s for s, e in busy) / 1e3,
        "d2h_overlapped": overlapped(d2h),
        "h2d_overlapped": overlapped(h2d),
        "lanes": {"compute": shifted(busy), "D2H": shifted(_merge(d2h)), "H2D": shifted(_merge(h2d))},
        "kernels": {kind: {"ms": ms, "count": n} for kind, (ms, n) in sorted(by_kind.items())},
    }


def host_syncs(schedule: Any, args: tuple, kwargs: dict, device: torch.device) -> list[dict[str, Any]]:
    """The synchronizing CUDA calls of one step, each with where it was made (CUDA only).

    Why: a host that waits for the device stops launching work, so copies on another stream stop hiding
    behind compute. torch's sync debug mode warns at every such call; the warnings are collected with the
    innermost frames outside torch, counted per distinct call site."""
    if device.type != "cuda":
        return []
    import traceback
    import warnings

    sites: dict[tuple[str, str], int] = {}
    original = warnings.showwarning

    def note(
        message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None
    ) -> None:
        frames = [
            f
            for f in traceback.extract_stack()[:-1]
            if "/torch/" not in f.filename and "warnings" not in f.filename
        ]
        where = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames[-4:]))
        key = (str(message)[:160], where)
        sites[key] = sites.get(key, 0) + 1

    warnings.showwarning = note
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = note
            torch.cuda.set_sync_debug_mode("warn")
            try:
                schedule.step(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        warnings.showwarning = original
    _sync(device)
    return [
        {"message": m, "where": w, "count": n} for (m, w), n in sorted(sites.items(), key=lambda x: -x[1])
    ]


def _kernel_kind(name: str) -> str:
    """A coarse class of a CUDA kernel by its name: how much of a step is matmul, attention, the rest
    (recompute that re-runs matmuls shows up as more matmul time than the plain schedule's)."""
    low = name.lower()
    if any(k in low for k in ("flash", "fmha", "attention", "attn")):
        return "attention"
    if any(k in low for k in ("gemm", "xmma", "cutlass", "nvjet", "cublas", "matmul")):
        return "matmul"
    return "other"


def _merge(spans: list[tuple[float, float]], gap: float = 0.0) -> list[tuple[float, float]]:
    """Union of ``spans``; spans closer than ``gap`` join."""
    merged: list[tuple[float, float]] = []
    for s, e in sorted(spans):
        if merged and s <= merged[-1][1] + gap:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((s, e))
    return merged


def _intersection(span: tuple[float, float], busy: list[tuple[float, float]]) -> float:
    s, e = span
    return sum(max(0.0, min(e, b) - max(s, a)) for a, b in busy if a < e and b > s)


# --- predictions -------------------------------------------------------------------------------------


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


def _predict(
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


# --- driver ------------------------------------------------------------------------------------------


def _prepare(
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
    predicted = _predict(shape, config, args, host_bandwidth=None if mean_bw != mean_bw else mean_bw, mfu=mfu)
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


def run_config(
    shape: dict[str, Any],
    config: Config,
    args: argparse.Namespace,
    device: torch.device,
    dtype: torch.dtype,
    mfu: float | None,
    bandwidth: dict[str, float],
) -> dict[str, Any]:
    predicted, costs, inputs = _prepare(shape, config, args, mfu, bandwidth)
    start = time.perf_counter()
    schedule, stages, step_args, step_kwargs = ready_rank(
        shape, config, args, device, dtype, predicted["layers_per_stage"], costs=costs, inputs=inputs
    )
    build_s = time.perf_counter() - start
    schedule.step(*step_args, **step_kwargs)
    _sync(device)
    record: dict[str, Any] = {"config": config.__dict__, "build_s": build_s, "predicted": predicted}
    record["stages"] = [stage.stage_index for stage in stages]  # this rank's (the last holds the LM head)
    record["num_stages"] = stages[0].num_stages
    times, peaks, paced = [], [], []
    held = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    pacer = Pacer(schedule, costs, device)
    for _ in range(args.steps):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        _sync(device)
        start = time.perf_counter()
        schedule.step(*step_args, **step_kwargs)
        _sync(device)
        times.append(time.perf_counter() - start)
        if device.type == "cuda":
            peaks.append(torch.cuda.max_memory_allocated(device))
    for _ in range(args.steps):
        pacer.begin()
        run_step(schedule, step_args, step_kwargs, before=pacer.before)
        _sync(device)
        paced.append(time.perf_counter() - pacer.start)
    record["step_s"] = statistics.median(times)
    record["step_s_all"] = times
    record["paced_step_s"] = statistics.median(paced)
    record["paced_step_s_all"] = paced
    record["simulated_makespan_s"] = pacer.makespan  # this schedule without offload, the same costs
    record["held_bytes"] = held
    record["outputs_kept"] = "return_outputs" not in step_kwargs
    record["state_bytes"] = _state_bytes(stages)
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
    del schedule, stages, pacer
    _free(device)
    return record


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
    predicted, costs, inputs = _prepare(shape, config, args, None, bandwidth)
    schedule, stages, step_args, step_kwargs = ready_rank(
        shape, config, args, device, dtype, predicted["layers_per_stage"], costs=costs, inputs=inputs
    )
    schedule.step(*step_args, **step_kwargs)
    _sync(device)
    result = sync_check(schedule, step_args, step_kwargs, device)
    del schedule, stages
    _free(device)
    return {"config": config.__dict__, "sync_check": result}


SYNC_ERROR = "synchronizing CUDA operation"
"""What torch's sync debug mode "error" raises with (c10's warn_or_error_on_sync)."""


def sync_check(schedule: Any, args: tuple, kwargs: dict, device: torch.device) -> dict[str, Any]:
    """One step under ``torch.cuda.set_sync_debug_mode("error")``: the first synchronizing CUDA call raises.

    Why: the issue's target is zero synchronizing calls in a step; `host_syncs` lists them in "warn" mode
    (every site, counted), this is the hard check. Returns ``{"status": "passed"}``, ``{"status": "failed",
    "error", "where", "torch_frames"}`` (``where``: the innermost frames outside torch, innermost first), or
    ``{"status": "error", ...}`` when the step failed otherwise. Without CUDA the step runs without the debug
    mode and the status is ``"skipped"`` (the same path, rehearsed on CPU)."""
    if device.type != "cuda":
        schedule.step(*args, **kwargs)
        return {"status": "skipped", "reason": "skipped: no CUDA (the step ran without sync debug mode)"}
    import traceback

    _sync(device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        schedule.step(*args, **kwargs)
        torch.cuda.set_sync_debug_mode("default")
        _sync(device)
    except Exception as e:  # the offending call's site is the record: it must not end the run
        torch.cuda.set_sync_debug_mode("default")
        frames = traceback.extract_tb(e.__traceback__)
        ours = [f for f in frames if "/torch/" not in f.filename]
        inside = [f for f in frames if "/torch/" in f.filename]

        def text(fs: list[Any]) -> str:
            return " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(fs))

        message = f"{type(e).__name__}: {e}"
        e.__traceback__ = None  # the frames hold the step's tensors
        del e
        _free(device)
        return {
            "status": "failed" if SYNC_ERROR in message else "error",
            "error": message[:400],
            "where": text(ours[-4:]),
            "torch_frames": text(inside[-3:]),
        }
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return {"status": "passed"}


def _state_bytes(stages: list[Any]) -> int:
    """Bytes of this rank's parameters, gradients and receive buffers (what the planner calls state)."""
    from pp_offload.runtime import compat

    seen: set[int] = set()
    total = 0
    for stage in stages:
        tensors = [
            *stage.submod.parameters(),
            *(p.grad for p in stage.submod.parameters() if p.grad is not None),
            *compat.receive_buffers(stage),
        ]
        for t in tensors:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in seen:
                seen.add(ptr)
                total += t.untyped_storage().nbytes()
    return total


def _free(device: torch.device) -> None:
    """Drop the last configuration's model and buffers (reference cycles through stage hooks included)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def calibrate_mfu(
    shape: dict[str, Any], args: argparse.Namespace, device: torch.device, dtype: torch.dtype
) -> tuple[float, dict[str, float]]:
    """The planner's model FLOPs utilisation that reproduces the forward time measured here.

    One V-Half step without offload is timed pass by pass; the planner's ``mfu`` is scaled so that its
    chunk forward time equals the measured median. The planner's I and W then follow its own FLOP ratios,
    which the table reports next to the measured ones. Returns (mfu, measured median pass seconds)."""
    from pp_offload.plan import resolve_machine

    config = Config("ScheduleVHalf", "none", "none")
    predicted = _predict(shape, config, args)
    schedule, stages, step_args, step_kwargs = ready_rank(
        shape, config, args, device, dtype, predicted["layers_per_stage"], costs=None
    )
    times = pass_times(schedule, step_args, step_kwargs, device)
    del schedule, stages
    _free(device)
    preset = resolve_machine(args.machine).mfu
    mfu = preset * predicted["chunk_costs_s"]["F"] / times["F"]
    return min(1.0, mfu), times


def plot(records: list[dict[str, Any]], path: Path, meta: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with_copies = [r for r in records if r.get("copies", {}).get("lanes", {}).get("D2H")]
    rows = len(with_copies) + 1
    fig, axes = plt.subplots(rows, 1, figsize=(12, 2.2 * rows), squeeze=False)
    ax = axes[0][0]
    for r in records:
        tl = r.get("memory_timeline") or []
        if tl:
            ax.plot([b / GIB for _, b in tl], label=Config(**r["config"]).label, lw=1)
    ax.set_ylabel("allocated GiB")
    ax.set_xlabel("action of one step")
    if ax.get_lines():
        ax.legend(fontsize=6, ncol=2)
    else:
        ax.text(0.5, 0.5, "no CUDA memory timeline (CPU run)", ha="center", transform=ax.transAxes)
    ax.set_title(f"{meta['device']}, torch {meta['torch']}: memory after every action (rank {meta['rank']})")
    colours = {"compute": "tab:blue", "D2H": "tab:orange", "H2D": "tab:green"}
    for ax, r in zip([a[0] for a in axes[1:]], with_copies, strict=True):
        lanes = r["copies"]["lanes"]
        for y, lane in enumerate(("compute", "D2H", "H2D")):
            ax.broken_barh(lanes[lane], (y - 0.4, 0.8), color=colours[lane])
        ax.set_yticks(range(3), ["compute", "D2H", "H2D"])
        c = r["copies"]
        ax.set_title(
            f"{Config(**r['config']).label}: D2H {c['d2h_overlapped']:.0%} / H2D "
            f"{c['h2d_overlapped']:.0%} of copy time under compute",
            fontsize=8,
        )
        ax.set_xlabel("ms")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _pct(x: float | None) -> str:
    return "-" if x is None or x != x else f"{x:+.1%}"


def tables(records: list[dict[str, Any]]) -> str:
    """Memory against the planner, and time (paced: the rank waits for its peers as simulated) against the
    simulator, each offload/recompute row against its schedule's plain row."""
    base = {
        r["config"]["schedule"]: r
        for r in records
        if r["config"]["offload"] == "none" and r["config"]["recompute"] == "none"
    }
    mem = [
        "| schedule / offload / recompute | activations GiB measured | planner | off by | "
        "whole GiB measured | planner | off by |",
        "|" + "---|" * 7,
    ]
    tim = [
        "| schedule / offload / recompute | alone ms | paced ms | simulated ms | paced overhead | "
        "predicted overhead | D2H under compute | H2D under compute |",
        "|" + "---|" * 8,
    ]
    for r in records:
        c, p = r["config"], r["predicted"]
        label = Config(**c).label
        act_pred = p["activation_bytes"] + p["transient_bytes"]
        whole_pred = act_pred + p["params_bytes"] + p["grads_bytes"] + p["recv_buffer_bytes"]
        act, peak, state = r["above_held_bytes"], r["peak_bytes"], r.get("state_bytes")
        whole = None if peak is None or state is None else peak - r["held_bytes"] + state
        mem.append(
            f"| {label} | {'-' if act is None else f'{act / GIB:.2f}'} | {act_pred / GIB:.2f} | "
            f"{_pct(None if not act else act_pred / act - 1)} | "
            f"{'-' if whole is None else f'{whole / GIB:.2f}'} | {whole_pred / GIB:.2f} | "
            f"{_pct(None if not whole else whole_pred / whole - 1)} |"
        )
        b = base.get(c["schedule"])
        sim_off = r.get("simulated_offload")
        sim_ms = (sim_off or {}).get("makespan_s", r["simulated_makespan_s"])
        measured_over = r["paced_step_s"] / b["paced_step_s"] - 1 if b else None
        predicted_over = sim_ms / b["simulated_makespan_s"] - 1 if b else None
        copies = r.get("copies") or {}
        tim.append(
            f"| {label} | {r['step_s'] * 1e3:.0f} | {r['paced_step_s'] * 1e3:.0f} | {sim_ms * 1e3:.0f} | "
            f"{_pct(measured_over)} | {_pct(predicted_over)} | "
            f"{copies.get('d2h_overlapped', float('nan')):.0%} | "
            f"{copies.get('h2d_overlapped', float('nan')):.0%} |"
        )
    return "\n".join(mem) + "\n\n" + "\n".join(tim)


def replan(path: Path) -> int:
    """The planner's predictions again, for the measurements in ``path`` (same shape, split, machine preset,
    calibrated mfu and measured host bandwidth): how a change of the planner's model moves its error."""
    from pp_offload.plan.shapes import shape as known_shape

    data = json.loads(path.read_text())
    meta = data["meta"]
    shape = dict(TINY_SHAPE) if meta["model"] == "tiny" else known_shape(meta["model"])
    bw = meta["host_bandwidth_Bps"]
    mean_bw = (bw["d2h"] + bw["h2d"]) / 2
    records = []
    for record in data["records"]:
        if "error" in record or "skipped" in record or "started" in record:
            continue
        record = dict(record)
        record["predicted"] = planner_prediction(
            shape,
            Config(**record["config"]),
            pp=meta["pp"],
            seq=meta["seq"],
            microbatches=meta["microbatches"],
            machine=meta["machine_preset"],
            host_bandwidth=None if mean_bw != mean_bw else mean_bw,
            rank=meta["rank"],
            mfu=meta["calibrated_mfu"],
        )
        records.append(record)
    print(
        f"{meta['device']}, torch {meta['torch']}, {meta['model']}, seq {meta['seq']}: measured then; "
        "planned now"
    )
    print(tables(records))
    return 0


def validate_configs(texts: list[str]) -> list[Config]:
    """Every configuration parsed and its schedule, offload policy and recompute plan checked before anything
    is built. Why: a typo found after the calibration (or after an hour of other configurations) costs
    device time that a GPU session does not have. ValueError naming every bad configuration."""
    from pp_offload.order.offload import resolve_offload
    from pp_offload.recompute_plan import parse_recompute
    from pp_offload.runtime.catalog import schedule_info

    configs, bad = [], []
    for text in texts:
        try:
            config = Config.parse(text)
            schedule_info(config.schedule)
            resolve_offload(config.offload)
            parse_recompute(config.recompute)
        except Exception as e:
            bad.append(f"{text!r}: {e}")
            continue
        configs.append(config)
    if bad:
        raise ValueError("bad configuration(s): " + "; ".join(bad))
    return configs


def git_commit() -> str:
    """The commit measured: ``git rev-parse HEAD`` (``+dirty`` with uncommitted changes), else the
    ``PP_OFFLOAD_COMMIT`` environment variable (a device machine may get the working tree without .git)."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root, capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()  # fmt: skip
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("PP_OFFLOAD_COMMIT") or "unknown (no git; set PP_OFFLOAD_COMMIT)"


def write_results(out: Path, name: str, meta: dict[str, Any], records: list[dict[str, Any]]) -> Path:
    """The results so far, replaced atomically: written after every configuration, so a run killed by its
    time limit still leaves every finished configuration on disk."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    tmp.replace(path)
    return path


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
        configs = validate_configs(args.configs)
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
            _free(device)
        record["wall_s"] = time.perf_counter() - begin
        longest = max(longest, record["wall_s"])
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
