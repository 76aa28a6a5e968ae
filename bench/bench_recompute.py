"""Offload + selective recompute: bytes per decoder layer an offload must move, with and without recomputing
the cheap ops, for Llama, Qwen2 and GPT-2 layers (CPU, bf16), and what the recompute costs.

Why: an offload store moves everything autograd saves, including tensors that are cheap to recompute in
backward (norm outputs and their fp32 copies, rotary outputs, activation-function outputs, elementwise
products). The PipeOffload paper recommends recomputing those instead of moving them. The policy measured
here is the usual selective-checkpointing one: keep the outputs of matmuls and of the attention kernel
(and the layer's input), recompute everything else.

How the bytes are measured: one layer's forward runs under saved-tensor hooks (the hooks
`pp_offload.runtime.store.ActivationStore` uses), and each saved tensor is attributed to the op that
produced it (its ``grad_fn``, or its base's for a view); distinct storages are counted once. "plain" =
every storage saved (what the store moves today); "selective" = the storages produced by matmuls or the
attention kernel, plus the layer input (what must stay saved when everything else is recomputed from
them; recomputing the first norm needs the input even where plain autograd saves only its fp32 copy).
The layer input is reported separately: on a stage's first layer it sits in the pipeline's receive
buffer and is not moved.

How the cost is measured: the same layer's forward + backward, plain vs under
``torch.utils.checkpoint`` with ``create_selective_checkpoint_contexts`` and the same policy (matmuls and
attention MUST_SAVE, the rest PREFER_RECOMPUTE), median of repeats, in fp32 (CPU bf16 matmuls are
emulated); gradients are checked equal. CPU timings with one thread: the ratio is indicative, absolute
times are not GPU times.

Not built here: moving the tensors torch's selective checkpointing caches through the store (its cache is
held by a dispatch mode, outside saved-tensor hooks); see docs/offload-policies.md.

    python bench/bench_recompute.py            # seq 256, hidden 512 (~2 min on 2 busy cores)
    python bench/bench_recompute.py --quick    # seq 128

Writes ``recompute.json`` and ``recompute.png`` to ``bench/results`` (or ``--out DIR``).
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"
KEPT_OPS = ("Mm", "Addmm", "Bmm", "ScaledDotProduct", "Linear", "Baddbmm")  # grad_fn name prefixes
HIDDEN, INTERMEDIATE, HEADS, KV_HEADS = 512, 1408, 8, 2


def _configs() -> dict[str, Any]:
    from transformers import GPT2Config, LlamaConfig, Qwen2Config

    common = {
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "num_hidden_layers": 1,
        "vocab_size": 256,
    }
    return {
        "llama": LlamaConfig(**common),
        "qwen2": Qwen2Config(**common),
        "gpt2": GPT2Config(
            n_embd=HIDDEN,
            n_inner=4 * HIDDEN,
            n_head=HEADS,
            n_layer=1,
            vocab_size=256,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        ),
    }


def _layer_and_inputs(name: str, config: Any, seq: int, dtype: torch.dtype = torch.bfloat16):
    """The model's one decoder layer, a forward that calls it as the model does, and its input."""
    from transformers import AutoModel

    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModel.from_config(config).to(dtype)
    x = torch.randn(1, seq, HIDDEN, dtype=dtype, requires_grad=True)
    if name == "gpt2":
        layer = model.h[0]

        def run(layer_fn, h):
            out = layer_fn(h)
            return out[0] if isinstance(out, tuple) else out

        return layer, run, x
    layer = model.layers[0]
    position_ids = torch.arange(seq).unsqueeze(0)
    cos_sin = model.rotary_emb(x, position_ids)

    def run(layer_fn, h):
        out = layer_fn(h, position_embeddings=cos_sin, position_ids=position_ids, attention_mask=None)
        return out[0] if isinstance(out, tuple) else out

    return layer, run, x


_VIEWS = (
    "View",
    "UnsafeView",
    "Transpose",
    "Permute",
    "Expand",
    "Reshape",
    "Squeeze",
    "Unsqueeze",
    "Slice",
    "Select",
    "Split",
    "AsStrided",
    "T",
)


def _producer(t: torch.Tensor) -> str:
    """The op that computed ``t``'s data: its grad_fn, looking through view ops (a linear layer's output
    is ``_unsafe_view(mm(...))``, a projection's heads a transpose of it)."""
    fn = t.grad_fn if t.grad_fn is not None else (t._base.grad_fn if t._base is not None else None)
    while fn is not None and type(fn).__name__.removesuffix("Backward0").removesuffix("Backward1") in _VIEWS:
        nxt = [f for f, _ in fn.next_functions if f is not None]
        if not nxt:
            break
        fn = nxt[0]
    if fn is None or type(fn).__name__ == "AccumulateGrad":
        return "leaf"
    return type(fn).__name__


def saved_bytes(layer, run, x) -> dict[str, Any]:
    """Distinct storages autograd saves in one forward, by producer, split kept / recomputable."""
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    seen: dict[int, tuple[int, str]] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in params and ptr not in seen and storage.nbytes() > 0:
            seen[ptr] = (storage.nbytes(), _producer(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run(layer, x)
    x_ptr = x.untyped_storage().data_ptr()
    by_producer: dict[str, int] = {}
    plain = kept = 0
    for ptr, (nbytes, producer) in seen.items():
        by_producer[producer] = by_producer.get(producer, 0) + nbytes
        plain += nbytes
        if ptr != x_ptr and producer.startswith(KEPT_OPS):
            kept += nbytes
    # recomputing the first norm needs the layer input, whether or not plain autograd saved it
    layer_input = x.untyped_storage().nbytes()
    return {
        "plain": plain,
        "selective": kept + layer_input,
        "layer_input": layer_input,
        "by_producer": dict(sorted(by_producer.items(), key=lambda kv: -kv[1])),
    }


def _policy():
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten
    keep = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}
    for name in (
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    ):
        op = getattr(aten, name, None)
        if op is not None:
            keep.add(op.default)

    def policy(ctx, func, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if func in keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def timing(layer, run, x, repeats: int) -> dict[str, Any]:
    """Forward + backward, plain vs selective checkpointing (same policy); grads must match. Run in fp32:
    CPU bf16 matmuls are emulated and would drown the recompute in matmul time."""
    layer = layer.float()
    x = x.detach().float().requires_grad_(True)
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    context = functools.partial(create_selective_checkpoint_contexts, _policy())

    def sac(h):
        return checkpoint(lambda y: run(layer, y), h, use_reentrant=False, context_fn=context)

    def step(fn) -> tuple[float, list[torch.Tensor]]:
        layer.zero_grad(set_to_none=True)
        x.grad = None
        start = time.perf_counter()
        fn(x).float().square().mean().backward()
        return time.perf_counter() - start, [p.grad.clone() for p in layer.parameters()] + [x.grad.clone()]

    step(lambda h: run(layer, h))  # warm-up
    step(sac)
    plain_t, sac_t = [], []
    for _ in range(repeats):
        t, ref = step(lambda h: run(layer, h))
        plain_t.append(t)
        t, got = step(sac)
        sac_t.append(t)
    for a, b in zip(ref, got, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # recompute is bitwise the same here
    plain, selective = statistics.median(plain_t), statistics.median(sac_t)
    return {"plain_s": plain, "selective_s": selective, "overhead": selective / plain - 1.0}


def run_all(seq: int, repeats: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out = {}
    for name, config in _configs().items():
        layer, run, x = _layer_and_inputs(name, config, seq)
        sizes = saved_bytes(layer, run, x)
        if name != "gpt2":  # rotary cos/sin were built in bf16 for the byte count: rebuild them in fp32
            layer, run, x = _layer_and_inputs(name, config, seq, dtype=torch.float32)
        sizes["per_token_hidden"] = {
            k: sizes[k] / (seq * HIDDEN) for k in ("plain", "selective", "layer_input")
        }
        out[name] = {**sizes, **timing(layer, run, x, repeats)}
    return out


def report(out: dict[str, Any], seq: int) -> str:
    head = (
        f"{'layer':<7}{'plain B/(s*h)':>14}{'selective':>11}{'of which input':>15}{'moved less':>12}"
        f"{'fwd+bwd ms':>12}{'with SAC':>10}{'recompute':>11}"
    )
    lines = [
        f"one decoder layer, bf16, CPU, seq {seq}, hidden {HIDDEN}, MLP {INTERMEDIATE}, "
        f"{HEADS} heads ({KV_HEADS} KV heads for Llama/Qwen2); bytes per token per hidden unit",
        head,
        "-" * len(head),
    ]
    for name, r in out.items():
        p = r["per_token_hidden"]
        # what a moved layer copies: its saved storages except the layer input when it is a receive buffer
        less = 1.0 - r["selective"] / r["plain"]
        lines.append(
            f"{name:<7}{p['plain']:>14.1f}{p['selective']:>11.1f}{p['layer_input']:>15.1f}"
            f"{100 * less:>11.1f}%{1e3 * r['plain_s']:>12.1f}{1e3 * r['selective_s']:>10.1f}"
            f"{100 * r['overhead']:>+10.1f}%"
        )
    lines.append("\nlargest saved storages by producing op (plain), bytes per token per hidden unit:")
    for name, r in out.items():
        top = ", ".join(f"{k} {v / (seq * HIDDEN):.1f}" for k, v in list(r["by_producer"].items())[:8])
        lines.append(f"  {name}: {top}")
    lines.append(
        "\nmoved less = 1 - selective / plain: the share of a layer's offload traffic that recomputing the "
        "cheap ops removes; recompute = extra forward+backward time of torch's selective checkpointing with "
        "the same policy (CPU fp32, 1 thread; gradients checked equal)"
    )
    return "\n".join(lines)


def plot(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(out)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], [out[n]["per_token_hidden"]["plain"] for n in names], 0.4, label="plain")
    ax.bar(
        [x + 0.2 for x in xs],
        [out[n]["per_token_hidden"]["selective"] for n in names],
        0.4,
        label="selective recompute",
    )
    for x, n in zip(xs, names, strict=True):
        ax.text(
            x + 0.2,
            out[n]["per_token_hidden"]["selective"],
            f"{100 * out[n]['overhead']:+.0f}% time",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("saved bytes per token per hidden unit (bf16)")
    ax.set_title("one decoder layer: what an offload moves")
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
    out = run_all(seq, repeats=3 if args.quick else 5)
    print(report(out, seq))
    data = {
        "bench": "recompute",
        "seq": seq,
        "hidden": HIDDEN,
        "intermediate": INTERMEDIATE,
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
