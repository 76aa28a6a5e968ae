"""Offload + selective recompute: the bytes the activation store moves per decoder layer, with and without
recomputing the cheap ops, for Llama, Qwen2 and GPT-2 layers (CPU, bf16), and what the recompute costs.

Why: an offload store moves everything autograd saves, including tensors that are cheap to recompute in
backward (norm outputs and their fp32 copies, rotary outputs, activation-function outputs, elementwise
products). Selective recompute (``activation_checkpointing(..., mode="selective")``,
`pp_offload.runtime.recompute`) keeps only the outputs of matmuls and of the attention kernel and hands
them to the store, so fewer, larger tensors move.

How the bytes are measured: THROUGH THE STORE, as the runtime moves them. A 3-layer model (the family's
own ``AutoModel``, bf16, sdpa attention) runs one forward on a stage input (``inputs_embeds``, which the
pipeline holds and the store leaves in place) under `pp_offload.runtime.store.ActivationStore`:

- "layer entry": each layer captured as its own store entry from forward hooks and offloaded when it
  returns, exactly as the budget policies do (`pp_offload.runtime.offload`); the middle layer's entry is
  reported (the first one's input is the stage input, which is not moved);
- "chunk / layer": the 3 layers captured as one chunk (a middle stage's chunk under policy ``full``),
  divided by 3 (storages shared by neighbouring layers count once).

The layer-entry run is then reloaded and backpropagated; its gradients must equal the plain run's
(bitwise here), so what moved is what backward needed. Modes: plain (no checkpointing), selective, full
(each layer recomputed from its input: what it keeps is only that input).

How the cost is measured: forward + backward of the same 3-layer model in fp32 (CPU bf16 matmuls are
emulated and would drown the recompute), no store, plain vs selective vs full checkpointing, median of
repeats, one thread: the ratio is indicative, absolute times are not GPU times.

Also reported (JSON): autograd's saved storages of the plain layer by producing op (saved-tensor hooks),
the breakdown behind the plain bytes.

    python bench/bench_recompute.py            # seq 256, hidden 512 (~1 min on 2 busy cores)
    python bench/bench_recompute.py --quick    # seq 128

Writes ``recompute.json`` and ``recompute.png`` to ``bench/results`` (or ``--out DIR``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pp_offload.parallel import activation_checkpointing
from pp_offload.runtime.store import ActivationStore

RESULTS = Path(__file__).resolve().parent / "results"
HIDDEN, INTERMEDIATE, HEADS, KV_HEADS = 512, 1408, 8, 2
LAYERS = 3
MIDDLE = 1  # the layer entry reported: its input is a layer output, not the stage input
MODES = ("plain", "selective", "full")


def _configs() -> dict[str, Any]:
    from transformers import GPT2Config, LlamaConfig, Qwen2Config

    common = {
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "num_hidden_layers": LAYERS,
        "vocab_size": 256,
    }
    return {
        "llama": LlamaConfig(**common),
        "qwen2": Qwen2Config(**common),
        "gpt2": GPT2Config(
            n_embd=HIDDEN,
            n_inner=4 * HIDDEN,
            n_head=HEADS,
            n_layer=LAYERS,
            vocab_size=256,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        ),
    }


def _layers(model: nn.Module) -> list[nn.Module]:
    return list(model.h if hasattr(model, "h") else model.layers)


def _model(config: Any, mode: str, dtype: torch.dtype) -> nn.Module:
    from transformers import AutoModel

    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModel.from_config(config).to(dtype).train()
    if mode != "plain":
        activation_checkpointing({0: model}, layers=_layers, mode=mode)
    return model


def _input(seq: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(1, seq, HIDDEN, generator=gen).to(dtype).requires_grad_(True)


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(inputs_embeds=x, use_cache=False).last_hidden_state.float().square().mean()


def _grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    return [p.grad for p in model.parameters()] + [x.grad]


@contextlib.contextmanager
def _captured_layers(model: nn.Module, store: ActivationStore, keep: list[torch.Tensor], *, per_layer: bool):
    """Capture the layers' saved tensors from forward hooks and offload them, as the runtime does: each
    layer its own entry offloaded as soon as it returns (``per_layer``: the budget policies), or all layers
    one entry (a middle stage's chunk: no embedding, no final norm; policy ``full``)."""
    layers = _layers(model)
    handles, open_capture = [], []

    def pre(index: int) -> None:
        if per_layer or index == 0:
            stack = contextlib.ExitStack()
            stack.enter_context(store.capture(index if per_layer else "chunk", keep=keep))
            open_capture.append(stack)

    def post(index: int) -> None:
        if per_layer or index == len(layers) - 1:
            open_capture.pop().close()
            store.offload(index if per_layer else "chunk")

    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(lambda m, a, i=i: pre(i)))
        handles.append(layer.register_forward_hook(lambda m, a, o, i=i: post(i)))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def store_bytes(config: Any, mode: str, seq: int) -> dict[str, Any]:
    """Bytes the store moved per layer entry (then reloaded and backpropagated: the gradients) and for
    the 3 layers as one chunk (forward only)."""
    model = _model(config, mode, torch.bfloat16)
    x = _input(seq, torch.bfloat16)
    store = ActivationStore("cpu")
    with _captured_layers(model, store, keep=[x], per_layer=True):
        loss = _loss(model, x)
    stats = store.stats().chunks
    assert all(s.state == "offloaded" and s.resident_bytes == 0 for s in stats.values())
    out: dict[str, Any] = {
        "layer": {str(k): s.offloaded_bytes for k, s in stats.items()},
        "cached": {str(k): s.cached for k, s in stats.items()},
    }
    for k in reversed(range(LAYERS)):
        store.reload(k)
    loss.backward()
    for k in range(LAYERS):
        store.release(k)
    out["grads"] = _grads(model, x)
    with _captured_layers(model, store, keep=[x], per_layer=False):
        _loss(model, x)
    out["chunk"] = store.stats().chunks["chunk"].offloaded_bytes
    store.release("chunk")
    return out


def _producer(t: torch.Tensor) -> str:
    fn = t.grad_fn if t.grad_fn is not None else (t._base.grad_fn if t._base is not None else None)
    views = ("View", "UnsafeView", "Transpose", "Permute", "Expand", "Reshape", "Slice", "Select", "T")
    while fn is not None and type(fn).__name__.removesuffix("Backward0").removesuffix("Backward1") in views:
        nxt = [f for f, _ in fn.next_functions if f is not None]
        if not nxt:
            break
        fn = nxt[0]
    return "leaf" if fn is None or type(fn).__name__ == "AccumulateGrad" else type(fn).__name__


def saved_by_producer(config: Any, seq: int) -> dict[str, int]:
    """The middle plain layer's distinct saved storages (bf16) by producing op, parameters excepted."""
    model = _model(config, "plain", torch.bfloat16)
    x = _input(seq, torch.bfloat16)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, tuple[int, str]] = {}
    active = [False]

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if active[0] and ptr not in params and ptr not in seen and storage.nbytes() > 0:
            seen[ptr] = (storage.nbytes(), _producer(t))
        return t

    layer = _layers(model)[MIDDLE]
    hooks = [
        layer.register_forward_pre_hook(lambda *a: active.__setitem__(0, True)),
        layer.register_forward_hook(lambda *a: active.__setitem__(0, False)),
    ]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _loss(model, x)
    for hook in hooks:
        hook.remove()
    by: dict[str, int] = {}
    for nbytes, producer in seen.values():
        by[producer] = by.get(producer, 0) + nbytes
    return dict(sorted(by.items(), key=lambda kv: -kv[1]))


def timing(config: Any, seq: int, repeats: int) -> dict[str, float]:
    """fp32 forward + backward of the 3-layer model per mode (no store), median seconds."""
    models = {mode: _model(config, mode, torch.float32) for mode in MODES}
    x = _input(seq, torch.float32)

    def step(mode: str) -> float:
        model = models[mode]
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        _loss(model, x).backward()
        return time.perf_counter() - start

    for mode in MODES:  # warm-up
        step(mode)
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(repeats):
        for mode in MODES:  # interleaved, so machine load drifts over all modes alike
            times[mode].append(step(mode))
    return {mode: statistics.median(ts) for mode, ts in times.items()}


def run_all(seq: int, repeats: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for name, config in _configs().items():
        per_mode = {mode: store_bytes(config, mode, seq) for mode in MODES}
        reference = per_mode["plain"]["grads"]
        for mode, r in per_mode.items():
            for got, want in zip(r.pop("grads"), reference, strict=True):
                torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"{name} {mode}")
        unit = seq * HIDDEN
        seconds = timing(config, seq, repeats)
        out[name] = {
            "layer_entry_bytes": {m: r["layer"][str(MIDDLE)] for m, r in per_mode.items()},
            "layer_entries_bytes": {m: r["layer"] for m, r in per_mode.items()},
            "chunk_bytes": {m: r["chunk"] for m, r in per_mode.items()},
            "cached_tensors_middle_layer": {m: r["cached"][str(MIDDLE)] for m, r in per_mode.items()},
            "per_token_hidden": {
                "layer_entry": {m: r["layer"][str(MIDDLE)] / unit for m, r in per_mode.items()},
                "chunk_per_layer": {m: r["chunk"] / unit / LAYERS for m, r in per_mode.items()},
            },
            "fwd_bwd_s": seconds,
            "overhead": {m: seconds[m] / seconds["plain"] - 1.0 for m in MODES if m != "plain"},
            "plain_saved_by_producer": saved_by_producer(config, seq),
        }
    return out


def report(out: dict[str, Any], seq: int) -> str:
    head = (
        f"{'layer':<7}{'plain':>8}{'selective':>11}{'full':>7}{'sel. vs plain':>15}"
        f"{'chunk/layer: plain':>20}{'selective':>11}{'full':>7}"
        f"{'fwd+bwd ms':>12}{'selective':>11}{'full':>8}"
    )
    lines = [
        "bytes the activation store moved per decoder layer, per token per hidden unit "
        f"(bf16, CPU, seq {seq}, hidden {HIDDEN}, MLP {INTERMEDIATE}, {HEADS} heads, {KV_HEADS} KV heads "
        "for Llama/Qwen2, sdpa);\nleft: a middle layer's own entry (budget policies), right: a 3-layer "
        "chunk / 3 (policy full); time: fp32 forward+backward of 3 layers, extra time vs plain",
        head,
        "-" * len(head),
    ]
    for name, r in out.items():
        e, c = r["per_token_hidden"]["layer_entry"], r["per_token_hidden"]["chunk_per_layer"]
        less = 1.0 - e["selective"] / e["plain"]
        lines.append(
            f"{name:<7}{e['plain']:>8.1f}{e['selective']:>11.1f}{e['full']:>7.1f}{-100 * less:>14.1f}%"
            f"{c['plain']:>20.1f}{c['selective']:>11.1f}{c['full']:>7.1f}"
            f"{1e3 * r['fwd_bwd_s']['plain']:>12.1f}{100 * r['overhead']['selective']:>+10.1f}%"
            f"{100 * r['overhead']['full']:>+7.1f}%"
        )
    lines.append("\nplain layer's saved storages by producing op (hooks), bytes per token per hidden unit:")
    for name, r in out.items():
        top = ", ".join(
            f"{k} {v / (seq * HIDDEN):.1f}" for k, v in list(r["plain_saved_by_producer"].items())[:8]
        )
        lines.append(f"  {name}: {top}")
    lines.append(
        "\nmoved: ChunkStats.offloaded_bytes of the store's entries (views counted once, the stage input "
        "left in place); every run reloaded and backpropagated with gradients bitwise equal to plain's"
    )
    return "\n".join(lines)


def plot(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(out)
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    width = 0.26
    for j, mode in enumerate(MODES):
        xs = [i + (j - 1) * width for i in range(len(names))]
        values = [out[n]["per_token_hidden"]["layer_entry"][mode] for n in names]
        ax.bar(xs, values, width, label=mode if mode == "plain" else f"{mode} recompute")
        if mode != "plain":
            for x, n, v in zip(xs, names, values, strict=True):
                label = f"{100 * out[n]['overhead'][mode]:+.0f}%\ntime"
                ax.text(x, v, label, ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("bytes moved per token per hidden unit (bf16)")
    ax.set_title("one decoder layer's store entry: what an offload moves")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    seq = 128 if args.quick else 256
    start = time.perf_counter()
    out = run_all(seq, repeats=3 if args.quick else 9)
    print(report(out, seq))
    data = {
        "bench": "recompute",
        "seq": seq,
        "hidden": HIDDEN,
        "intermediate": INTERMEDIATE,
        "layers": LAYERS,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "seconds": time.perf_counter() - start,
        "results": out,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    name = "recompute_quick" if args.quick else "recompute"
    (args.out / f"{name}.json").write_text(json.dumps(data, indent=1))
    plot(out, args.out / f"{name}.png")
    print(f"\nwrote {args.out / (name + '.json')} and {args.out / (name + '.png')}")


if __name__ == "__main__":
    main()
