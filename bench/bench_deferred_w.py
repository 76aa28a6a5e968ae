"""One stage's split backward, torch's retained-graph split against deferred weight gradients: time and the
bytes held from I to W, in one process.

Why one process: ``bench_hotpath.py`` times whole pipeline steps on 2 gloo ranks, which a shared 2-core
machine makes noisy (the same code path timed twice differs by tens of percent under load). Here the two
splits of the same stage (a Llama of ``--layers`` decoder layers, hidden 256, seq 256, fp32, one thread)
run interleaved, ``--rounds`` times each, and the fastest of each is kept: what the split itself costs,
without the pipeline around it.

Per recompute mode (none, full, selective) and split (``--compiled``: also deferred W with each decoder
layer compiled in place, `pp_offload.runtime.compile.compile_layers`, inductor; none and full only, as
``train.compile`` refuses selective recompute):
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
    began = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(inputs_embeds=x, use_cache=False).last_hidden_state
    grad = torch.ones_like(out) / out.numel()
    forward = time.perf_counter()
    if deferred:
        with deferred_w.collecting():
            torch.autograd.backward([out], [grad], inputs=[x, *_not_deferred(model)])
        del out
    else:
        _, groups = compat.stage_backward_input([out], [grad], [x], model.parameters())
    after_i = time.perf_counter()
    alive = {(s.device, s.data_ptr()): s.nbytes() for s in (r() for r in saved) if s is not None}
    alive.update(deferred_w.queued_storages())  # the queue's inputs are saved tensors too: counted once
    held = sum(alive.values())
    if deferred:
        deferred_w.apply_queued_weight_grads(model.parameters())
    else:
        compat.installed_weight_pass()(model.parameters(), groups)  # one recomputation for all groups
    done = time.perf_counter()
    model.zero_grad(set_to_none=True)
    return {"F": forward - began, "I": after_i - forward, "W": done - after_i, "held": held}


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
        splits = SPLITS + ((COMPILED,) if compiled and mode != "selective" else ())
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
                    **{f"{k}_ms": b[k] * 1e3 for k in ("F", "I", "W")},
                    "step_ms": (b["F"] + b["I"] + b["W"]) * 1e3,
                    "held_mib": b["held"] / 2**20,
                    "runs_per_microbatch": max(runs.values()) if runs else 1,
                }
            )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    base = {r["split"]: r["step_ms"] for r in rows if r["recompute"] == "none"}
    lines = [
        f"{'recompute':10} {'split':19} {'F ms':>7} {'I ms':>7} {'W ms':>7} {'F+I+W':>7} {'x none':>6} "
        f"{'held MiB':>8} {'runs/mb':>7}"
    ]
    for r in rows:
        lines.append(
            f"{r['recompute']:10} {r['split']:19} {r['F_ms']:7.1f} {r['I_ms']:7.1f} {r['W_ms']:7.1f} "
            f"{r['step_ms']:7.1f} {r['step_ms'] / base[r['split']]:6.2f} {r['held_mib']:8.2f} "
            f"{r['runs_per_microbatch']:7d}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--compiled", action="store_true", help="add compiled deferred-W rows (inductor)")
    parser.add_argument("--name", default="deferred_w", help="results file name (without .json)")
    args = parser.parse_args(argv)
    rows = run(args.layers, args.rounds, args.compiled)
    print(table(rows))
    args.out.mkdir(parents=True, exist_ok=True)
    import torch

    meta = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "layers": args.layers,
        "rounds": args.rounds,
        "compiled": args.compiled,
        "load_average": os.getloadavg(),
    }
    path = args.out / f"{args.name}.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
