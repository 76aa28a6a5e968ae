"""Sweep every causal-LM model type of the installed transformers through split_model and its proof.

Prints the table (exact / refused / untested per family, with the proof's uncached cost) and writes
bench/results/families.json, which tests/test_models_verify.py checks is fresh (same transformers, same
model types, nothing wrong or crashed) and docs/families.md lists from. Takes about a minute on one core.

    python bench/bench_families.py
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "families.json"
DOCS = ROOT / "docs" / "families.md"
BEGIN, END = "<!-- families:begin -->", "<!-- families:end -->"


def docs_table(results: list) -> str:
    """The markdown list of exact families for docs/families.md (between its markers)."""
    exact = [r for r in results if r.status == "exact"]
    rows = ["| model_type | class | proof, wall (ms) | proof, CPU (ms) |", "|---|---|---|---|"]
    rows += [
        f"| `{r.model_type}` | `{r.model_class}` | {r.proof_s * 1000:.0f} | {r.proof_cpu_s * 1000:.0f} |"
        for r in exact
    ]
    refused = [r for r in results if r.status == "refused"]
    rows += ["", f"Refused ({len(refused)}): " + ", ".join(f"`{r.model_type}`" for r in refused) + "."]
    untested = [r for r in results if r.status == "untested"]
    rows += [
        "",
        f"Untested ({len(untested)}, no tiny model from the default config): "
        + ", ".join(f"`{r.model_type}`" for r in untested)
        + ".",
    ]
    return "\n".join(rows)


def main() -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, str(ROOT))
    from pp_offload.families_cli import summary, table, write_json
    from pp_offload.models.sweep import sweep

    results = sweep()
    print(table(results))
    counts = summary(results)
    print("\n" + "  ".join(f"{k}={v}" for k, v in counts.items()))
    write_json(results, RESULTS)
    print(f"wrote {RESULTS.relative_to(ROOT)}")
    if DOCS.exists():
        text = DOCS.read_text()
        block = f"{BEGIN}\n{docs_table(results)}\n{END}"
        text = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: block, text, flags=re.S)
        DOCS.write_text(text)
        print(f"updated {DOCS.relative_to(ROOT)}")
    return 1 if counts["wrong"] or counts["crash"] else 0


if __name__ == "__main__":
    sys.exit(main())
