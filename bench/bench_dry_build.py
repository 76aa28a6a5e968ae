"""How long ``pp-offload train --check`` takes to build every rank's pipeline on the meta device.

`pp_offload.recipe.dry_build` builds, in one process, each pipeline rank's split, recompute wrappers,
lowered order and offload plan (with the planner's figures), for a model built from its config on the meta
device: no weights, no memory. This times it for config-built models of published shapes
(`pp_offload.plan.shapes`), with the settings `pp-offload plan` recommends for Llama-3-8B at seq 8192, pp 4,
16 microbatches on the H100 (ScheduleInterleavedZeroBubble, budget:sublayer, mlp recompute) and a few
neighbours. Each row is the best of ``--repeat`` builds (imports and the tokenizer not counted; the first
build of a process pays for imports, about 2 s). Nearly all of a budget row's time is the one offload plan
(`pp_offload.order.offload.plan_offload`, made once for all ranks), which every rank also makes at
start-up: at 16 stages x 32 microbatches (Llama-3-70B, pp 8) that plan alone takes tens of seconds.

    python bench/bench_dry_build.py     # about a minute

Writes ``dry_build.json`` to ``bench/results`` (or ``--out DIR``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import platform
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
CASES = (  # model, pp, microbatches, seq, schedule, offload, recompute
    ("llama-3-8b", 4, 16, 8192, "ScheduleInterleavedZeroBubble", "budget:sublayer", "mlp"),
    ("llama-3-8b", 4, 16, 8192, "ScheduleVHalf", "budget", "selective:0.75,mlp"),
    ("llama-3-8b", 4, 16, 8192, "ScheduleZBVZeroBubble", "full", False),
    ("llama-3-70b", 8, 32, 4096, "ScheduleInterleavedZeroBubble", "budget:sublayer", "mlp"),
)


def _config(model: str, pp: int, m: int, seq: int, schedule: str, offload: str, recompute, out: str):
    from pp_offload.plan.shapes import SHAPES
    from pp_offload.recipe import RecipeConfig

    shape = SHAPES[model] | {"max_position_embeddings": seq}
    return RecipeConfig.from_dict(
        {
            "model": {"config": shape},
            "data": {"path": "embedded", "seq_len": seq, "max_examples": 50},
            "pipeline": {"schedule": schedule, "pp": pp, "microbatches": m, "offload": offload},
            "train": {"global_batch_size": m, "activation_checkpointing": recompute, "precision": "bf16"},
            "output": {"dir": out},
        }
    ).validated()


def _row(case: tuple, tokenizer, out: str, repeat: int) -> dict:
    from pp_offload.recipe.dry_build import dry_build
    from pp_offload.recipe.topology import Topology

    model, pp, m, seq, schedule, offload, recompute = case
    config = _config(*case, out)
    topo = Topology(rank=0, world=pp, local_rank=0, pp=pp, dp=1)
    times = []
    for _ in range(repeat):
        with contextlib.redirect_stdout(io.StringIO()):
            build = dry_build(config, topo, tokenizer)
        times.append(build.seconds)
    return {
        "model": model,
        "pp": pp,
        "microbatches": m,
        "seq_len": seq,
        "schedule": schedule,
        "offload": offload,
        "recompute": recompute or "none",
        "layers_per_stage": [n for r in sorted(build.ranks, key=lambda r: r.rank) for n in r.layers],
        "copy_actions": sum(r.copy_actions for r in build.ranks),
        "seconds": round(min(times), 2),
    }


def _table(rows: list[dict]) -> str:
    head = ("model", "pp", "m", "seq", "schedule", "offload", "recompute", "copies", "s")
    lines = [head]
    for r in rows:
        lines.append(
            (r["model"], str(r["pp"]), str(r["microbatches"]), str(r["seq_len"]), r["schedule"], r["offload"],
             r["recompute"], str(r["copy_actions"]), f"{r['seconds']:.2f}")
        )  # fmt: skip
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)) for line in lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    from pp_offload.data import embedded_assets, embedded_dir, load_examples
    from pp_offload.recipe.sources import load_tokenizer

    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        config = _config(*CASES[0], tmp)
        cache = Path(tmp) / "cache"
        tokenizer = load_tokenizer(
            config,
            embedded_assets(embedded_dir(cache)).tokenizer_dir,
            load_examples(config.data, cache_dir=cache),
        )
        rows = [_row(case, tokenizer, tmp, args.repeat) for case in CASES]
    print(_table(rows))
    data = {
        "bench": "dry_build",
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "seconds": round(time.perf_counter() - start, 1),
        "results": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "dry_build.json").write_text(json.dumps(data, indent=1) + "\n")
    print(f"({data['seconds']} s; {args.out / 'dry_build.json'})")


if __name__ == "__main__":
    main()
