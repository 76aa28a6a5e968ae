"""Host memory of loading one pipeline rank's share of a pretrained model: whole vs by part.

Why: every pipeline rank used to load the whole model with ``from_pretrained`` and keep its stages; the
recipe now reads only the rank's own tensors when the checkpoint needs converting
(`pp_offload.models.loading`). This measures both ways on one model saved in bf16 (as on the hub) and in
fp32, each load in a fresh process, as the peak resident set size above the process's size after its
imports (``ru_maxrss``; file pages of the memory-mapped checkpoint that a load touches count too). Linux
carries a process's peak across fork and exec, so this script's own process never imports torch: saving
and loading each run in a child of a small parent.

    python bench/bench_loading.py            # Llama, hidden 768, 16 layers, vocab 32000 (134M parameters)
    python bench/bench_loading.py --quick    # hidden 256, 8 layers

Writes bench/results/loading.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def _config(quick: bool) -> dict:
    if quick:
        return {
            "hidden_size": 256,
            "intermediate_size": 704,
            "num_hidden_layers": 8,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "vocab_size": 8000,
        }
    return {
        "hidden_size": 768,
        "intermediate_size": 2048,
        "num_hidden_layers": 16,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "vocab_size": 32000,
    }


def _save(where: Path, values: dict, dtype: str) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **values))
    model.to(getattr(torch, dtype)).save_pretrained(where)


def _measure(mode: str, where: str, pp: int, rank: int) -> dict:
    """In this (fresh) process: load rank ``rank``'s V stages of ``pp`` ranks the ``mode`` way."""
    import torch
    from transformers import AutoModelForCausalLM

    from pp_offload.models import split_model
    from pp_offload.models.loading import empty_model, load_split_weights

    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    stages = [rank, 2 * pp - 1 - rank]
    if mode == "whole":
        model = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32)
        split = split_model(model, num_stages=2 * pp, stage_indices=stages)
    else:
        model = empty_model(where, dtype=torch.float32)
        split = split_model(model, num_stages=2 * pp, stage_indices=stages)
        load_split_weights(split, model, where)
    held = sum(p.numel() * p.element_size() for p in split.module.parameters())
    total = sum(p.numel() * 4 for p in model.parameters())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"extra_mib": (peak - base) / 1024, "held_mib": held / 2**20, "model_fp32_mib": total / 2**20}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--rank", type=int, default=1)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--measure", nargs=2, metavar=("MODE", "DIR"), help=argparse.SUPPRESS)
    p.add_argument("--save", nargs=2, metavar=("DTYPE", "DIR"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.measure:
        print(json.dumps(_measure(args.measure[0], args.measure[1], args.pp, args.rank)))
        return 0
    if args.save:
        _save(Path(args.save[1]), _config(args.quick), args.save[0])
        return 0
    quick = ["--quick"] if args.quick else []
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in ("bfloat16", "float32"):
            where = Path(tmp) / dtype
            subprocess.run(
                [sys.executable, __file__, "--save", dtype, str(where), *quick],
                check=True,
                capture_output=True,
            )
            for mode in ("whole", "by part"):
                cmd = [
                    sys.executable,
                    __file__,
                    "--measure",
                    mode,
                    str(where),
                    "--pp",
                    str(args.pp),
                    "--rank",
                    str(args.rank),
                ]
                out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
                rows.append({"checkpoint": dtype, "mode": mode, **json.loads(out.strip().splitlines()[-1])})
    print(f"rank {args.rank} of pp {args.pp} (V stages), fp32 training weights; peak RSS above the imports")
    print(f"{'checkpoint':10} {'load':8} {'extra MiB':>10} {'held MiB':>9} {'model MiB':>10}")
    for r in rows:
        print(
            f"{r['checkpoint']:10} {r['mode']:8} {r['extra_mib']:10.0f} {r['held_mib']:9.0f} "
            f"{r['model_fp32_mib']:10.0f}"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "quick": args.quick,
        "pp": args.pp,
        "rank": args.rank,
        "model": _config(args.quick),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }
    (args.out / "loading.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out / 'loading.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
