"""Critical-chain polish: let the passes that decide the makespan go ahead of the pass that held their rank.

Compaction (`pp_offload.order.compact`) keeps each rank's order and only pulls passes into idle gaps, so it
never helps a pass that was *ready* but found its rank busy with a pass that could have waited. That
happens in the drain above all: a rank starts a weight pass W just before the input-gradient pass I of the
last microbatches reaches it, and every rank behind it on the backward chain waits the rest of that W.
A schedule that idles one slot, runs the I first and the W after is faster. That shape came from an
exact solver (CP-SAT, run outside the library) at d=8, m=32, F:I:W=3:4:2, limit 15, which found 613 time
units where the search had 614; with the polish the search reaches 611 (`bench/results/adaptive.json`).

The polish walks the critical chain back from the last pass to end: a pass that started the moment its
rank's previous pass ended, although its dependency had ended earlier, waited for its rank (a resource
edge). Each move swaps such a pass with the pass just before it on its rank, latest on the chain first,
and is kept when the replayed makespan does not grow and the rank's activation level stays within the
cap. Ties are accepted (one swap alone often gains nothing: the next rank on the chain has the same
conflict), so the walk continues along the chain, and the fastest order seen is returned.

Moves never swap two passes of the same stage and kind (torch's runtime and lowering expect each
(stage, kind) to run its microbatches in order), and cannot deadlock: a pass that waited for its rank had
every dependency done before the pass it overtakes ended, so none of them depends on that pass.
"""

from __future__ import annotations

from dataclasses import dataclass

from pp_offload.order.actions import Costs, F, Order, W
from pp_offload.order.replay import replay_ranks
from pp_offload.sim import OrderDeadlockError, dependency

__all__ = ["Polished", "polish_order"]

_EPS = 1e-9


@dataclass(frozen=True)
class Polished:
    """A polished order, its makespan and peak, and whether the cap refused a move (``bound``): when it
    did not, the same polish under any larger cap takes the same steps and gives this same order."""

    order: Order
    makespan: float
    peak: int
    bound: bool


def polish_order(
    order: Order, costs: Costs, cap: int, max_steps: int | None = None, max_trials: int | None = None
) -> Polished:
    """``order`` with critical passes moved ahead of the pass that held their rank (see the module doc);
    never slower than ``order``, every rank's peak within ``cap`` (chunk units). ``max_steps`` bounds the
    accepted moves (default ``6 * d``: about one per rank along a few drain chains) and ``max_trials`` the
    replays of moves tried (default ``12 * d``), which keeps the polish a small share of the search."""
    d = len(order)
    steps = 6 * d if max_steps is None else max_steps
    trials = 12 * d if max_trials is None else max_trials
    current = {r: list(actions) for r, actions in order.items()}
    starts: dict = {}
    makespan, peaks = replay_ranks(current, costs, starts)
    best = Polished(current, makespan, max(peaks), False)
    bound = False
    for _ in range(steps):
        moved = None
        for rank, p in _resource_edges(current, costs, starts):
            actions = current[rank]
            ahead, behind = actions[p], actions[p - 1]
            if ahead[0] == behind[0] and ahead[1] == behind[1]:
                continue  # same stage and kind: microbatches stay in order
            if ahead[1] == F and behind[1] == W and _level_before(actions, p - 1) + 1 > cap:
                bound = True
                continue
            if trials <= 0:
                break
            trials -= 1
            trial = dict(current)
            trial[rank] = actions[: p - 1] + [ahead, behind] + actions[p + 1 :]
            trial_starts: dict = {}
            try:
                trial_makespan, trial_peaks = replay_ranks(trial, costs, trial_starts)
            except OrderDeadlockError:  # cannot happen (see the module doc); never trusted blindly
                continue
            if trial_makespan > makespan + _EPS:
                continue
            moved = trial, trial_starts, trial_makespan, max(trial_peaks)
            break
        if moved is None:
            break
        current, starts, makespan, peak = moved
        if makespan < best.makespan - _EPS:
            best = Polished(current, makespan, peak, bound)
    return Polished(best.order, best.makespan, best.peak, bound)


def _level_before(actions: list, p: int) -> int:
    """Chunks a rank holds just before its ``p``-th pass (F adds one, W frees one)."""
    level = 0
    for a in actions[:p]:
        if a[1] == F:
            level += 1
        elif a[1] == W:
            level -= 1
    return level


def _resource_edges(order: Order, costs: Costs, starts: dict) -> list[tuple[int, int]]:
    """``(rank, position)`` of each pass on the critical chain that waited for its rank, latest first.

    The chain is walked back from the pass that ends last: through a pass's dependency when the pass
    started as soon as that dependency (plus ``costs.comm`` across ranks) allowed, else through the pass
    before it on its rank."""
    d = len(order)
    last = 2 * d - 1
    rank_of = [s if s < d else last - s for s in range(2 * d)]
    where = {(a[0], a[1], a[2]): p for actions in order.values() for p, a in enumerate(actions)}

    def end(key: tuple) -> float:
        return starts[key] + costs.of_stage(key[0], key[1])

    key = max(starts, key=lambda k: (end(k), k))
    edges = []
    while True:
        rank, p = rank_of[key[0]], where[key]
        start = starts[key]
        dep = dependency(*key, 2 * d)
        ready = 0.0 if dep is None else end(dep) + (costs.comm if rank_of[dep[0]] != rank else 0.0)
        prev = order[rank][p - 1] if p > 0 else None
        prev_key = None if prev is None else (prev[0], prev[1], prev[2])
        if prev_key is not None and abs(end(prev_key) - start) < _EPS and ready < start - _EPS:
            edges.append((rank, p))  # waited for its rank
            key = prev_key
        elif dep is not None and abs(ready - start) < _EPS:
            key = dep  # waited for its dependency
        elif prev_key is not None:
            key = prev_key  # neither (an idle gap before it): go on along its rank
        else:
            return edges
