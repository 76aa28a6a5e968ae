"""Run torchrun as a child of the launcher and pass the job-control signals on, so that a signal to
``pp-offload train`` reaches the training.

Why: a launcher that dies of its SIGTERM (the default action) leaves torchrun and the workers behind,
re-parented, training on without writing a checkpoint (measured before this module: the launcher exited
143, the workers still ran 60 s later); SIGINT did nothing visible. Now:

- SIGTERM, SIGINT go to torchrun, which forwards them to its workers and waits (30 s by default) for them
  to finish the step and write their checkpoint (`pp_offload.recipe.preempt`), then exits;
- SIGUSR1 goes to torchrun's children, the workers, directly: torchrun does not forward it, and its own
  default action for SIGUSR1 would end it and orphan them;
- the launcher waits for torchrun and exits with its code (128 + the signal's number when torchrun itself
  died of a signal, as a shell reports it).

torchrun runs in its own session, so a terminal's Ctrl-C reaches it once, through here, not twice.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from types import FrameType

__all__ = ["FORWARDED", "TO_WORKERS", "run_forwarding_signals"]

#: Signals the launcher passes on.
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
#: Of those, the ones torchrun does not forward itself: sent to its children, the workers.
TO_WORKERS = (signal.SIGUSR1,)


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (torchrun's workers), via psutil (a dependency of accelerate,
    which the recipe needs anyway)."""
    import psutil

    try:
        return [child.pid for child in psutil.Process(pid).children()]
    except psutil.NoSuchProcess:
        return []


def run_forwarding_signals(command: Sequence[str], env: dict[str, str] | None = None) -> int:
    """Run ``command`` (torchrun), passing `FORWARDED` signals on; return its exit code (128 + N when it
    died of signal N). The previous handlers come back afterwards."""
    proc = subprocess.Popen(list(command), env=env, start_new_session=True)
    passed: list[str] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        passed.append(signal.Signals(signum).name)
        targets = _children(proc.pid) if signum in TO_WORKERS else [proc.pid]
        for pid in targets:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    try:
        code = proc.wait()  # a handled signal interrupts the wait only to run the handler (PEP 475)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    code = 128 - code if code < 0 else code
    if passed:  # the last line under torchrun's own report of the signal
        where = "its workers" if passed[0] in {s.name for s in TO_WORKERS} else "torchrun"
        print(
            f"finetune: {passed[0]} passed on to {where}; the launcher exits with torchrun's code, {code}",
            file=sys.stderr,
            flush=True,
        )
    return code
