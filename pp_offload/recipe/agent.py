"""torchrun for ``pp-offload train``: ``torch.distributed.run`` whose stop by a signal is one line, not a
traceback.

Why: the launcher passes SIGTERM and SIGINT on to torchrun (`pp_offload.recipe.signals`). torchrun's agent
then stops its workers, giving them time to write their checkpoint, and raises its ``SignalException`` up
through its ``main``: a 30-line traceback printed after the workers' own clean lines, which reads like a
crash of a run that stopped as asked. Here that stop prints one line and exits with the shell's code for a
death by that signal (128 + its number: 143 for SIGTERM, 130 for SIGINT), which tells a scheduler the run
was interrupted. Everything else is torchrun unchanged: same arguments, same exit codes.

    python -m pp_offload.recipe.agent --standalone --nproc-per-node 2 -m pp_offload.recipe config.yaml
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run torchrun with ``argv`` (default: this process's arguments); its exit code."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main(None if argv is None else list(argv))
    except SignalException as stop:
        sig = signal.Signals(stop.sigval)
        print(
            f"torchrun: stopped by {sig.name}; its workers were given time to write their checkpoint "
            f"(exit {128 + int(sig)})",
            file=sys.stderr,
            flush=True,
        )
        return 128 + int(sig)
    return 0


if __name__ == "__main__":
    sys.exit(main())
