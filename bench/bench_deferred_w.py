"""One stage's split backward, torch's retained-graph split against deferred weight gradients: time and the
bytes held from I to W, in one process.

Why one process: ``bench_hotpath.py`` times whole pipeline steps on 2 gloo ranks, which a shared 2-core
machine makes noisy (the same code path timed twice differs by tens of percent under load). Here the two
splits of the same stage (a Llama of ``--layers`` decoder layers, hidden 256, seq 256, fp32, one thread)
run interleaved, ``--rounds`` times each, and the fastest of each is kept: what the split itself costs,
without the pipeline around it.

Per recompute mode (none, full, selective) and split (``--compiled``: also deferred W with each decoder
layer compiled in place, `pp_offload.runtime.compile.compile_layers`, inductor):
- ``F``, ``I``, ``W`` ms: the forward, torch's ``stage_backward_input`` / deferred W's one backward, and
  torch's ``stage_backward_weight`` / the queued GEMMs (`pp_offload.runtime.deferred_w`);
- ``held MiB``: bytes alive between I and W, by saved-tensor accounting: every distinct storage autograd
  saved in F that is still alive after I (torch's split keeps the graph, so all of them), parameters left
  out (the weights ops save are not activations; counted before 2026-11-28, which added 11.3 MiB to the
  rows without recompute), plus the deferred-W queue (`deferred_w.queued_bytes`). The stage input
  (0.25 MiB, saved by the first norm) is counted in every row;
- ``runs/mb``: forward runs of each checkpointed layer (F plus recomputations).

selective recompute's cached matmul outputs live outside autograd's saved tensors (outside an offload
capture): ``held MiB`` counts them in neither split.

    python bench/bench_deferred_w.py            # ~1 min
    TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 python bench/bench_deferred_w.py --compiled --rounds 5 \
        --name deferred_w_compiled              # + compiled rows, cold compile caches (~5 min)
Writes ``deferred_w.json`` (or ``--name``) to ``bench/results`` (or ``--out DIR``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
import types
import weakref
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
MODES = ("none", "full", "selective")
SPLITS = ("torch split", "deferred W")
COMPILED = "deferred W compiled"


def _stage(layers: int, recompute: str, deferred: bool, compiled: bool = False) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaModel

    from pp_offload.parallel import activation_checkpointing
    from pp_offload.runtime.deferred_w import defer_weight_grads

    config = LlamaConfig(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=512,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = LlamaModel(config)
    if recompute != "none":
        activation_checkpointing({0: model}, layers=lambda _: list(model.layers), mode=recompute)
    if deferred:
        defer_weight_grads([types.SimpleNamespace(submod=model, backward_maybe_with_nosync=lambda: None)])
    if compiled:
        from pp_offload.runtime.compile import compile_layers

        compile_layers([model])
    return model


def _one(model: Any, embeds: Any, deferred: bool) -> dict[str, float]:
    """F, I, W seconds and the bytes alive between I and W, for one microbatch."""
    import torch

    from pp_offload.runtime import compat, deferred_w

    saved: list[Any] = []
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t: torch.Tensor) -> Any:
        if t.untyped_storage().data_ptr() not in params:  # weights the ops save are not activations
            saved.append(weakref.ref(t.untyped_storage()))
        return t.detach()

    x = embeds.detach().requires_grad_(True)
    clocks = [(time.perf_counter(), time.thread_time())]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(inputs_embeds=x, use_cache=False).last_hidden_state
    grad = torch.ones_like(out) / out.numel()
    clocks.append((time.perf_counter(), time.thread_time()))
    if deferred:
        with deferred_w.collecting():
            torch.autograd.backward([out], [grad], inputs=[x, *_not_deferred(model)])
        del out
    else:
        _, groups = compat.stage_backward_input([out], [grad], [x], model.parameters())
    clocks.append((time.perf_counter(), time.thread_time()))
    alive = {(s.device, s.data_ptr()): s.nbytes() for s in (r() for r in saved) if s is not None}
    alive.update(deferred_w.queued_storages())  # the queue's inputs are saved tensors too: counted once
    held = sum(alive.values())
    if deferred:
        deferred_w.apply_queued_weight_grads(model.parameters())
    else:
        compat.installed_weight_pass()(model.parameters(), groups)  # one recomputation for all groups
    clocks.append((time.perf_counter(), time.thread_time()))
    model.zero_grad(set_to_none=True)
    times = {"held": held}
    for i, name in enumerate(("F", "I", "W")):
        times[name] = clocks[i + 1][0] - clocks[i][0]
        times[f"{name}_cpu"] = clocks[i + 1][1] - clocks[i][1]
    return times


def _not_deferred(model: Any) -> list[Any]:
    from pp_offload.runtime.deferred_w import deferred_modules

    queued = {id(m.weight) for _, m in deferred_modules(model)}
    return [p for p in model.parameters() if p.requires_grad and id(p) not in queued]


def run(layers: int, rounds: int, compiled: bool = False) -> list[dict[str, Any]]:
    import torch

    from pp_offload.runtime import compat
    from pp_offload.runtime.step_counts import count_layer_runs

    torch.set_num_threads(1)
    compat.share_weight_pass_recomputation(True)
    embeds = torch.randn(1, 256, 256, generator=torch.Generator().manual_seed(1))
    rows = []
    for mode in MODES:
        splits = SPLITS + ((COMPILED,) if compiled else ())
        models = {split: _stage(layers, mode, split != "torch split", split == COMPILED) for split in splits}
        best: dict[str, dict[str, float]] = {split: {} for split in splits}
        for round_ in range(rounds + 1):  # round 0 warms up; the splits alternate, so load hits both alike
            for split in splits:
                got = _one(models[split], embeds, split != "torch split")
                if round_:
                    for key, value in got.items():
                        best[split][key] = min(best[split].get(key, float("inf")), value)
        for split in splits:
            runs = count_layer_runs([models[split]])
            _one(models[split], embeds, split != "torch split")
            b = best[split]
            rows.append(
                {
                    "recompute": mode,
                    "split": split,
                    **{f"{k}_ms": b[k] * 1e3 for k in ("F", "I", "W", "F_cpu", "I_cpu", "W_cpu")},
                    "step_ms": (b["F"] + b["I"] + b["W"]) * 1e3,
                    "step_cpu_ms": (b["F_cpu"] + b["I_cpu"] + b["W_cpu"]) * 1e3,
                    "held_mib": b["held"] / 2**20,
                    # a compiled layer's recomputation runs inside its compiled backward, where no module
                    # hook sees it (tests/test_compile_gloo.py counts it with an op inside the graph: 2)
                    "runs_per_microbatch": None if split == COMPILED else max(runs.values()) if runs else 1,
                }
            )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """Wall-clock F, I, W and their sum, its ratio to the same split without recompute, the same ratio in
    the thread's CPU time (``cpu x``: what other processes on the machine do not inflate), the bytes held
    from I to W and the runs per microbatch."""
    base = {r["split"]: r for r in rows if r["recompute"] == "none"}
    lines = [
        f"{'recompute':10} {'split':19} {'F ms':>7} {'I ms':>7} {'W ms':>7} {'F+I+W':>7} {'x none':>6} "
        f"{'cpu x':>6} {'held MiB':>8} {'runs/mb':>7}"
    ]
    for r in rows:
        b = base[r["split"]]
        r["x_none"] = r["step_ms"] / b["step_ms"]
        r["x_none_cpu"] = r["step_cpu_ms"] / b["step_cpu_ms"]
        lines.append(
            f"{r['recompute']:10} {r['split']:19} {r['F_ms']:7.1f} {r['I_ms']:7.1f} {r['W_ms']:7.1f} "
            f"{r['step_ms']:7.1f} {r['x_none']:6.2f} {r['x_none_cpu']:6.2f} {r['held_mib']:8.2f} "
            + ("      -" if r["runs_per_microbatch"] is None else f"{r['runs_per_microbatch']:7d}")
        )
    return "\n".join(lines)


def floors(rows: list[dict[str, Any]], shares: dict[str, float] | None) -> dict[str, float]:
    """The least a recompute plan can cost under deferred W, from the times measured without recompute
    (CPU time): full recompute adds one forward of the checkpointed layers, 1 + F / (F + I + W) (the stage
    is its layers, so F is F of the layers, plus the small final norm and rotary table); selective adds the
    forward's ops that are neither matmuls nor attention (``shares``, from `profile`), the ones it
    recomputes. Checkpointing's own bookkeeping and the selective modes' per-op dispatch are not inherent
    and not counted."""
    plain = next(r for r in rows if r["recompute"] == "none" and r["split"] == "deferred W")
    total = plain["step_cpu_ms"]
    out = {"full": 1 + plain["F_cpu_ms"] / total}
    if shares is not None:
        out["selective"] = 1 + plain["F_cpu_ms"] * shares["other"] / total
    return out


_MATMUL = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear"})


def _classes(events: Any, rounds: int) -> dict[str, float]:
    """ms per round of aten self CPU time: matmuls, attention kernels, other aten ops."""
    out = {"matmul": 0.0, "attention": 0.0, "other": 0.0}
    for e in events:
        if not e.key.startswith("aten::"):
            continue
        kind = "matmul" if e.key in _MATMUL else "attention" if "attention" in e.key else "other"
        out[kind] += e.self_cpu_time_total / 1e3 / rounds
    return out


def profile(layers: int, rounds: int = 5) -> tuple[dict[str, float], str]:
    """Where the time goes (torch.profiler, self CPU time of each aten op; the profiler adds its own cost
    per op, so shares, not times, carry over): the plain stage's forward by class (matmuls, attention, the
    rest: what selective recompute recomputes), and deferred W's I under each recompute mode by class, plus
    what the aten ops leave unexplained (Python and dispatch: checkpoint's hooks, the selective modes'
    per-op Python, the deferring op's autograd node). Returns (forward shares, text)."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from pp_offload.runtime import deferred_w

    torch.set_num_threads(1)
    embeds = torch.randn(1, 256, 256, generator=torch.Generator().manual_seed(1))
    lines = []
    shares: dict[str, float] = {}
    for mode in MODES:
        model = _stage(layers, mode, True)
        for _ in range(2):
            _one(model, embeds, True)
        spans = []
        with torch_profile(activities=[ProfilerActivity.CPU]) as forward_prof:
            for _ in range(rounds):
                x = embeds.detach().requires_grad_(True)
                out = model(inputs_embeds=x, use_cache=False).last_hidden_state
        if mode == "none":
            f = _classes(forward_prof.key_averages(), rounds)
            shares = {k: v / sum(f.values()) for k, v in f.items()}
            classes = ", ".join(f"{k} {v:.0%}" for k, v in shares.items())
            lines.append(f"forward, no recompute (aten time): {classes}")
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(rounds):
                x = embeds.detach().requires_grad_(True)
                with torch.profiler.record_function("F"):
                    out = model(inputs_embeds=x, use_cache=False).last_hidden_state
                began = time.perf_counter()
                with deferred_w.collecting(), torch.profiler.record_function("I"):
                    torch.autograd.backward([out], [torch.ones_like(out)], inputs=[x, *_not_deferred(model)])
                spans.append(time.perf_counter() - began)
                del out
                deferred_w.apply_queued_weight_grads(model.parameters())
                model.zero_grad(set_to_none=True)
        # only the I passes: the aten ops under the "I" ranges
        i_events = [e for e in prof.events() if e.name == "I"]
        window = [(e.time_range.start, e.time_range.end) for e in i_events]
        inside = [
            e
            for e in prof.events()
            if e.name.startswith("aten::") and any(a <= e.time_range.start < b for a, b in window)
        ]
        by_class = {"matmul": 0.0, "attention": 0.0, "other": 0.0}
        for e in inside:
            kind = "matmul" if e.name in _MATMUL else "attention" if "attention" in e.name else "other"
            by_class[kind] += e.self_cpu_time_total / 1e3 / rounds
        wall = sorted(spans)[len(spans) // 2] * 1e3
        rest = wall - sum(by_class.values())
        lines.append(
            f"I, deferred W, {mode:9}: {wall:6.1f} ms under the profiler: "
            + ", ".join(f"{k} {v:5.1f}" for k, v in by_class.items())
            + f", Python/dispatch/autograd {rest:5.1f}"
        )
    return shares, "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--compiled", action="store_true", help="add compiled deferred-W rows (inductor)")
    parser.add_argument("--name", default="deferred_w", help="results file name (without .json)")
    parser.add_argument(
        "--no-profile",
        action="store_true",
        help="skip the profile (where I's time goes) and selective's floor",
    )
    args = parser.parse_args(argv)
    rows = run(args.layers, args.rounds, args.compiled)
    print(table(rows))
    shares, where = (None, "") if args.no_profile else profile(args.layers)
    least = floors(rows, shares)
    print(where)
    print(
        "least cost under deferred W (CPU time, from the plain stage's F, I, W): "
        + ", ".join(f"{mode} {x:.2f}x" for mode, x in least.items())
    )
    args.out.mkdir(parents=True, exist_ok=True)
    import torch

    meta = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "layers": args.layers,
        "rounds": args.rounds,
        "compiled": args.compiled,
        "load_average": list(os.getloadavg()),
        "forward_shares": shares,
        "floors": least,
        "profile": where,
    }
    path = args.out / f"{args.name}.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
