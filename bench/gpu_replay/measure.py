"""What the replay measures on a rank (`bench/bench_gpu_replay.py`): host copy bandwidth, pass times,
paced steps, the memory timeline, copy/compute overlap from a profiler trace, synchronizing CUDA calls,
and the bytes the rank holds between steps."""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from .rank import GIB, free, synchronize


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
            synchronize(device)
            start = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            synchronize(device)
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
        synchronize(self.device)
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
        synchronize(device)
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
    synchronize(device)
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

    synchronize(device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        schedule.step(*args, **kwargs)
        torch.cuda.set_sync_debug_mode("default")
        synchronize(device)
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
        free(device)
        return {
            "status": "failed" if SYNC_ERROR in message else "error",
            "error": message[:400],
            "where": text(ours[-4:]),
            "torch_frames": text(inside[-3:]),
        }
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return {"status": "passed"}


def state_bytes(stages: list[Any]) -> int:
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
