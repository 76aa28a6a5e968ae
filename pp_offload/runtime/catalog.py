"""Every pipeline schedule by name, with the stage placement it needs.

Why: a recipe or a command line names a schedule as text, and the stages a rank must build depend on the
schedule: V schedules put stages r and 2d-1-r on rank r, torch's interleaved ("looped") schedules put stage
s on rank s % d, single-stage schedules one stage per rank. Keeping that knowledge in one table means the
model split, the recipe and the planner agree, and an unknown name fails at once with the list of known ones.
"""

from __future__ import annotations

import difflib
import importlib
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ScheduleInfo",
    "UnknownScheduleError",
    "build_schedule",
    "schedule_info",
    "schedule_names",
    "stage_indices",
]


class UnknownScheduleError(ValueError):
    """A schedule name that is neither ours nor torch's; the message lists the known names."""


@dataclass(frozen=True)
class ScheduleInfo:
    """A schedule class by name: ``placement`` is ``"v"``, ``"loop"`` or ``"single"``."""

    name: str
    module: str
    placement: str
    split_backward: bool

    @property
    def cls(self) -> type:
        return getattr(importlib.import_module(self.module), self.name)

    @property
    def multi_stage(self) -> bool:
        return self.placement != "single"

    def stages_per_rank(self, requested: int | None = None) -> int:
        """Stages each rank holds: 2 for V, ``requested`` (default 2) for loop, 1 for single."""
        if self.placement == "v":
            if requested not in (None, 2):
                raise ValueError(f"{self.name} is a V schedule: it holds 2 stages per rank, not {requested}")
            return 2
        if self.placement == "single":
            if requested not in (None, 1):
                raise ValueError(f"{self.name} holds exactly 1 stage per rank, not {requested}")
            return 1
        stages = 2 if requested is None else int(requested)
        if stages < 1:
            raise ValueError(f"stages per rank must be >= 1, got {requested}")
        return stages


_OURS = "pp_offload.runtime.schedules"
_TORCH = "torch.distributed.pipelining"
_SCHEDULES = (
    ScheduleInfo("ScheduleVMin", _OURS, "v", True),
    ScheduleInfo("ScheduleVHalf", _OURS, "v", True),
    ScheduleInfo("ScheduleVZB", _OURS, "v", True),
    ScheduleInfo("ScheduleVAdaptive", _OURS, "v", True),
    ScheduleInfo("ScheduleZBVZeroBubble", _TORCH, "v", True),
    ScheduleInfo("ScheduleDualPipeV", _TORCH, "v", True),
    ScheduleInfo("ScheduleInterleaved1F1B", _TORCH, "loop", False),
    ScheduleInfo("ScheduleInterleavedZeroBubble", _TORCH, "loop", True),
    ScheduleInfo("ScheduleLoopedBFS", _TORCH, "loop", False),
    ScheduleInfo("Schedule1F1B", _TORCH, "single", False),
    ScheduleInfo("ScheduleGPipe", _TORCH, "single", False),
)


def _key(name: str) -> str:
    key = name.lower().replace("-", "").replace("_", "").replace(" ", "")
    return key.removeprefix("schedule")


_BY_KEY = {_key(info.name): info for info in _SCHEDULES}


def schedule_names() -> list[str]:
    """Every known schedule class name."""
    return [info.name for info in _SCHEDULES]


def schedule_info(name: str | type) -> ScheduleInfo:
    """Look a schedule up by class, class name or short name (``"VHalf"``, ``"v-half"``, ``"1f1b"``)."""
    if isinstance(name, type):
        name = name.__name__
    info = _BY_KEY.get(_key(str(name)))
    if info is None:
        names = schedule_names()
        close = difflib.get_close_matches(str(name), names, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise UnknownScheduleError(f"unknown schedule {name!r}; known schedules: {', '.join(names)}{hint}")
    return info


def stage_indices(rank: int, num_ranks: int, placement: str, stages_per_rank: int = 2) -> list[int]:
    """Stages held by ``rank``: ``"v"`` (r and 2d-1-r), ``"loop"`` (r, r+d, r+2d, ...) or ``"single"`` (r)."""
    if not 0 <= rank < num_ranks:
        raise ValueError(f"rank {rank} is not in [0, {num_ranks})")
    if placement == "v":
        return [rank, 2 * num_ranks - 1 - rank]
    if placement == "loop":
        return [rank + k * num_ranks for k in range(stages_per_rank)]
    if placement == "single":
        return [rank]
    raise ValueError(f"placement must be 'v', 'loop' or 'single', got {placement!r}")


def build_schedule(
    info: ScheduleInfo, stages: list[Any], num_microbatches: int, *, deferred_w: bool = True, **kwargs: Any
) -> Any:
    """Instantiate ``info``'s class on this rank's ``stages`` (a single stage for single-stage schedules).

    A split-backward schedule defers its stages' linear-like weight gradients to W
    (`pp_offload.runtime.deferred_w`; ours do it themselves, torch's get it here) unless ``deferred_w`` is
    False; either way a stage left on torch's retained-graph split must hold no compiled module."""
    from pp_offload.runtime import compat
    from pp_offload.runtime.deferred_w import defer_weight_grads, refuse_compiled_split

    compat.skip_self_p2p_warmup(stages)
    if info.module == _OURS:
        kwargs["deferred_w"] = deferred_w
    else:  # a schedule without split backward needs no queue: layers left deferring are given back
        defer_weight_grads(stages, enabled=info.split_backward and deferred_w)
    target = stages if info.multi_stage else stages[0]
    schedule = info.cls(target, num_microbatches, **kwargs)
    if info.split_backward:
        refuse_compiled_split(stages, info.name)
    return schedule
