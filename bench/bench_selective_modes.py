"""What selective recompute's two dispatch modes cost per aten op, and what that makes of a stage, in one
process (CPU, one thread).

Why: selective recompute runs every aten op of a checkpointed layer's forward under its caching mode and
every op of each recomputation under its replay mode (`pp_offload.runtime.recompute`). Its step ratio on a
CPU is above its arithmetic floor by what those modes cost; this bench splits that into what any
``TorchDispatchMode`` costs (a bare mode that only calls the op: torch's C++ to Python round trip, its
``find_torch_dispatch_rule`` lookup and the dynamo-disable wrapper it puts on every ``__torch_dispatch__``)
and what the modes' own Python adds on top.

Two parts, each the fastest of ``--rounds`` rounds (cases interleaved in random order, so a change in the
machine's load hits each alike), thread CPU time:
- per op, us: a chain of small ``mul`` and ``view`` calls (ops the modes pass through) plain, under a bare
  mode, under each selective mode; and an ``mm`` kept by the forward mode (held, then handed over when the
  mode exits) and given back by the replay mode;
- one stage of ``--layers`` Llama layers (hidden 256, seq 256, fp32, deferred W; the stage of
  ``bench/bench_deferred_w.py``): F, I and W ms of recompute none, full, full with bare modes (every op
  under a mode, none replayed), selective and mlp, and the forward mode's cost per op of F over full's.

``--against PATH`` loads another ``recompute.py`` (e.g. ``git show REV:pp_offload/runtime/recompute.py``)
and times its modes beside this tree's in the same process: an A/B of a change to the modes. Writes
``selective_modes.json`` (or ``--name``) to ``bench/results`` (or ``--out DIR``).

    python bench/bench_selective_modes.py                      # ~1 min
    git show main:pp_offload/runtime/recompute.py > /tmp/recompute_main.py
    python bench/bench_selective_modes.py --against /tmp/recompute_main.py
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import platform
import random
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

OPS_PER_CHAIN = 400
RESULTS = Path(__file__).resolve().parent / "results"


def _versions(against: Path | None) -> dict[str, Any]:
    from pp_offload.runtime import recompute

    out = {"": recompute}
    if against is not None:
        spec = importlib.util.spec_from_file_location("pp_offload.runtime._recompute_against", against)
        if spec is None or spec.loader is None:
            raise SystemExit(f"--against {against}: not a Python file")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        out = {" (this tree)": recompute, f" ({against.name})": module}
    return out


def _bare_mode(calls: list[int] | None = None) -> Any:
    """A mode that only calls the op (and counts its calls in ``calls[0]`` when given)."""
    from pp_offload.runtime import compat

    class Bare(compat.TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            return func(*args, **kwargs) if kwargs else func(*args)

    class Counting(compat.TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            calls[0] += 1  # type: ignore[index]
            return func(*args, **kwargs) if kwargs else func(*args)

    return Bare if calls is None else Counting


def per_op(versions: dict[str, Any], rounds: int) -> tuple[str, dict[str, dict[str, float]]]:
    """us per op of pass-through and kept ops, plain, under a bare mode and under each version's modes."""
    import torch

    bare = _bare_mode()
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    contexts = {name: v.selective_checkpoint_context() for name, v in versions.items()}
    modes: dict[str, Any] = {"plain": lambda: None, "bare mode": bare}
    for name, ctx in contexts.items():
        modes[f"forward mode{name}"] = lambda ctx=ctx: ctx()[0]
        modes[f"replay mode{name}"] = lambda ctx=ctx: ctx()[1]

    def muls() -> None:
        x = a
        for _ in range(OPS_PER_CHAIN):
            x = torch.mul(x, b)

    def views() -> None:
        for _ in range(OPS_PER_CHAIN):
            a.view(64)

    def mms() -> None:
        for _ in range(OPS_PER_CHAIN):
            torch.mm(a, b)

    best: dict[tuple[str, str], float] = collections.defaultdict(lambda: float("inf"))

    def timed(key: tuple[str, str], mode: Any, fn: Any) -> None:
        began = time.thread_time()
        if mode is None:
            fn()
        else:
            with mode:  # the forward mode hands its kept outputs over on exit: counted
                fn()
        best[key] = min(best[key], time.thread_time() - began)

    for _ in range(rounds):
        for name in random.sample(list(modes), len(modes)):
            timed((name, "mul"), modes[name](), muls)
            timed((name, "view"), modes[name](), views)
        timed(("plain", "mm"), None, mms)
        for name, ctx in contexts.items():
            forward, replay = ctx()
            timed((f"forward mode{name}", "mm"), forward, mms)
            timed((f"replay mode{name}", "mm"), replay, mms)
    data = {
        name: {
            op: round(best[(name, op)] / OPS_PER_CHAIN * 1e6, 2)
            for op in ("mul", "view", "mm")
            if (name, op) in best
        }
        for name in modes
    }
    lines = [
        "| per op, us | mul (passed through) | view (passed through) | mm (kept: held / given back) |",
        "|---|---|---|---|",
    ]
    for name in modes:
        cells = [best.get((name, op)) for op in ("mul", "view", "mm")]
        lines.append(
            f"| {name} | "
            + " | ".join("-" if c is None else f"{c / OPS_PER_CHAIN * 1e6:.2f}" for c in cells)
            + " |"
        )
    return "\n".join(lines), data


def stage(versions: dict[str, Any], layers: int, rounds: int) -> tuple[str, dict[str, Any]]:
    """F, I, W ms of one stage per recompute cell, each version's modes swapped in for selective and mlp."""
    import torch

    from bench.bench_deferred_w import _one, _stage
    from pp_offload.parallel import fsdp

    bare = _bare_mode()
    embeds = torch.randn(1, 256, 256, generator=torch.Generator().manual_seed(1))
    models = {mode: _stage(layers, mode, True) for mode in ("none", "full", "selective", "mlp")}
    cells: list[tuple[str, str, Any]] = [
        ("none", "none", None),
        ("full", "full", None),
        ("full, bare modes", "selective", lambda: (bare(), bare())),
    ]
    for name, v in versions.items():
        ctx = v.selective_checkpoint_context()
        cells += [(f"selective{name}", "selective", ctx), (f"mlp{name}", "mlp", ctx)]
    real = fsdp._selective_context
    calls = [0]
    counting = _bare_mode(calls)
    fsdp._selective_context = lambda: lambda: (counting(), counting())
    try:  # the aten ops of the checkpointed layers' forward, all of which the caching mode sees
        models["selective"](inputs_embeds=embeds, use_cache=False)
    finally:
        fsdp._selective_context = real
    forward_ops = calls[0]
    best: dict[str, dict[str, float]] = collections.defaultdict(
        lambda: collections.defaultdict(lambda: float("inf"))
    )
    try:
        for _ in range(rounds):
            for name, mode, ctx in random.sample(cells, len(cells)):
                fsdp._selective_context = real if ctx is None else (lambda ctx=ctx: ctx)
                t = _one(models[mode], embeds, True)
                for p in ("F", "I", "W"):
                    best[name][p] = min(best[name][p], t[f"{p}_cpu"])
                best[name]["step"] = min(best[name]["step"], t["F_cpu"] + t["I_cpu"] + t["W_cpu"])
    finally:
        fsdp._selective_context = real
    none, full = best["none"], best["full"]
    lines = [
        f"{forward_ops // layers} aten ops per layer forward under the caching mode",
        "",
        "| cell | F ms | I ms | W ms | F+I+W ms | x none | F over full, us per forward op |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, mode, _ in cells:
        x = best[name]
        per_op = f"{(x['F'] - full['F']) / forward_ops * 1e6:.1f}" if mode == "selective" else "-"
        lines.append(
            f"| {name} | {x['F'] * 1e3:.2f} | {x['I'] * 1e3:.2f} | {x['W'] * 1e3:.2f} "
            f"| {x['step'] * 1e3:.2f} | {x['step'] / none['step']:.3f} | {per_op} |"
        )
    data = {
        "forward_ops_per_layer": forward_ops // layers,
        "cells": {name: {k: round(v * 1e3, 2) for k, v in best[name].items()} for name, _, _ in cells},
    }
    return "\n".join(lines), data


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--against", type=Path, help="another recompute.py to time beside this tree's")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--name", default="selective_modes", help="results file name (without .json)")
    args = parser.parse_args(argv)
    if args.layers < 1 or args.rounds < 1:
        parser.error(f"--layers and --rounds must be >= 1, got {args.layers} and {args.rounds}")
    import torch

    torch.set_num_threads(1)
    random.seed(0)
    versions = _versions(args.against)
    load = os.getloadavg()
    op_text, op_data = per_op(versions, 3 * args.rounds)
    print(op_text + "\n")
    stage_text, stage_data = stage(versions, args.layers, args.rounds)
    print(stage_text)
    after = os.getloadavg()
    print(f"\nload average before {load[0]:.2f}, after {after[0]:.2f} (1 min; 2 cores here)")
    meta = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "layers": args.layers,
        "rounds": args.rounds,
        "against": None if args.against is None else args.against.name,
        "load_average": {"before": load, "after": after},  # 1, 5, 15 min
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{args.name}.json"
    path.write_text(json.dumps({"meta": meta, "per_op_us": op_data, "stage_ms": stage_data}, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
