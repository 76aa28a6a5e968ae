"""Offload-aware zero-bubble orders: W moved right after its I where offload needs the memory.

Why this exists: zero-bubble orders (V-ZB, torch's ZBV and InterleavedZeroBubble) split each backward into
I (input gradient, on the critical path) and W (weight gradient), and hold W back to fill bubbles. Both
passes unpack the chunk's saved tensors, so a chunk stays on the device from its RELOAD before I until its
W ends. Budget offload has one remedy inside a fixed order: drop the chunk again after I and reload it
before W (`pp_offload.order.offload.OffloadPolicy.drop_after_i`), which costs a second host-to-device copy
on a link that is already the bottleneck at real sizes. The other remedy changes the order: run W right
after I for the chunks offload moves, so their tensors come back once and die at I/W, and let W fill
bubbles only for chunks kept resident.

`pull_weight_passes` is that transformation. It keeps every dependency (nothing waits for a W; a W waits
only for its own I, which now directly precedes it) and can only lower a rank's memory (every chunk dies
no later than before, and the rank's sequence is otherwise unchanged), so an order within a memory cap
stays within it. It may lengthen the step: the W passes it moves no longer fill bubbles.

`plan_close_w` chooses where to apply it, scored exactly as the budget policy scores its own choices: each
candidate order gets its budget offload plan (`pp_offload.order.offload.plan_offload`, the same per-stage
costs, layer counts, copy times and byte peaks), and the step-time limit is the budget's ``max_slowdown``
measured against the *unmodified* order without offload, so a candidate's lost bubble filling counts
against its offload's share of the limit. A candidate pulls every held-back W on a set of ranks (not only
the offloaded chunks': a chunk the budget keeps on the device holds its memory until its W too, and pulling
only the offloaded ones measured a higher peak, 25.5 against 24.0 GiB on torch's InterleavedZeroBubble,
Llama-3-8B, H100, seq 4096, within 10%). The set grows greedily from the empty set (the budget plan of the
order as given) by the rank left at the highest peak or by all the ranks left (two plans a round), while
the per-rank peaks fall (highest first, then the next: a tie between two ranks at the top is broken one
rank at a time). The plan returned is the one with the lowest highest peak seen, the fastest among equal
peaks: the order as given unless a pull lowers the peak that counts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any

from pp_offload.order.actions import Action, Costs, I, W
from pp_offload.sim import simulate

__all__ = ["plan_close_w", "pull_weight_passes", "separated_weight_passes"]

_TOLERANCE = 1e-3  # relative: peaks within it are equal (bytes; a few bytes are not worth step time)


def separated_weight_passes(order: Mapping[int, Iterable[Any]]) -> dict[int, list[tuple[int, int]]]:
    """Per rank, the (stage, microbatch) chunks whose W does not directly follow their I (compute passes;
    ours or torch's actions): the chunks a zero-bubble order holds on the device from I to W."""
    out: dict[int, list[tuple[int, int]]] = {}
    for rank, actions in order.items():
        compute = [_fields(a) for a in actions if a is not None and _fields(a)[1] in ("F", I, W, "B")]
        out[rank] = [
            (stage, mb)
            for k, (stage, kind, mb) in enumerate(compute)
            if kind == W and k > 0 and compute[k - 1] != (stage, I, mb)
        ]
    return out


def pull_weight_passes(
    order: Mapping[int, Iterable[Any]], chunks: Iterable[tuple[int, int]]
) -> dict[int, list[Any]]:
    """``order`` (rank -> actions, ours or torch's compute-only ``pipeline_order``, ``None`` slots kept) with
    the W of every (stage, microbatch) in ``chunks`` moved to right after that chunk's I on its rank, and
    everything else in place (module doc: dependencies and memory cap kept). A chunk without both an I and
    a W on one rank (a full B, torch's stage 0 as executed) is refused."""
    wanted = set(chunks)
    out: dict[int, list[Any]] = {}
    found: set[tuple[int, int]] = set()
    for rank, actions in order.items():
        actions = list(actions)
        passes = {_fields(a) for a in actions if a is not None}
        mine = {key for key in wanted if (key[0], I, key[1]) in passes and (key[0], W, key[1]) in passes}
        moved = {}
        for a in actions:
            if a is not None and _fields(a)[1] == W and (_fields(a)[0], _fields(a)[2]) in mine:
                moved[(_fields(a)[0], _fields(a)[2])] = a
        seq: list[Any] = []
        for a in actions:
            stage, kind, mb = _fields(a) if a is not None else (None, None, None)
            if kind == W and (stage, mb) in mine:
                continue
            seq.append(a)
            if kind == I and (stage, mb) in mine:
                seq.append(moved[(stage, mb)])
        out[rank] = seq
        found |= mine
    missing = wanted - found
    if missing:
        raise ValueError(
            f"cannot move W next to I for chunks {sorted(missing)}: no rank runs both an I and a W of them "
            "(a full backward B has no W to move)"
        )
    return out


def _fields(action: Any) -> tuple[int, str, int]:
    kind = action.computation_type
    return int(action.stage_index), str(getattr(kind, "value", kind)), int(action.microbatch_index or 0)


def plan_close_w(
    compute: Mapping[int, list[Action]],
    costs: Costs,
    policy: Any,
    plan: Callable[[Mapping[int, list[Action]], Any], Any],
    peaks_of: Callable[[Any], Mapping[int, float]],
) -> Any:
    """The best budget plan over offload-aware versions of ``compute`` (module doc).

    ``policy``: a budget `OffloadPolicy` without a fraction; ``plan(order, policy)`` makes a budget plan
    (`pp_offload.order.offload.plan_offload` with the caller's layers, copy times and peaks); ``peaks_of``
    gives a plan's per-rank peak (bytes when the caller has them). Returns that plan with ``pulled`` set to
    the chunks whose W moved, per rank.
    """
    limit = simulate(compute, costs).makespan * (1.0 + policy.max_slowdown)
    inner = replace(policy, close_w=False)
    best = plan(compute, inner)  # the order as given: the empty set of ranks
    unit = max(max(peaks_of(best).values()), 1e-30) * _TOLERANCE
    best_key = _key(peaks_of(best), best.sim.makespan, unit)
    pullable = {r: keys for r, keys in separated_weight_passes(compute).items() if keys}
    chosen: list[int] = []
    pulled: dict[int, list[tuple[int, int]]] = {}
    # the walk goes by all per-rank peaks (a tie at the top is broken one rank at a time); what it returns
    # is the lowest highest peak it saw, the fastest among equal ones (never slower for the same peak)
    walk = (best_key, best, pulled)
    result = (best_key[:1] + best_key[-1:], best, pulled)
    while True:
        found = None
        left = sorted(set(pullable) - set(chosen))
        if not left:
            break
        # the rank at the highest peak of the walk's plan alone, and every rank left at once: two budget plans
        # a round, so a deep pipeline costs O(ranks) plans, not O(ranks^2)
        now = peaks_of(walk[1])
        top = max(left, key=lambda r: (now.get(r, 0.0), -r))
        for ranks in [[top]] + ([left] if len(left) > 1 else []):
            trial = {r: pullable[r] for r in (*chosen, *ranks)}
            order = pull_weight_passes(compute, [key for keys in trial.values() for key in keys])
            plain = simulate(order, costs).makespan
            if plain > limit:
                continue  # losing the bubble filling alone costs more than the whole limit
            candidate = plan(order, replace(inner, max_slowdown=limit / plain - 1.0))
            key = _key(peaks_of(candidate), candidate.sim.makespan, unit)
            if key[:1] + key[-1:] < result[0]:
                result = (key[:1] + key[-1:], candidate, trial)
            if key < walk[0] and (found is None or key < found[0]):
                found = (key, ranks, candidate, trial)
        if found is None:
            break
        walk = (found[0], found[2], found[3])
        chosen += found[1]
    _, best, pulled = result
    best.pulled = {r: list(keys) for r, keys in pulled.items()}
    best.policy = policy
    return best


def _key(peaks: Mapping[int, float], makespan: float, unit: float) -> tuple:
    """Per-rank peaks, highest first, each in steps of ``unit`` (the tolerance of the first plan's highest
    peak), then the step time: lower is better."""
    return (*(math.floor(p / unit + 0.5) for p in sorted(peaks.values(), reverse=True)), makespan)
