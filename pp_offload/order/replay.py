"""A lean replay of compute-only V orders: makespan and peak, nothing else.

Why a second replay beside `pp_offload.sim.simulate`: the adaptive search scores thousands of candidate
orders, and the full simulator builds a timeline, memory curves and offload state for each. This one
keeps only what the search ranks by (the same model: a pass starts when its rank is free and its
dependency has ended, plus ``costs.comm`` across ranks; a chunk is held from its F to its W), and
tests check it agrees with `simulate` exactly. Every order the search returns is still measured by
`simulate`.
"""

from __future__ import annotations

from operator import itemgetter

from pp_offload.order.actions import Costs, F, I, Order, W
from pp_offload.sim import OrderDeadlockError

_MICROBATCH = itemgetter(2)


def replay(order: Order, costs: Costs) -> tuple[float, int]:
    """``(makespan, peak)`` of a V order (``2d`` stages on ``d`` ranks, F/I/W only); peak in chunk units.

    Raises `OrderDeadlockError` when the order cannot complete.
    """
    makespan, peaks = replay_ranks(order, costs)
    return makespan, max(peaks)


def is_v_order(order: Order) -> bool:
    """Whether `replay` models ``order``: ranks 0..d-1 holding the 2d V stages, only F/I/W passes."""
    d = len(order)
    if sorted(order) != list(range(d)):
        return False
    for r, actions in order.items():
        pair = (r, 2 * d - 1 - r)
        for a in actions:
            if a.computation_type not in (F, I, W) or a.stage_index not in pair:
                return False
    return True


def replay_ranks(
    order: Order, costs: Costs, starts: dict[tuple[int, str, int], float] | None = None
) -> tuple[float, list[int]]:
    """``(makespan, per-rank peak)`` of a V order; see `replay`. ``starts``, when given, receives every
    pass's start time, keyed ``(stage, kind, microbatch)``."""
    d = len(order)
    last = 2 * d - 1
    # durations per stage, one list per kind: looked up by the pass's stage in the hot loop
    if costs.stages is None:
        cost_f, cost_i, cost_w = [costs.F] * (2 * d), [costs.I] * (2 * d), [costs.W] * (2 * d)
    else:
        cost_f, cost_i, cost_w = ([costs.of_stage(s, kind) for s in range(2 * d)] for kind in (F, I, W))
    comm = costs.comm
    num_mb = 1 + max((max(order[r], key=_MICROBATCH)[2] for r in range(d) if order[r]), default=0)
    # end times per stage and microbatch (None: not run yet); lists, not a dict of tuples: hot loop
    end_f = [[None] * num_mb for _ in range(2 * d)]
    end_i = [[None] * num_mb for _ in range(2 * d)]
    clock = [0.0] * d
    pos = [0] * d
    level = [0] * d
    peaks = [0] * d
    seqs = [order[r] for r in range(d)]
    remaining = sum(len(s) for s in seqs)
    while remaining:
        progressed = False
        for r in range(d):
            seq = seqs[r]
            p, t = pos[r], clock[r]
            while p < len(seq):
                stage, kind, mb = seq[p]
                if kind == F:
                    if stage == 0:
                        ready = 0.0
                    else:
                        done = end_f[stage - 1][mb]
                        if done is None:
                            break
                        ready = done if stage == d else done + comm
                    if ready > t:
                        t = ready
                    if starts is not None:
                        starts[(stage, kind, mb)] = t
                    t += cost_f[stage]
                    end_f[stage][mb] = t
                    level[r] += 1
                    if level[r] > peaks[r]:
                        peaks[r] = level[r]
                elif kind == I:
                    if stage == last:
                        done = end_f[stage][mb]
                        if done is None:
                            break
                        ready = done
                    else:
                        done = end_i[stage + 1][mb]
                        if done is None:
                            break
                        ready = done if stage == d - 1 else done + comm
                    if ready > t:
                        t = ready
                    if starts is not None:
                        starts[(stage, kind, mb)] = t
                    t += cost_i[stage]
                    end_i[stage][mb] = t
                else:
                    done = end_i[stage][mb]
                    if done is None:
                        break
                    if done > t:
                        t = done
                    if starts is not None:
                        starts[(stage, kind, mb)] = t
                    t += cost_w[stage]
                    level[r] -= 1
                p += 1
            if p != pos[r]:
                remaining -= p - pos[r]
                pos[r], clock[r] = p, t
                progressed = True
        if not progressed:
            raise OrderDeadlockError(
                "order cannot complete: every rank waits on a pass that never runs before it"
            )
    return max(clock), peaks
