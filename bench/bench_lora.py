"""Full fine-tuning vs LoRA under pipeline parallelism: per-rank memory, and what LoRA does to W.

Three parts:

1. measured on CPU (two small Llamas, hidden 256 and 768, 2 layers, fp32): F, I and W of the decoder
   layers with torch's own split backward (what a pipeline stage runs), full vs LoRA; the measured W/F
   ratio next to the planner's formula (`pp_offload.plan.costs`). Also the bytes autograd saves per
   layer with and without adapters (the planner uses full fine-tuning's figure for both), and the
   planner's parameter / gradient / optimizer bytes against the real LoRA model and a real AdamW step
   (they must be equal);
2. the planner (`pp_offload.plan`) on an 8B Llama config (Llama-3-8B shapes, bf16 with fp32 masters and
   AdamW moments, microbatch 1): per-rank memory of full fine-tuning and LoRA (rank 16, every projection)
   under 1F1B, V-Half, V-Min and V-Half with full offload, seq 4096 and 8192, 4 and 8 pipeline ranks,
   with which of a 24, 48 and 80 GiB GPU each fits (2 GiB reserve included). ``off`` is the share of
   chunks the planner's offload plan moves to host: it skips chunks whose lifespan cannot hide a copy
   round trip, which on an H100's PCIe at these shapes is all of them;
3. what the planner recommends on 80 GiB for full vs LoRA: with W nearly empty, zero-bubble schedules have
   nothing to fill their bubbles with.

    python bench/bench_lora.py            # ~1-2 minutes on 2 busy cores
    python bench/bench_lora.py --quick    # fewer repetitions, pp=4 recommendation only

Writes ``lora.json`` (every number) and ``lora.png`` to ``bench/results`` (or ``--out DIR``).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pp_offload.plan.shapes import SHAPES

RESULTS = Path(__file__).resolve().parent / "results"
GIB = 1 << 30
LLAMA_8B = SHAPES["llama-3-8b"]
CPU_MODEL = {
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
}
# the pass timing also at a wider model: per-operation overhead weighs less, W/F moves toward the formula
WIDER = {
    **CPU_MODEL,
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
}
RANK = 16
GPUS = (24, 48, 80)
SCHEDULES = (
    ("Schedule1F1B", "none"),
    ("ScheduleVHalf", "none"),
    ("ScheduleVMin", "none"),
    ("ScheduleVHalf", "full"),
)


def _cpu_model(lora: bool, shape: dict[str, Any] | None = None):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from pp_offload.models.lora import apply_lora, unwrap_peft

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **(shape or CPU_MODEL)))
    if lora:
        model = unwrap_peft(apply_lora(model, r=RANK, alpha=2.0 * RANK))
    return model


def measure_passes(
    *, seq_len: int, batch: int, repeats: int, shape: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Median seconds of F, I, W of the model's decoder layers (one stage without embedding and head),
    with torch's own split backward (what a pipeline stage runs for I and W: I keeps the intermediate
    gradients W needs, W computes only the trainable weights' gradients from them)."""
    import torch

    from pp_offload.runtime.compat import stage_backward_input, stage_backward_weight

    rows = {}
    for lora in (False, True):
        model = _cpu_model(lora, shape)
        layers = model.model.layers
        rotary = model.model.rotary_emb
        times: dict[str, list[float]] = {"F": [], "I": [], "W": []}
        for _ in range(repeats + 1):  # the first is a warm-up
            x = torch.randn(batch, seq_len, (shape or CPU_MODEL)["hidden_size"], requires_grad=True)
            pos = torch.arange(seq_len).unsqueeze(0)
            t0 = time.perf_counter()
            h = x
            emb = rotary(h, pos)
            for layer in layers:
                h = layer(h, attention_mask=None, position_embeddings=emb, position_ids=pos)
                h = h[0] if isinstance(h, tuple) else h
            t1 = time.perf_counter()
            _, groups = stage_backward_input([h], [torch.ones_like(h)], [x], layers.parameters())
            t2 = time.perf_counter()
            stage_backward_weight(layers.parameters(), groups)
            t3 = time.perf_counter()
            for key, value in (("F", t1 - t0), ("I", t2 - t1), ("W", t3 - t2)):
                times[key].append(value)
            layers.zero_grad(set_to_none=True)
        med = {k: statistics.median(v[1:]) for k, v in times.items()}
        trainable = sum(p.numel() for p in layers.parameters() if p.requires_grad)
        rows["lora" if lora else "full"] = {**med, "trainable_params": trainable}
    return rows


def planner_ratios(seq_len: int, shape: dict[str, Any] | None = None) -> dict[str, dict[str, float]]:
    import dataclasses

    from pp_offload.plan.costs import layer_flops
    from pp_offload.plan.model import model_spec

    spec = model_spec({**(shape or CPU_MODEL), "model_type": "llama"})
    out = {}
    for name, s in (("full", spec), ("lora", dataclasses.replace(spec, lora_rank=RANK))):
        f = layer_flops(s, seq_len=seq_len)
        out[name] = {"I/F": f.I / f.F, "W/F": f.W / f.F}
    return out


def saved_per_layer(*, seq_len: int) -> dict[str, int]:
    """Bytes autograd saves in one decoder layer's forward (counted like the activation store)."""
    import torch

    from pp_offload.plan.validate import saved_bytes

    out = {}
    for lora in (False, True):
        model = _cpu_model(lora)
        layer = model.model.layers[0]
        x = torch.randn(1, seq_len, CPU_MODEL["hidden_size"], requires_grad=True)
        pos = torch.arange(seq_len).unsqueeze(0)
        emb = model.model.rotary_emb(x, pos)
        nbytes, _ = saved_bytes(
            lambda layer=layer, x=x, emb=emb, pos=pos: layer(
                x, attention_mask=None, position_embeddings=emb, position_ids=pos
            ),
            keep=[x],
        )
        out["lora" if lora else "full"] = nbytes
    return out


def state_check() -> dict[str, dict[str, int]]:
    """The planner's parameter, gradient and AdamW bytes (fp32) against a real LoRA model after a step."""
    import dataclasses

    import torch

    from pp_offload.plan.memory import state_bytes
    from pp_offload.plan.model import model_spec

    model = _cpu_model(True)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-3)
    ids = torch.randint(0, CPU_MODEL["vocab_size"], (1, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    measured = {
        "params": sum(p.numel() * p.element_size() for p in model.parameters()),
        "grads": sum(
            p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None
        ),
        "optimizer": sum(
            t.numel() * t.element_size()
            for state in optimizer.state.values()
            for t in state.values()
            if torch.is_tensor(t) and t.dim() > 0
        ),
    }
    spec = dataclasses.replace(model_spec({**CPU_MODEL, "model_type": "llama"}), lora_rank=RANK)
    est = state_bytes(spec, "fp32", [(CPU_MODEL["num_hidden_layers"], True, True)])
    return {
        "measured": measured,
        "planner": {"params": est.params, "grads": est.grads, "optimizer": est.optimizer},
    }


def memory_table(quick: bool) -> list[dict[str, Any]]:
    from pp_offload.plan import plan

    rows = []
    for seq in (4096, 8192):
        for pp in (4, 8):
            for lora in (0, RANK):
                result = plan(
                    LLAMA_8B,
                    seq_len=seq,
                    microbatch_size=1,
                    num_microbatches=4 * pp,
                    pp=pp,
                    gpu_memory_gib=10_000,
                    machine="H100",
                    dtype="bf16",
                    schedules=sorted({s for s, _ in SCHEDULES}),
                    offload=("none", "full"),
                    recompute="none",  # this table compares LoRA with full fine-tuning, not recompute
                    evaluate_dominated=True,
                    search="fast",
                    suggest=False,
                    jobs=1,
                    lora_rank=lora,
                )
                for schedule, offload in SCHEDULES:
                    c = result.candidate(schedule, offload)
                    parts = c.breakdown[c.peak_rank]
                    gib = {k: v / GIB for k, v in parts.items()}
                    rows.append(
                        {
                            "seq_len": seq,
                            "pp": pp,
                            "mode": f"LoRA r{lora}" if lora else "full FT",
                            "schedule": c.label,
                            "peak_rank": c.peak_rank,
                            "weights_gib": gib["params"],
                            "grads_gib": gib["grads"],
                            "optimizer_gib": gib["optimizer"],
                            "activations_gib": gib["activations"],
                            "other_gib": gib["recv_buffers"] + gib["transient"] + gib["reserve"],
                            "total_gib": c.peak_bytes / GIB,
                            "step_s": c.step_time,
                            "bubble": c.bubble,
                            "offloaded_share": c.offloaded_share,
                            "fits": {str(g): c.peak_bytes <= g * GIB for g in GPUS},
                        }
                    )
    return rows


def recommendations(quick: bool) -> list[dict[str, Any]]:
    from pp_offload.plan import PlanError, plan

    rows = []
    for pp in (4,) if quick else (4, 8):
        for lora in (0, RANK):
            try:
                result = plan(
                    LLAMA_8B,
                    seq_len=4096,
                    microbatch_size=1,
                    num_microbatches=4 * pp,
                    pp=pp,
                    gpu_memory_gib=80,
                    machine="H100",
                    dtype="bf16",
                    search="fast",
                    suggest=False,
                    jobs=1,
                    lora_rank=lora,
                )
            except PlanError as error:
                rows.append(
                    {"pp": pp, "mode": "LoRA" if lora else "full FT", "recommended": None, "why": str(error)}
                )
                continue
            fitting = [c for c in result.candidates if c.fits and c.evaluated]
            by_name = {c.label: c for c in fitting}
            rec = result.recommended
            zb = by_name.get("ScheduleVZB") or by_name.get("ScheduleZBVZeroBubble")
            half = by_name.get("ScheduleVHalf")
            rows.append(
                {
                    "pp": pp,
                    "mode": f"LoRA r{lora}" if lora else "full FT",
                    "recommended": rec.label if rec else None,
                    "step_s": rec.step_time if rec else None,
                    "bubble": rec.bubble if rec else None,
                    "zb_label": zb.label if zb else None,
                    "zb_bubble": zb.bubble if zb else None,
                    "vhalf_bubble": half.bubble if half else None,
                    "vhalf_vs_best": half.step_time / rec.step_time - 1 if half and rec else None,
                    "ranking": [(c.label, round(c.step_time, 4), round(c.bubble, 4)) for c in fitting[:6]],
                }
            )
    return rows


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    parts = ("weights_gib", "grads_gib", "optimizer_gib", "activations_gib", "other_gib")
    colors = ("#4c72b0", "#dd8452", "#c44e52", "#55a868", "#999999")
    for ax, seq in zip(axes, (4096, 8192), strict=True):
        sel = [r for r in rows if r["seq_len"] == seq and r["pp"] == 8]
        labels = [f"{r['mode']}\n{r['schedule'].replace('Schedule', '')}" for r in sel]
        bottom = [0.0] * len(sel)
        for part, color in zip(parts, colors, strict=True):
            values = [r[part] for r in sel]
            ax.bar(range(len(sel)), values, bottom=bottom, color=color, label=part.replace("_gib", ""))
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        for g in GPUS:
            ax.axhline(g, color="black", lw=0.8, ls="--")
            ax.text(len(sel) - 0.5, g, f"{g} GiB", va="bottom", ha="right", fontsize=8)
        ax.set_xticks(range(len(sel)), labels, rotation=60, ha="right", fontsize=7)
        ax.set_title(f"Llama 8B shapes, pp=8, seq {seq}: peak rank's memory")
    axes[0].set_ylabel("GiB per rank (planner)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    began = time.perf_counter()
    seq = 256
    passes, formula = {}, {}
    print(f"1. measured on CPU: seq {seq}, batch 2, fp32, LoRA rank {RANK} on every projection")
    print(
        f"{'hidden':>6} {'mode':>6} {'trainable':>10} {'F ms':>8} {'I ms':>8} {'W ms':>8} {'W/F meas':>9} "
        f"{'W/F plan':>9} {'I/F meas':>9} {'I/F plan':>9}"
    )
    for shape in (CPU_MODEL, WIDER):
        key = f"hidden_{shape['hidden_size']}"
        passes[key] = measure_passes(seq_len=seq, batch=2, repeats=3 if args.quick else 5, shape=shape)
        formula[key] = planner_ratios(seq, shape)
        for mode, r in passes[key].items():
            f = formula[key][mode]
            print(
                f"{shape['hidden_size']:>6} {mode:>6} {r['trainable_params']:>10} {r['F'] * 1e3:>8.2f} "
                f"{r['I'] * 1e3:>8.2f} {r['W'] * 1e3:>8.2f} {r['W'] / r['F']:>9.3f} {f['W/F']:>9.3f} "
                f"{r['I'] / r['F']:>9.3f} {f['I/F']:>9.3f}"
            )
    saved = saved_per_layer(seq_len=seq)
    print(
        f"saved for backward per layer: full {saved['full'] / 2**20:.2f} MiB, "
        f"LoRA {saved['lora'] / 2**20:.2f} MiB ({saved['lora'] / saved['full'] - 1:+.1%}; the planner counts "
        "full fine-tuning's bytes for both)"
    )
    state = state_check()
    print(
        "state bytes, LoRA model (fp32):",
        {k: (state["measured"][k], state["planner"][k]) for k in state["measured"]},
        "(measured, planner)",
    )

    rows = memory_table(args.quick)
    print(
        "\n2. planner, Llama-3-8B shapes, bf16 (fp32 masters + AdamW), microbatch 1, m = 4 x pp, H100; "
        "peak rank, GiB"
    )
    header = (
        f"{'seq':>5} {'pp':>3} {'mode':>10} {'schedule':<32} {'weights':>8} {'grads':>7} {'optim':>7} "
        f"{'activ':>7} {'other':>6} {'total':>7} {'off':>5}  " + " ".join(f"{g:>3}G" for g in GPUS)
    )
    print(header)
    for r in rows:
        fits = " ".join(f"{'yes' if r['fits'][str(g)] else ' no':>4}" for g in GPUS)
        print(
            f"{r['seq_len']:>5} {r['pp']:>3} {r['mode']:>10} {r['schedule']:<32} {r['weights_gib']:>8.2f} "
            f"{r['grads_gib']:>7.2f} {r['optimizer_gib']:>7.2f} {r['activations_gib']:>7.2f} "
            f"{r['other_gib']:>6.2f} {r['total_gib']:>7.2f} {r['offloaded_share']:>5.0%}  {fits}"
        )

    recs = recommendations(args.quick)
    print("\n3. planner's choice on 80 GiB, seq 4096 (all schedules, offload policies)")
    for r in recs:
        if r["recommended"] is None:
            print(f"pp={r['pp']} {r['mode']}: nothing fits")
            continue
        zb = f"{r['zb_label']} bubble {r['zb_bubble']:.1%}" if r["zb_label"] else "no zero-bubble fits"
        vh = (
            f"V-Half bubble {r['vhalf_bubble']:.1%} ({r['vhalf_vs_best']:+.1%} step time)"
            if r["vhalf_bubble"] is not None
            else ""
        )
        print(
            f"pp={r['pp']} {r['mode']:>9}: {r['recommended']} (step {r['step_s']:.3f} s, "
            f"bubble {r['bubble']:.1%}); {zb}; {vh}"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    out = {
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "seconds": time.perf_counter() - began,
        "cpu_passes": passes,
        "planner_ratios": formula,
        "saved_per_layer_bytes": saved,
        "state_check": state,
        "memory": rows,
        "recommendations": recs,
    }
    (args.out / "lora.json").write_text(json.dumps(out, indent=2) + "\n")
    _plot(rows, args.out / "lora.png")
    print(f"\nwrote {args.out / 'lora.json'} and {args.out / 'lora.png'} ({out['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
