"""Disk cache of searched V orders, keyed by (d, m, costs, cap); on by default.

Why: every rank builds its schedule at start-up, and the adaptive search is pure Python that grows with
d (seconds at d=16, tens of seconds at d=32). A job restarted with the same sizes and costs, and the
other ranks of a job on the same machine, should not pay that again.

Where: ``$PP_OFFLOAD_ORDER_CACHE`` if set, else ``$XDG_CACHE_HOME/pp_offload/orders`` (default
``~/.cache/pp_offload/orders``). ``PP_OFFLOAD_ORDER_CACHE=off`` (or ``0``, ``none``, ``false``, or empty)
disables it. Entries are small JSON files written atomically (a temporary file in the same directory,
renamed into place), so many ranks writing the same entry at once cannot corrupt it: each rename
installs a complete file with the same content. An unreadable entry is ignored and rebuilt; a directory
that cannot be written only costs the time the cache would have saved. The key includes
``SEARCH_VERSION``, bumped whenever the search would return a different order for the same inputs, so
a stale entry is never read.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

from pp_offload.order.actions import Action, Costs, Order

ENV = "PP_OFFLOAD_ORDER_CACHE"
SEARCH_VERSION = 5
_OFF = {"", "0", "off", "none", "false", "no"}


def cache_dir() -> Path | None:
    """The directory orders are cached in, or None when the cache is disabled (see the module doc)."""
    value = os.environ.get(ENV)
    if value is not None:
        return None if value.strip().lower() in _OFF else Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME")
    try:
        root = Path(base) if base else Path.home() / ".cache"
    except RuntimeError:  # no home directory to resolve: no default cache
        return None
    return root / "pp_offload" / "orders"


def _path(num_ranks: int, num_microbatches: int, costs: Costs, cap: float) -> Path | None:
    root = cache_dir()
    if root is None:
        return None
    key = json.dumps(
        [SEARCH_VERSION, num_ranks, num_microbatches, repr(costs), round(float(cap), 9)], sort_keys=True
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:32]
    return root / f"v-order-{digest}.json"


def load(num_ranks: int, num_microbatches: int, costs: Costs, cap: float) -> Order | None:
    """The cached order for these inputs, or None (cache disabled, no entry, or a bad entry)."""
    path = _path(num_ranks, num_microbatches, costs, cap)
    if path is None or not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        order = {int(r): [Action(int(s), str(k), int(j)) for s, k, j in acts] for r, acts in data.items()}
    except (OSError, ValueError, TypeError):
        return None
    return order if sorted(order) == list(range(num_ranks)) else None


def store(num_ranks: int, num_microbatches: int, costs: Costs, cap: float, order: Order) -> None:
    """Write ``order`` for these inputs unless the cache is disabled (errors are not fatal: the cache only
    saves time)."""
    path = _path(num_ranks, num_microbatches, costs, cap)
    if path is None:
        return
    tmp_name = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = json.dumps({str(r): [list(a) for a in actions] for r, actions in order.items()})
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as tmp:
            tmp_name = tmp.name
            tmp.write(payload)
        os.replace(tmp_name, path)
    except OSError:
        if tmp_name is not None:
            Path(tmp_name).unlink(missing_ok=True)
