"""What the activation store itself costs per offloaded chunk, on CPU, next to a transformer layer's compute.

The store's work per chunk is bookkeeping (pack/unpack hooks, planning the copy layout, pool, views)
plus the data movement. The movement is the host link's business (PCIe on a GPU; here a memcpy) and is
hidden behind compute by the schedule; the bookkeeping is Python on the critical path of every F and
backward. So it measures, for one chunk's life (forward under ``capture``, ``offload``, ``reload``,
backward, ``release``):

- calls: the store's calls alone, on the tensors a real forward of the chunk saves (the pack hook per
  saved tensor inside ``capture``, offload, reload, the unpack hook per saved tensor, release), minus
  the raw copies: the store's planned segment copies into a preallocated host buffer and one copy back
  per dtype into a fresh buffer, done with no bookkeeping.
- end to end: the life with the store minus the same forward + backward without it, minus the raw
  copies. It also holds what autograd adds around the hooks (a Python call per saved tensor, a Python
  object per tensor it hands over), but it is a difference of compute-bound times: measurable on the
  tiny block, lost in noise on the real layer.
- overhead = calls + autograd's per-tensor hook cost (tiny block's end to end minus its calls, per
  saved tensor) times the chunk's saved tensors.

Every time is the best of many interleaved runs (noise on a shared machine only adds), the layer's
forward + backward included.

Two chunks: a tiny block (``min_numel=0``: every saved tensor is recorded, so the per-tensor cost shows)
and one ``nn.TransformerEncoderLayer`` of a small but real size (hidden 512, sequence 256, batch 1, fp32,
default ``min_numel``), whose forward + backward is the compute the overhead is compared with.

    python bench/bench_store.py                  # writes bench/results/store.json
    python bench/bench_store.py --reps 50 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pp_offload.runtime.store import ActivationStore

RESULTS = Path(__file__).resolve().parent / "results"


def _layer(hidden: int, heads: int) -> nn.Module:
    return nn.TransformerEncoderLayer(
        hidden, heads, dim_feedforward=4 * hidden, dropout=0.0, batch_first=True, norm_first=True
    )


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _saved_tensors(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The output and every tensor autograd saves in one forward, in saving order."""
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    return out, saved


def measure_chunk(name: str, model: nn.Module, x: torch.Tensor, *, min_numel: int, reps: int) -> dict:
    """One chunk's life with and without the store, phase by phase (best of ``reps``), and the store's
    calls alone on the tensors the forward really saves (best of ``10 * reps``)."""
    grad = torch.randn_like(x)
    store = ActivationStore("cpu", min_numel=min_numel)
    _, saved = _saved_tensors(model, x)
    times: dict[str, list[float]] = {}

    def note(**phases: float) -> None:
        for key, dt in phases.items():
            times.setdefault(key, []).append(dt)

    def plain() -> None:
        t0 = time.perf_counter()
        out = model(x)
        t1 = time.perf_counter()
        out.backward(grad)
        note(forward=t1 - t0, backward=time.perf_counter() - t1)

    def with_store() -> None:
        t0 = time.perf_counter()
        with store.capture(name, keep=[x]):
            out = model(x)
        t1 = time.perf_counter()
        store.offload(name)
        t2 = time.perf_counter()
        store.reload(name)
        t3 = time.perf_counter()
        out.backward(grad)
        t4 = time.perf_counter()
        store.release(name)
        t5 = time.perf_counter()
        note(s_forward=t1 - t0, s_offload=t2 - t1, s_reload=t3 - t2, s_backward=t4 - t3, s_release=t5 - t4)

    def calls_only() -> None:
        t0 = time.perf_counter()
        with store.capture(name, keep=[x]):  # hooks pushed and popped, layout planned at exit
            chunk = store._chunks[name]
            handles = [store._pack(chunk, t) for t in saved]  # what autograd calls per saved tensor
        t1 = time.perf_counter()
        store.offload(name)
        t2 = time.perf_counter()
        store.reload(name)
        t3 = time.perf_counter()
        for h in handles:  # what backward calls per saved tensor
            store._unpack(h)
        t4 = time.perf_counter()
        store.release(name)
        t5 = time.perf_counter()
        note(c_capture=t1 - t0, c_offload=t2 - t1, c_reload=t3 - t2, c_unpack=t4 - t3, c_release=t5 - t4)

    # the store's planned copies, done raw: segments into a host buffer, one copy back per dtype
    with store.capture("plan", keep=[x]):
        chunk = store._chunks["plan"]
        for t in saved:
            store._pack(chunk, t)
    segments, totals = chunk.segments, chunk.totals
    host = {dt: torch.empty(n, dtype=dt) for dt, n in totals.items()}
    stats = store.stats().chunks["plan"]
    store.release("plan")

    def raw_copies() -> None:
        t0 = time.perf_counter()
        for dt, src, offset, numel, shape in segments:
            dst = host[dt].narrow(0, offset, numel)
            (dst.view(shape) if shape is not None else dst).copy_(src)
        t1 = time.perf_counter()
        for dt, n in totals.items():
            torch.empty(n, dtype=dt).copy_(host[dt])
        note(d2h=t1 - t0, h2d=time.perf_counter() - t1)

    for _ in range(3):  # warm-up: allocator, pool, lazy inits
        plain(), with_store(), calls_only(), raw_copies()
    times.clear()
    for _ in range(reps):  # interleaved, so a busy machine slows all alike
        plain()
        with_store()
        for _ in range(10):  # no compute in these: cheap
            calls_only()
            raw_copies()
    best = {k: min(v) for k, v in times.items()}
    copies = best["d2h"] + best["h2d"]
    overhead = (
        (best["s_forward"] - best["forward"])
        + (best["s_offload"] + best["s_reload"] - copies)
        + (best["s_backward"] - best["backward"])
        + best["s_release"]
    )
    calls = sum(v for k, v in best.items() if k.startswith("c_")) - copies
    count = stats.stored + stats.views + sum(stats.kept.values())
    spread = sorted(times["forward"][i] + times["backward"][i] for i in range(reps))
    return {
        "chunk": name,
        "params": sum(p.numel() for p in model.parameters()),
        "input_shape": list(x.shape),
        "min_numel": min_numel,
        "saved_tensors": count,
        "stored": stats.stored,
        "views": stats.views,
        "kept": stats.kept,
        "copies": stats.copies,
        "captured_bytes": stats.captured_bytes,
        "best_ms": {k: 1e3 * v for k, v in sorted(best.items())},
        "raw_copies_ms": 1e3 * copies,
        "forward_backward_ms": 1e3 * (best["forward"] + best["backward"]),
        "forward_backward_median_ms": 1e3 * spread[reps // 2],
        "end_to_end_overhead_ms": 1e3 * overhead,
        "calls_ms": 1e3 * calls,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=30, help="timed forward + backward passes per chunk")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: the store's work is single-threaded Python, and one thread "
        "keeps the compute reference steady on a shared machine)",
    )
    ap.add_argument("--out", type=Path, default=RESULTS / "store.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    load_start = os.getloadavg()
    wall = time.perf_counter()

    tiny = measure_chunk(
        "tiny block (h=64, s=32, min_numel=0)",
        _layer(64, 4),
        torch.randn(1, 32, 64, requires_grad=True),
        min_numel=0,
        reps=args.reps,
    )
    layer = measure_chunk(
        "TransformerEncoderLayer (h=512, s=256, b=1, fp32)",
        _layer(512, 8),
        torch.randn(1, 256, 512, requires_grad=True),
        min_numel=1024,
        reps=args.reps,
    )
    # The calls alone miss what autograd adds around them: a Python call per saved tensor and a Python
    # object for each tensor it hands to the hook. Measured end to end on the tiny block (compute small
    # enough for the difference to show), per saved tensor, and added to both chunks' calls.
    hook_us = 1e3 * max(0.0, tiny["end_to_end_overhead_ms"] - tiny["calls_ms"]) / tiny["saved_tensors"]
    layer_ms = layer["forward_backward_ms"]
    for row in (tiny, layer):
        row["hook_transition_per_tensor_us"] = hook_us
        row["overhead_ms"] = row["calls_ms"] + hook_us * row["saved_tensors"] / 1e3
        row["overhead_per_tensor_us"] = 1e3 * row["overhead_ms"] / row["saved_tensors"]
        row["overhead_vs_layer_compute"] = row["overhead_ms"] / layer_ms

    print("one chunk's life, ms, best of the runs. calls: the store's calls alone on the tensors the forward")
    print("saves, minus the same copies done raw; overhead: calls + autograd's hook calls (per saved tensor,")
    print("measured end to end on the tiny block); e2e: with-store life minus plain forward + backward minus")
    print(
        "copies, measured (noise-bound on the layer); vs layer: overhead / the layer's forward + backward\n"
    )
    header = (
        f"{'chunk':<50} {'saved':>5} {'copies':>6} {'MiB':>5} | {'fwd+bwd':>8} {'copies':>7} | "
        f"{'calls':>6} {'overhead':>8} {'us/tensor':>9} {'e2e':>7} | {'vs layer':>8}"
    )
    print(header)
    print("-" * len(header))
    for r in (tiny, layer):
        print(
            f"{r['chunk']:<50} {r['saved_tensors']:>5} {r['copies']:>6} "
            f"{r['captured_bytes'] / 2**20:>5.2f} | "
            f"{r['forward_backward_ms']:>8.3f} {r['raw_copies_ms']:>7.3f} | "
            f"{r['calls_ms']:>6.3f} {r['overhead_ms']:>8.3f} {r['overhead_per_tensor_us']:>9.1f} "
            f"{r['end_to_end_overhead_ms']:>7.3f} | {100 * r['overhead_vs_layer_compute']:>7.2f}%"
        )
    print(
        f"\nstore overhead per chunk: {tiny['overhead_ms']:.3f} ms on the tiny block "
        f"({tiny['overhead_per_tensor_us']:.1f} us per saved tensor), {layer['overhead_ms']:.3f} ms on the "
        f"layer = {100 * layer['overhead_vs_layer_compute']:.2f}% of its forward + backward "
        f"({layer_ms:.1f} ms best, {layer['forward_backward_median_ms']:.1f} ms median; "
        f"{torch.get_num_threads()} thread(s))"
    )

    result = {
        "meta": {
            "reps": args.reps,
            "threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "loadavg_1_5_15_start": list(load_start),
            "loadavg_1_5_15_end": list(os.getloadavg()),
            "wall_s": time.perf_counter() - wall,
            "calls": "the store's calls alone on the chunk's saved tensors - raw planned copies (bests)",
            "overhead": "calls + hook_transition_per_tensor * saved tensors",
            "hook_transition_per_tensor": "(tiny end_to_end - tiny calls) / tiny saved tensors",
            "end_to_end_overhead": "per phase, best with store - best without; minus raw planned copies",
            "overhead_vs_layer_compute": "overhead / best plain fwd+bwd of the layer",
        },
        "results": [tiny, layer],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
