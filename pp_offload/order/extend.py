"""Lengthen an order by repeating its steady phase: an order for ``H`` microbatches becomes one for ``m``.

Why: the adaptive search ranks and compacts its candidates on a short horizon (enough microbatches to
hold a warm-up, a steady phase and a drain), and then needs the winners for all ``m`` microbatches.
Rebuilding and compacting them again costs about ``d x m`` per candidate and was most of the search's
time at large d. In the steady phase of an order, every rank runs the same six passes (F, I, W of its
two chunks) over and over, each one microbatch further than six passes before; inserting ``m - H`` more
of those periods where that repetition holds gives the longer order directly, with the same warm-up,
the same drain and the same steady rhythm. The caller replays the result (timing, peak, deadlock), so a
rank without such a repetition only means falling back to the slow path, never a wrong order.
"""

from __future__ import annotations

from pp_offload.order.actions import Action, Order

PASSES_PER_MICROBATCH = 6  # F, I, W of two chunks
_MIN_PERIODS = 2  # a repetition must hold this many periods in a row to be trusted as the steady phase


def extend_order(order: Order, extra: int) -> Order | None:
    """``order`` with ``extra`` more microbatches inserted in every rank's steady phase, or None when a
    rank shows no steady repetition (then rebuild the order for the new size instead)."""
    if extra < 0:
        raise ValueError(f"extra must be >= 0, got {extra}")
    if extra == 0:
        return {rank: list(actions) for rank, actions in order.items()}
    out: Order = {}
    for rank, actions in order.items():
        start = _steady_start(actions)
        if start is None:
            return None
        period = actions[start : start + PASSES_PER_MICROBATCH]
        inserted = [Action(s, k, j + t) for t in range(extra) for s, k, j in period]
        shifted = [Action(s, k, j + extra) for s, k, j in actions[start:]]
        out[rank] = actions[:start] + inserted + shifted
    return out


def _steady_start(actions: list[Action]) -> int | None:
    """Start of the longest run where each pass repeats the one six before it, one microbatch on; the
    run must cover at least `_MIN_PERIODS` whole periods. None if there is none."""
    p = PASSES_PER_MICROBATCH
    best_len, best_start = 0, None
    run_start, run_len = 0, 0
    for k in range(len(actions) - p):
        s, kind, j = actions[k]
        s2, kind2, j2 = actions[k + p]
        if s == s2 and kind == kind2 and j2 == j + 1:
            if run_len == 0:
                run_start = k
            run_len += 1
            if run_len > best_len:
                best_len, best_start = run_len, run_start
        else:
            run_len = 0
    # run_len counts positions k with actions[k + p] == actions[k] + 1: a run of n such positions spans
    # n + p passes, i.e. (n + p) / p periods
    if best_start is None or best_len + p < _MIN_PERIODS * p:
        return None
    return best_start
