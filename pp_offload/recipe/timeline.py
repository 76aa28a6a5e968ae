"""The recipe's pictures of its own run: the schedule as predicted and as the runtime executed it.

Why one recorded step: the timeline of a step shows at a glance where a pipeline idles (bubbles, waits for
a receive or a reload) and how much activation memory each rank holds; comparing it with the simulator's
prediction at the measured pass durations tells whether the schedule, or something else, costs the time.
The second step is recorded (the first also infers shapes and sets up communication).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pp_offload.runtime.timing import ActionTimer, chrome_trace

__all__ = ["StepTimeline"]


class StepTimeline:
    """Record one step's executed actions on every rank; rank 0 writes ``timeline.png`` and ``trace.json``."""

    def __init__(self, schedule: Any, out: Path, *, rank: int, title: str, group: Any = None) -> None:
        """``rank``: the global rank (0 writes); ``group``: this pipeline's ranks (one replica of a hybrid
        run; None: the default group)."""
        self.schedule = schedule
        self.group = group
        self.out = out
        self.rank = rank
        self.title = title
        self.timer: ActionTimer | None = None

    @staticmethod
    def supported(schedule: Any) -> bool:
        """Only schedules on torch's multi-stage runtime have a per-rank order to draw."""
        return isinstance(getattr(schedule, "pipeline_order", None), dict)

    def start(self) -> None:
        self.timer = ActionTimer(self.schedule)

    def finish(self) -> Path | None:
        """Collective: every rank calls it after the recorded step. Returns the PNG path on rank 0."""
        from pp_offload.order import Action
        from pp_offload.plot import measured_costs, plot_side_by_side
        from pp_offload.runtime.compat import schedule_stages
        from pp_offload.runtime.deferred_w import all_deferring
        from pp_offload.sim import as_executed_by_torch

        assert self.timer is not None
        events = self.timer.gather(self.group)
        self.timer.detach()
        self.timer = None
        if self.rank != 0:
            return None
        order = {
            rank: [
                Action(a.stage_index, str(a.computation_type.value), a.microbatch_index)
                for a in actions
                if a is not None
            ]
            for rank, actions in self.schedule.pipeline_order.items()
        }
        (self.out / "trace.json").write_text(json.dumps(chrome_trace(events)) + "\n")
        # deferred W runs the order as written; torch's split runs stage 0's backward at its W
        deferring = all_deferring(schedule_stages(self.schedule))
        return plot_side_by_side(
            order if deferring else as_executed_by_torch(order),
            events,
            self.out / "timeline.png",
            measured_costs(events),
            title=self.title,
        )
