"""Optional disk cache of searched V orders, keyed by (d, m, costs, cap).

Why: every rank builds its schedule at start-up, and the adaptive search is pure Python that grows with
d (tens of seconds at d=16). A job restarted with the same sizes and costs should not pay that again.
Opt-in: set ``PP_OFFLOAD_ORDER_CACHE`` to a directory. Entries are small JSON files written atomically
(a temporary file renamed into place), so ranks writing the same entry at once cannot corrupt it; an
unreadable entry is ignored and rebuilt. The key includes ``SEARCH_VERSION``, bumped whenever the search
would return a different order for the same inputs.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

from pp_offload.order.actions import Action, Costs, Order

ENV = "PP_OFFLOAD_ORDER_CACHE"
SEARCH_VERSION = 2


def _path(num_ranks: int, num_microbatches: int, costs: Costs, cap: float) -> Path | None:
    root = os.environ.get(ENV)
    if not root:
        return None
    key = json.dumps(
        [SEARCH_VERSION, num_ranks, num_microbatches, repr(costs), round(float(cap), 9)], sort_keys=True
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:32]
    return Path(root) / f"v-order-{digest}.json"


def load(num_ranks: int, num_microbatches: int, costs: Costs, cap: float) -> Order | None:
    """The cached order for these inputs, or None (no cache configured, no entry, or a bad entry)."""
    path = _path(num_ranks, num_microbatches, costs, cap)
    if path is None or not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        return {int(rank): [Action(s, k, j) for s, k, j in actions] for rank, actions in data.items()}
    except (OSError, ValueError, TypeError):
        return None


def store(num_ranks: int, num_microbatches: int, costs: Costs, cap: float, order: Order) -> None:
    """Write ``order`` for these inputs if a cache directory is configured (errors are not fatal: the
    cache only saves time)."""
    path = _path(num_ranks, num_microbatches, costs, cap)
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = json.dumps({str(r): [list(a) for a in actions] for r, actions in order.items()})
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as tmp:
            tmp.write(payload)
        os.replace(tmp.name, path)
    except OSError:
        return
