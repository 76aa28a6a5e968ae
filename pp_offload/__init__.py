"""pp-offload: memory-efficient pipeline parallelism on torch.distributed.pipelining."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pp_offload.order import Costs

if TYPE_CHECKING:
    from pp_offload.plan import plan
    from pp_offload.runtime.offload import enable_offload
    from pp_offload.runtime.schedules import ScheduleVAdaptive, ScheduleVHalf, ScheduleVMin, ScheduleVZB
    from pp_offload.runtime.timing import ActionTimer, realized_bubble, record_actions

__version__ = "0.1.0"

__all__ = [
    "ActionTimer",
    "Costs",
    "ScheduleVAdaptive",
    "ScheduleVHalf",
    "ScheduleVMin",
    "ScheduleVZB",
    "__version__",
    "enable_offload",
    "plan",
    "realized_bubble",
    "record_actions",
]

# The torch-side names load on first use, so `pp_offload.order` (pure Python) stays importable without
# importing torch.
_LAZY = {
    "ScheduleVAdaptive": "pp_offload.runtime.schedules",
    "ScheduleVHalf": "pp_offload.runtime.schedules",
    "ScheduleVMin": "pp_offload.runtime.schedules",
    "ScheduleVZB": "pp_offload.runtime.schedules",
    "ActionTimer": "pp_offload.runtime.timing",
    "enable_offload": "pp_offload.runtime.offload",
    "plan": "pp_offload.plan",
    "realized_bubble": "pp_offload.runtime.timing",
    "record_actions": "pp_offload.runtime.timing",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pp_offload' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
