"""An order as torch's runtime executes it under its retained-graph split (`as_executed_by_torch`).

Its own module: the simulator, the offload planner, the runtime and the benches all rewrite orders this
way, and it needs nothing but the actions' field names.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from enum import Enum
from typing import Any

__all__ = ["as_executed_by_torch"]


def as_executed_by_torch(order: Mapping[int, Iterable[Any]]) -> dict[int, list[Any]]:
    """``order`` as torch's runtime executes it: stage 0's I actions dropped, its W actions run as B.

    With split backward, torch's first stage computes nothing at I (there is no input gradient to send)
    and runs one full backward at its W, so simulating this rewrite predicts real runs better than the
    papers' model, where stage 0's I and W cost what any stage's do. Works on torch ``_Action``
    (sub-actions of OVERLAP_F_B included) and on ``pp_offload.order.Action``.
    """

    def convert(action):
        if action is None:
            return None
        subs = getattr(action, "sub_actions", None)
        if subs:
            new_subs = tuple(a for a in (convert(s) for s in subs) if a is not None)
            return action._replace(sub_actions=new_subs)
        kind = str(getattr(action.computation_type, "value", action.computation_type))
        if action.stage_index != 0 or kind not in ("I", "W"):
            return action
        if kind == "I":
            return None
        ctype = action.computation_type
        return action._replace(computation_type=type(ctype)("B") if isinstance(ctype, Enum) else "B")

    out: dict[int, list[Any]] = {}
    for rank, actions in order.items():
        out[rank] = [c for c in (convert(a) for a in actions) if c is not None]
    return out
