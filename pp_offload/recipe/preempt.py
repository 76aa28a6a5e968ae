"""Preemption: SIGTERM or SIGUSR1 asks the run to finish its step, write a checkpoint and exit.

Why: SLURM and Kubernetes send SIGTERM some time before SIGKILL (SLURM's ``--signal`` can send SIGUSR1
earlier still); a run that dies there loses everything since its last periodic checkpoint. The handler
only notes the request; the training loop adds it to the all-reduce it already does for the step's loss,
so every rank learns of it after the same step (a signal that reached one rank only stops all of them
together), then all write the checkpoint of that step and return.

SIGINT (Ctrl-C) does the same the first time: every rank finishes its step and writes the checkpoint
(before, each rank died of a KeyboardInterrupt with a traceback and the steps since the last checkpoint
were lost); a second SIGINT interrupts at once, as Ctrl-C always did.

torchrun forwards SIGTERM (and SIGINT, SIGHUP, SIGQUIT) to its workers and gives them 30 s before it kills
them; it does not forward SIGUSR1, which must reach the worker processes themselves (``pp-offload train``
does that: `pp_offload.recipe.signals`).
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

__all__ = ["PREEMPT_SIGNALS", "StopRequest"]

#: The signals that ask for a checkpoint and a clean exit.
PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
# Handlers that count as "nobody installed one": Python's own for SIGINT (it raises KeyboardInterrupt).
_UNCLAIMED = (signal.SIG_DFL, signal.default_int_handler)


class StopRequest:
    """Installs handlers for `PREEMPT_SIGNALS` (main thread only) that record the first signal received.

    ``with StopRequest() as stop:`` ... ``stop.requested`` ... : the previous handlers come back on exit.
    Outside the main thread (a notebook's worker thread) nothing is installed and ``requested`` stays
    False; a signal that already has a handler (``pp_offload.local_ranks`` dumps stacks on SIGUSR1) keeps it.
    """

    def __init__(self) -> None:
        self.signal: int | None = None
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signal is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signal).name if self.signal is not None else ""

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signal is None:
            self.signal = signum
        elif signum == signal.SIGINT and self.signal == signal.SIGINT:  # Ctrl-C twice: stop now
            raise KeyboardInterrupt

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in PREEMPT_SIGNALS:
                if signal.getsignal(sig) in _UNCLAIMED:  # leave a handler someone installed alone
                    self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
