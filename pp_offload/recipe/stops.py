"""Ways a run stops on purpose, each with the exit code the command line returns for it.

Why a type: these are not bugs and need no traceback; every rank raises the same one after the same
step (the decision was agreed), rank 0 prints its one line and the process exits with ``exit_code``
(docs/reliability.md lists the codes).
"""

from __future__ import annotations

__all__ = ["EXIT_NON_FINITE", "EXIT_STALLED", "NonFiniteSteps", "RunStopped"]

EXIT_NON_FINITE = 3  #: too many consecutive non-finite steps (train.max_bad_steps)
EXIT_STALLED = 4  #: a step made no progress for train.stall_timeout seconds


class RunStopped(RuntimeError):
    """The run stopped for a reason its message gives in one line; ``exit_code`` for the command line."""

    exit_code = 1


class NonFiniteSteps(RunStopped):
    """``train.max_bad_steps`` steps in a row had a non-finite loss or gradient norm."""

    exit_code = EXIT_NON_FINITE
