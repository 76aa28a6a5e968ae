"""``recipes/finetune.py`` with a fault injected, for tests/test_reliability.py's torchrun runs.

``PP_OFFLOAD_TEST_KILL=<rank>:<step>``: that rank SIGKILLs itself in the given (1-based) step's schedule,
in the first round only (``TORCHELASTIC_RESTART_COUNT`` 0), as the out-of-memory killer would.
"""

from __future__ import annotations

import os
import signal
import sys

from pp_offload.recipe.cli import main
from pp_offload.recipe.pipeline import Pipeline


def _install() -> None:
    spec = os.environ.get("PP_OFFLOAD_TEST_KILL")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    rank, step = (int(x) for x in spec.split(":"))
    if int(os.environ.get("RANK", "0")) != rank:
        return
    real = Pipeline.forward_backward
    calls = [0]

    def step_then_die(pipeline, batch):  # noqa: ANN001, ANN202
        calls[0] += 1
        if calls[0] == step:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(pipeline, batch)

    Pipeline.forward_backward = step_then_die


if __name__ == "__main__":
    _install()
    sys.exit(main())
