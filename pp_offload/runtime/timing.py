"""Opt-in timing of the actions a pipeline schedule really executes, on every rank.

Why: a simulator replays an order with assumed costs; this records what the runtime did (start and end of
every executed action), so the realized bubble can be compared with the simulated one, and a Chrome trace
(chrome://tracing, Perfetto) shows where each rank computed, communicated or waited.

Works for pp_offload's schedules and for any torch ``_PipelineScheduleRuntime`` schedule (e.g.
``ScheduleZBVZeroBubble``)::

    with record_actions(schedule) as rec:
        schedule.step(x, target=y, losses=losses)
    events = rec.gather()                # every rank's events, on every rank
    if rank == 0:
        rec.to_chrome_trace("trace.json", events)
        print(realized_bubble(events))

How: while a step runs, the rank's lowered action list is replaced by one whose iteration notes the time
each action is handed out and the time the next one is asked for, so every action of the lowered order
(compute, SEND/RECV, UNSHARD, custom kinds) gets a span; the stages' ``forward_one_chunk``,
``backward_one_chunk`` and ``backward_weight_one_chunk`` note when the computation itself begins. A compute
action's event starts there: waiting for its input (the RECV posted earlier is waited on inside the action)
is recorded as a separate ``wait:<action>`` event, so it does not count as compute.

Clocks: ``time.perf_counter`` host times. Ranks on one host share the clock, so their events line up;
events from different hosts are offset by the hosts' clock difference. On CUDA, host times only measure
kernel launches unless the device is synchronized: pass ``sync_cuda=True`` to call
``torch.cuda.synchronize()`` at every action boundary (true durations, but it removes the overlap of
communication with computation that the measurement is about; CUDA events would avoid that and are not
used yet). For meaningful makespans put a barrier before the step, so all ranks start together.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from pp_offload.runtime import compat

__all__ = [
    "ActionEvent",
    "ActionTimer",
    "action_category",
    "parse_action",
    "realized_bubble",
    "record_actions",
]

_COMPUTE_KINDS = frozenset({"F", "I", "W", "B"})
_COMM_KINDS = frozenset({"SEND_F", "RECV_F", "SEND_B", "RECV_B"})
_COPY_KINDS = frozenset({"OFFLOAD", "RELOAD"})
_ACTION_RE = re.compile(r"^(\d+)([A-Z_]+?)(\d*)$")


class ActionEvent(NamedTuple):
    """One executed action on one rank; times are ``time.perf_counter()`` seconds."""

    rank: int
    action: str
    start: float
    end: float


def action_category(action: str) -> str:
    """``compute`` (F/I/W/B and overlapped F+B), ``comm`` (SEND/RECV), ``copy`` (OFFLOAD/RELOAD: issuing a
    device<->host copy; on CUDA the copy itself runs on a side stream), ``wait`` or ``other``."""
    if action.startswith("wait:"):
        return "wait"
    if action.endswith("OVERLAP_F_B"):
        return "compute"
    match = _ACTION_RE.match(action)
    if match is None:
        return "other"
    kind = match.group(2)
    if kind in _COMPUTE_KINDS:
        return "compute"
    if kind in _COMM_KINDS:
        return "comm"
    if kind in _COPY_KINDS:
        return "copy"
    return "other"


def parse_action(action: str) -> tuple[int, str, int | None] | None:
    """``"2F0"`` -> ``(2, "F", 0)``, ``"3OFFLOAD1"`` -> ``(3, "OFFLOAD", 1)``; None for anything else
    (``wait:`` events, composite actions)."""
    match = _ACTION_RE.match(action)
    if match is None:
        return None
    stage, kind, mb = match.groups()
    return int(stage), kind, int(mb) if mb else None


class ActionTimer:
    """Records the actions ``schedule`` executes on this rank into ``events`` from now until `detach`.

    Events of every step are appended; call `clear` between steps to look at one step at a time.
    ``min_wait`` (seconds) drops ``wait:`` events shorter than that, which are just bookkeeping.
    """

    def __init__(self, schedule: Any, *, sync_cuda: bool = False, min_wait: float = 20e-6):
        if not compat.is_runtime_schedule(schedule):
            raise TypeError(
                "ActionTimer needs a schedule built on torch's _PipelineScheduleRuntime (pp_offload's V "
                "schedules, ScheduleZBVZeroBubble, ScheduleInterleaved1F1B, ...), "
                f"got {type(schedule).__name__}"
            )
        self.schedule = schedule
        self.rank: int = schedule.rank
        self.events: list[ActionEvent] = []
        self._sync = bool(sync_cuda) and torch.cuda.is_available()
        self._min_wait = float(min_wait)
        self._compute_start: float | None = None
        self._undo = compat.wrap_step_microbatches(schedule, self._timed_step)

    def detach(self) -> None:
        """Stop recording; the schedule runs exactly as before. Events stay."""
        if self._undo is not None:
            self._undo()
            self._undo = None

    def clear(self) -> None:
        self.events.clear()

    def __enter__(self) -> ActionTimer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def gather(self, group: dist.ProcessGroup | None = None) -> list[ActionEvent]:
        """All ranks' events (sorted by rank, then start), returned on every rank of ``group``.

        A collective: every rank of ``group`` must call it. Without an initialized process group it returns
        this rank's events.
        """
        if not (dist.is_available() and dist.is_initialized()):
            return sorted(self.events, key=lambda e: (e.rank, e.start))
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, [tuple(e) for e in self.events], group=group)
        events = [ActionEvent(*e) for part in gathered for e in part]
        return sorted(events, key=lambda e: (e.rank, e.start))

    def to_chrome_trace(
        self, path: str | os.PathLike[str], events: Iterable[ActionEvent] | None = None
    ) -> None:
        """Write ``events`` (default: this rank's) as a Chrome trace JSON file."""
        trace = chrome_trace(self.events if events is None else events)
        with open(path, "w") as f:
            json.dump(trace, f)

    # --- the hooks --------------------------------------------------------------------------------

    def _now(self) -> float:
        if self._sync:
            torch.cuda.synchronize()
        return time.perf_counter()

    def _timed_step(self, step_microbatches: Any, *args: Any, **kwargs: Any) -> Any:
        order = compat.lowered_order(self.schedule)
        actions = order[self.rank]
        order[self.rank] = _TimedActions(actions, self)
        unhook = compat.wrap_stage_compute(compat.schedule_stages(self.schedule), self._mark_compute_start)
        try:
            return step_microbatches(*args, **kwargs)
        finally:
            order[self.rank] = actions
            unhook()

    def _mark_compute_start(self, method: Any) -> Any:
        def marked(*args: Any, **kwargs: Any) -> Any:
            if self._compute_start is None:
                self._compute_start = self._now()
            return method(*args, **kwargs)

        return marked

    def _iterate(self, actions: Iterator[Any]) -> Iterator[Any]:
        for action in actions:
            self._compute_start = None
            start = self._now()
            yield action
            end = self._now()
            name = str(action)
            if action_category(name) == "compute" and self._compute_start is not None:
                if self._compute_start - start >= self._min_wait:
                    self.events.append(ActionEvent(self.rank, f"wait:{name}", start, self._compute_start))
                start = self._compute_start
            self.events.append(ActionEvent(self.rank, name, start, end))


class _TimedActions(list):
    """The rank's action list; its first iteration (the runtime's loop) is timed, later ones are plain."""

    def __init__(self, actions: list[Any], timer: ActionTimer):
        super().__init__(actions)
        self._timer: ActionTimer | None = timer

    def __iter__(self) -> Iterator[Any]:
        timer, self._timer = self._timer, None
        if timer is None:
            return super().__iter__()
        return timer._iterate(list.__iter__(self))

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Copies are plain lists without the timer (torch deep-copies the order to print it on errors).
        return list, (list(list.__iter__(self)),)


@contextmanager
def record_actions(schedule: Any, *, sync_cuda: bool = False) -> Iterator[ActionTimer]:
    """``with record_actions(schedule) as rec:`` records every action executed inside the block."""
    timer = ActionTimer(schedule, sync_cuda=sync_cuda)
    try:
        yield timer
    finally:
        timer.detach()


def chrome_trace(events: Iterable[ActionEvent]) -> dict[str, Any]:
    """Chrome trace dict: one process per rank, compute / comm / wait / other as categories and colours."""
    events = list(events)
    t0 = min((e.start for e in events), default=0.0)
    colours = {
        "compute": "thread_state_running",
        "comm": "thread_state_iowait",
        "copy": "rail_load",
        "wait": "grey",
        "other": "white",
    }
    trace: list[dict[str, Any]] = []
    for rank in sorted({e.rank for e in events}):
        trace.append(
            {"name": "process_name", "ph": "M", "pid": rank, "tid": rank, "args": {"name": f"rank {rank}"}}
        )
    for e in events:
        category = action_category(e.action)
        trace.append(
            {
                "name": e.action,
                "cat": category,
                "ph": "X",
                "pid": e.rank,
                "tid": e.rank,
                "ts": (e.start - t0) * 1e6,
                "dur": max(e.end - e.start, 0.0) * 1e6,
                "cname": colours[category],
            }
        )
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def realized_bubble(events: Iterable[ActionEvent]) -> float:
    """1 - (busiest rank's compute time) / makespan, from the events of ONE step of all ranks.

    Compute time counts F, I, W, B (and overlapped F+B) actions, without the time they waited for input.
    The makespan runs from the first event's start to the last event's end over all ranks.
    """
    events = list(events)
    compute: dict[int, float] = defaultdict(float)
    for e in events:
        if action_category(e.action) == "compute":
            compute[e.rank] += e.end - e.start
    if not compute:
        raise ValueError("realized_bubble needs the events of a step with compute actions (F, I, W, B)")
    makespan = max(e.end for e in events) - min(e.start for e in events)
    if makespan <= 0:
        raise ValueError(f"events span no time (makespan {makespan}); were they recorded by ActionTimer?")
    return 1.0 - max(compute.values()) / makespan
