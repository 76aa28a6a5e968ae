"""The planner: pick a pipeline schedule, an offload policy and an activation recompute mode for a model on
a machine.

    from pp_offload import plan
    result = plan("path/to/config.json", seq_len=4096, microbatch_size=1, num_microbatches=64, pp=8,
                  machine="H100")
    print(result.table())           # ranked: step time, bubble, memory per rank, fits
    result.recommended              # the fastest candidate that fits, result.reason says why
    result.recompute                # its activation recompute mode: none, selective or full

Command line: ``pp-offload plan --model PATH_OR_ID --seq-len 4096 --microbatches 64 --pp 8``.
Modules, one job each: `model` (config -> numbers), `memory` (bytes), `costs` (seconds), `split` (layers
per stage), `machines` (GPU presets), `orders` (schedule orders), `evaluate` (simulate one schedule),
`planner` (rank and recommend), `report` (table and plot), `validate` (measure HF stages on CPU), `cli`,
`handoff` (`offload_inputs`: the planner's per-stage figures for the runtime's offload plan),
`recompute_calibration` (what recompute costs, measured by ``schedule: auto``'s probe on one of the
model's decoder layers).
"""

from __future__ import annotations

import sys
import types
from typing import Any

from pp_offload.plan.handoff import offload_inputs
from pp_offload.plan.machines import A100, GH200, H100, H200, MACHINES, Machine, resolve_machine
from pp_offload.plan.model import ModelSpec, model_spec
from pp_offload.plan.planner import Candidate, PlanError, PlanResult, plan
from pp_offload.plan.split import balanced_split

__all__ = [
    "A100",
    "H100",
    "GH200",
    "H200",
    "MACHINES",
    "Candidate",
    "Machine",
    "ModelSpec",
    "PlanError",
    "PlanResult",
    "balanced_split",
    "model_spec",
    "offload_inputs",
    "plan",
    "resolve_machine",
]


class _CallableModule(types.ModuleType):
    """``pp_offload.plan`` is both this package and the function `plan`: importing the package binds the name
    ``plan`` on ``pp_offload`` to the module, so the module forwards calls to the function and
    ``pp_offload.plan(...)`` works whichever of the two the name holds."""

    def __call__(self, *args: Any, **kwargs: Any) -> PlanResult:
        return plan(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
