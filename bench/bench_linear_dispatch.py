"""The Python a deferring linear layer costs per call in eager mode, forward and backward, against a plain
``nn.Linear``: through torch.library's two custom ops (what compiled code calls, and what eager code ran
until 2026-11-28), and as the plain autograd Function eager code runs now
(`pp_offload.runtime.deferred_w._EagerLinear`).

Why: the deferred-W linear is a Python autograd node either way; on small layers (and a CPU) its Python is
most of its cost, which decided whether a deferred-W step could be as short as torch's split's. Small
layers (``--layers`` of ``Linear(64, 64)`` on 16 rows, one thread) make the Python visible; each variant
runs ``--calls`` forward+backward passes inside a deferring backward (`deferred_w.collecting`), the
fastest of ``--rounds``, variants interleaved round by round.

    python bench/bench_linear_dispatch.py      # ~10 s
Writes ``linear_dispatch.json`` to ``bench/results`` (or ``--out DIR``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
import types
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = ("plain nn.Linear", "deferring, through the custom ops", "deferring, autograd Function (eager)")


def _steps(layers: int) -> dict[str, Callable[[Any], None]]:
    """Per variant, one forward and backward of ``layers`` linears inside a deferring backward."""
    import torch
    from torch import nn

    from pp_offload.runtime import deferred_w

    def stack() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(64, 64) for _ in range(layers)])

    plain, eager, through_op = stack(), stack(), stack()
    for model in (eager, through_op):
        stage = types.SimpleNamespace(submod=model, backward_maybe_with_nosync=lambda: None)
        deferred_w.defer_weight_grads([stage])
    queueing = deferred_w._input_grad_queueing

    def by_op(dy: Any, x: Any, weight: Any, transposed: bool, compiled: bool) -> Any:
        return torch.ops.pp_offload.input_grad_and_queue(dy, x, weight, transposed, compiled)

    def op_step(x: torch.Tensor) -> None:
        """Both ops through torch.library's dispatch, as eager code ran them before `_EagerLinear`."""
        deferred_w._input_grad_queueing = by_op  # what the op's registered backward calls
        try:
            for layer in through_op:
                x = deferred_w._linear_dw_queued(x, layer.weight, layer.bias, False)
            x.sum().backward()
        finally:
            deferred_w._input_grad_queueing = queueing

    def module_step(model: nn.Module) -> Callable[[Any], None]:
        return lambda x: model(x).sum().backward()

    return dict(zip(VARIANTS, (module_step(plain), op_step, module_step(eager)), strict=True))


def _time(step: Callable[[Any], None], x: Any, calls: int) -> float:
    from pp_offload.runtime import deferred_w

    start = time.perf_counter()
    for _ in range(calls):
        with deferred_w.collecting():
            step(x)
        deferred_w._QUEUE.clear()  # W's GEMMs are not what is timed
    return (time.perf_counter() - start) / calls


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    steps = _steps(args.layers)
    x = torch.randn(16, 64, requires_grad=True)
    best = dict.fromkeys(VARIANTS, float("inf"))
    for _ in range(args.rounds):
        for name, step in steps.items():
            best[name] = min(best[name], _time(step, x, args.calls))
    base = best[VARIANTS[0]]
    rows = [
        {
            "variant": name,
            "us_per_pass": round(1e6 * best[name], 1),
            "extra_us_per_linear_call": round(1e6 * (best[name] - base) / args.layers, 1),
        }
        for name in VARIANTS
    ]
    print(f"{args.layers} x Linear(64, 64), 16 rows, forward + backward, fastest of {args.rounds} rounds")
    print(f"{'variant':46} {'us per pass':>12} {'extra us per linear call':>26}")
    for r in rows:
        print(f"{r['variant']:46} {r['us_per_pass']:>12.1f} {r['extra_us_per_linear_call']:>26.1f}")
    meta = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "load_average": os.getloadavg(),
        **{k: getattr(args, k) for k in ("layers", "calls", "rounds")},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "linear_dispatch.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
