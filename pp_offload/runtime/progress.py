"""Where each rank is inside a training step, and a watchdog that says so when a step stops moving.

Why: a rank that waits for a peer that never sends (a hung kernel, a dead link, a deadlocked order) waits
inside a collective until its timeout, and the timeout's error names neither the action nor the peer.
Here every rank keeps, in one `StepProgress`, the step, the phase of the step (the schedule, the loss
all-reduce, the optimizer step...) and, while the schedule runs, the action it executes (`track_actions`:
the hot path only stores the action, one attribute write per action). A `StallWatchdog` thread looks at
that record about once a second; when nothing changed for ``timeout`` seconds it reports what the rank
waits in and for which peer (`waiting_peer`: from the stage-to-rank map of the schedule), so that every
rank of a stalled job says ``rank R stalled at step N in action X (waiting for rank P)``.

Waiting in torch's runtime: RECV_F / RECV_B only post a receive; the compute action that consumes it (F
for an input, I or B for an output gradient) waits for it. So a rank stuck on a missing input is "in"
that compute action, and its peer is the rank holding the neighbouring stage; once the stage's compute
method is entered (noted through a wrapper, as `pp_offload.runtime.timing` notes compute starts) the
input is there and the rank is computing, not waiting.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from pp_offload.runtime import compat

__all__ = ["StallWatchdog", "StepProgress", "describe", "track_actions", "waiting_peer"]

_SEND_RECV_PEER = {"SEND_F": 1, "RECV_F": -1, "SEND_B": -1, "RECV_B": 1}  # neighbour stage offset
_WAITS_FOR = {"F": -1, "I": 1, "B": 1}  # compute actions that wait for a posted receive


class StepProgress:
    """This rank's position: ``step`` (1-based, the step being trained), ``phase`` (what the loop does)
    and ``action`` (the schedule's action being executed, while the schedule runs; else None).

    Written by the training thread, read by the watchdog; plain attribute writes (atomic under the GIL).
    ``armed``: whether a stall is an error now (off outside the training steps: start-up, evaluation,
    checkpoints and the export have their own collective timeouts and may legitimately take long).
    """

    __slots__ = ("action", "armed", "computing", "phase", "step")

    def __init__(self) -> None:
        self.step = 0
        self.phase = "starting"
        self.action: Any = None
        self.computing = False  # the action's input has arrived and its computation runs
        self.armed = False

    def enter(self, phase: str) -> None:
        self.action = None
        self.computing = False
        self.phase = phase

    def snapshot(self) -> tuple[int, str, int, bool]:
        """What changes whenever the rank makes progress (the action object itself by identity)."""
        return self.step, self.phase, id(self.action), self.computing


def track_actions(schedule: Any, progress: StepProgress) -> Callable[[], None]:
    """Make ``schedule`` store each action it executes on this rank in ``progress.action``; returns an undo.

    Runtime schedules only (ours and torch's multi-stage ones); for others (torch's single-stage
    schedules) nothing is tracked beyond the phase, and the undo does nothing. Install it before an
    `ActionTimer` (which then wraps it), as `pp_offload.recipe.train` does.
    """
    if not compat.is_runtime_schedule(schedule):
        return lambda: None
    rank = schedule.rank

    def tracked_step(step_microbatches: Any, *args: Any, **kwargs: Any) -> Any:
        order = compat.lowered_order(schedule)
        actions = order[rank]
        order[rank] = _TrackedActions(actions, progress)
        unmark = compat.wrap_stage_compute(compat.schedule_stages(schedule), _marking_computing(progress))
        progress.enter("pipeline schedule")
        try:
            return step_microbatches(*args, **kwargs)
        finally:
            order[rank] = actions
            unmark()

    return compat.wrap_step_microbatches(schedule, tracked_step)


def _marking_computing(progress: StepProgress) -> Callable[[Any], Any]:
    """A wrapper for a stage's compute method that notes the computation began (its input, if any, has
    arrived)."""

    def wrap(method: Any) -> Any:
        def marked(*args: Any, **kwargs: Any) -> Any:
            progress.computing = True
            return method(*args, **kwargs)

        return marked

    return wrap


class _TrackedActions(list):
    """The rank's action list; iterating it (the runtime's loop) records each action as it is handed out,
    and, once the list is exhausted, that the runtime now waits for its sends to complete."""

    def __init__(self, actions: list[Any], progress: StepProgress):
        super().__init__(list.__iter__(actions))  # copy without iterating a wrapper (an ActionTimer's)
        self._source = actions
        self._progress = progress

    def __iter__(self) -> Iterator[Any]:
        progress = self._progress
        for action in self._source:
            progress.computing = False
            progress.action = action
            yield action
        progress.enter("pipeline schedule: waiting for its sends to complete")

    def __reduce_ex__(self, protocol: Any) -> Any:
        return list, (list(list.__iter__(self)),)  # copies (torch prints a deep copy on errors) are plain


def waiting_peer(schedule: Any, action: Any, global_rank: Callable[[int], int]) -> int | None:
    """The rank ``action`` waits for or sends to, or None (a local action, a first / last stage).

    ``global_rank`` maps a pipeline-group rank to the job's rank (with data-parallel replicas they
    differ)."""
    if action is None:
        return None
    try:
        stage, kind, _ = compat.action_parts(action)
    except AttributeError:
        return None
    offset = _SEND_RECV_PEER.get(kind, _WAITS_FOR.get(kind))
    if offset is None:
        return None
    owners = compat.stage_group_ranks(schedule)
    neighbour = owners.get(stage + offset)
    if neighbour is None or neighbour == owners.get(stage):
        return None  # no such stage (the ends of the pipeline), or it lives on this rank (V's turn)
    return global_rank(neighbour)


def describe(progress: StepProgress, peer: int | None) -> str:
    """``in action 3F1 (waiting for rank 1)`` / ``in the loss all-reduce``: where ``progress`` stands."""
    if progress.action is not None:
        where = f"in action {progress.action}"
        if progress.computing:
            return where + " (computing: its input is here)"
        if peer is not None:
            kind = compat.action_parts(progress.action)[1]
            where += f" ({'sending to' if kind.startswith('SEND') else 'waiting for'} rank {peer})"
        return where
    return f"in {progress.phase}"


class StallWatchdog:
    """A daemon thread that calls ``on_stall()`` once when ``progress`` stays unchanged for ``timeout``
    seconds while armed. ``poll`` (seconds) is how often it looks; a report comes at most ``poll`` late."""

    def __init__(
        self, progress: StepProgress, timeout: float, on_stall: Callable[[], None], *, poll: float = 1.0
    ) -> None:
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        self.progress = progress
        self.timeout = float(timeout)
        self.poll = min(float(poll), self.timeout / 4)
        self.on_stall = on_stall
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="pp_offload-stall-watchdog", daemon=True)

    def start(self) -> StallWatchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5 * self.poll + 1)

    def _watch(self) -> None:
        seen = self.progress.snapshot()
        since = time.monotonic()
        while not self._stop.wait(self.poll):
            now = self.progress.snapshot()
            if now != seen or not self.progress.armed:
                seen, since = now, time.monotonic()
                continue
            if time.monotonic() - since >= self.timeout:
                self.on_stall()
                return
