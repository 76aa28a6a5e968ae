"""``python -m pp_offload families``: which Hugging Face causal LMs split exactly, from a live sweep.

Why live: the answer depends on the installed transformers, so the command runs the sweep
(`pp_offload.models.sweep`) on this machine instead of printing a list kept by hand.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pp_offload.models.sweep import FamilyResult

DESCRIPTION = (
    "Split every causal-LM model type of the installed transformers (tiny random models built from each\n"
    "family's default config) and report: exact (the split-time proof and an independent check agree with\n"
    "the unsplit model), refused (UnsupportedModelError, with the reason) or untested (no tiny model)."
)
EPILOG = "example: python -m pp_offload families llama granite cohere2 --json families.json"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_types", nargs="*", help="model types to check (default: all causal LMs)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results as JSON here")
    parser.add_argument("--all", action="store_true", help="list refused and untested families too")


def summary(results: Sequence[FamilyResult]) -> dict[str, Any]:
    """Counts per status, overall and among families whose config declares ``base_model_pp_plan``."""
    plan = [r for r in results if r.has_pp_plan]
    proofs = [r.proof_s for r in results if r.status == "exact" and r.proof_s is not None]
    cpu = sorted(r.proof_cpu_s for r in results if r.status == "exact" and r.proof_cpu_s is not None)
    counts = {
        s: sum(r.status == s for r in results) for s in ("exact", "refused", "untested", "wrong", "crash")
    }
    return {
        "total": len(results),
        **counts,
        "with_pp_plan": len(plan),
        "exact_with_pp_plan": sum(r.status == "exact" for r in plan),
        "max_proof_s": max(proofs) if proofs else None,
        "median_proof_s": sorted(proofs)[len(proofs) // 2] if proofs else None,
        "max_proof_cpu_s": cpu[-1] if cpu else None,
        "median_proof_cpu_s": cpu[len(cpu) // 2] if cpu else None,
    }


def table(results: Sequence[FamilyResult], *, everything: bool = True) -> str:
    """A fixed-width table: model type, class, pp plan, status, proof cost, reason (shortened)."""
    lines = [f"{'model_type':26s} {'class':34s} {'plan':4s} {'status':8s} {'proof':>7s} {'cpu':>7s}  reason"]
    for r in results:
        if not everything and r.status != "exact":
            continue
        proof = f"{r.proof_s * 1000:.0f}ms" if r.proof_s is not None else "-"
        cpu = f"{r.proof_cpu_s * 1000:.0f}ms" if r.proof_cpu_s is not None else "-"
        reason = r.reason.split(". If you have checked")[0]
        reason = reason.replace(
            "is refused: the split could not be proven exact on a shrunken copy of its config. ", ""
        )
        lines.append(
            f"{r.model_type:26s} {r.model_class[:34]:34s} {'yes' if r.has_pp_plan else 'no':4s} "
            f"{r.status:8s} {proof:>7s} {cpu:>7s}  {reason[:110]}"
        )
    return "\n".join(lines)


def write_json(results: Sequence[FamilyResult], path: Path) -> None:
    import torch
    import transformers

    payload = {
        "transformers": transformers.__version__,
        "torch": torch.__version__.split("+")[0],
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "summary": summary(results),
        "families": [r.to_dict() for r in results],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1) + "\n")


def run_from_args(args: argparse.Namespace) -> int:
    from pp_offload.models.sweep import sweep

    results = sweep(args.model_types or None)
    print(table(results, everything=args.all or bool(args.model_types)))
    counts = summary(results)
    print(
        f"\n{counts['exact']} exact, {counts['refused']} refused, {counts['untested']} untested, "
        f"{counts['wrong']} wrong, {counts['crash']} crashed, of {counts['total']} causal-LM model types; "
        f"{counts['exact_with_pp_plan']}/{counts['with_pp_plan']} of those declaring base_model_pp_plan exact"
    )
    if args.json is not None:
        write_json(results, args.json)
        print(f"wrote {args.json}")
    return 1 if counts["wrong"] or counts["crash"] else 0
