"""Whether a target activation peak is within the host link's physical reach, for a given order.

Why: when the best offload policy misses a target, the miss is either the policy's (a better placement
would reach it) or the link's (no placement can). The whole step's capacity (step time x bandwidth per
direction) is a weak test: it is usually far above the bytes a step saves. What binds is *when* the
bytes must be gone. At any moment t, a rank holds its live chunks' bytes; to stay at or below a target,
``level(t) - target`` of them must be off the device at t. Each chunk c's bytes can leave only after its
forward starts (``f_c``, one device-to-host lane) and must be back before its next backward pass ends
(``b_c``, the host-to-device lane). So the most any placement can have off the device at t is

    max sum x_c  subject to  0 <= x_c <= saved_c,
                             sum over c with f_c >= s of x_c <= bw x (t - s + slack)   for every s,
                             sum over c with b_c <= u of x_c <= bw x (u - t + slack)   for every u,

(the copies out of the chunks that started after s fit in what the lane carries from s to t; the copies
back of those needed by u fit in what the other lane carries from t to u; ``slack``: extra time allowed,
e.g. the step-time room left to offload, granted to both lanes so the bound stays a bound when offload
delays the order). Both constraint families are nested, so the maximum has a closed form (polymatroid
intersection, min over a cut pair):
``min over s, u of bw(t - s + slack) + bw(u - t + slack) + sum of saved_c with f_c < s and b_c > u``.
``need / can`` > 1 at any t means the target is out of reach for that order whatever is offloaded.

Accounting as the planner's (`pp_offload.order.offload_inputs.activation_peaks`): a chunk holds its
stage's bytes from the start of its F; only ``saved`` bytes can move.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from pp_offload.order.actions import B, F, I, W

__all__ = ["LinkBound", "link_bound", "most_off_device"]


@dataclass(frozen=True)
class LinkBound:
    """The tightest moment of the bound: on ``rank`` at ``time_s`` (the plain order's clock), ``need``
    bytes must be off the device for the target and at most ``can`` can be; ``live`` bytes are held there
    without offload. ``ratio`` = need / can (0: the target needs no offload anywhere)."""

    ratio: float
    rank: int
    time_s: float
    need: int
    can: int
    live: int


def most_off_device(
    t: float, saved: np.ndarray, ready: np.ndarray, due: np.ndarray, bandwidth: float, slack: float
) -> float:
    """The most bytes any placement can have off the device at ``t`` (module doc): chunks of ``saved``
    bytes that can leave from ``ready`` and must be back by ``due`` (arrays of one entry per live chunk),
    one lane each way at ``bandwidth`` bytes per second."""
    if saved.size == 0:
        return 0.0
    if math.isinf(bandwidth):
        return float(saved.sum())
    cuts_out = np.append(ready, math.inf)  # s: the lane out constrains chunks ready at or after s
    cuts_back = np.append(due, -math.inf)  # u: the lane back constrains chunks due at or before u
    # the infinite cuts constrain nothing (capacity 0, every chunk on the free side)
    cap_out = bandwidth * np.maximum(0.0, t - np.append(ready, t + slack) + slack)
    cap_back = bandwidth * np.maximum(0.0, np.append(due, t - slack) - t + slack)
    before = (ready[None, :] < cuts_out[:, None]) * saved[None, :]  # [s, c]: saved_c if f_c < s
    after = (due[:, None] > cuts_back[None, :]).astype(float)  # [c, u]: 1 if b_c > u
    total = cap_out[:, None] + cap_back[None, :] + before @ after
    return float(total.min())


def link_bound(
    sim: Any, stage_bytes: Any, *, target: float, bandwidth: float, slack: float = 0.0
) -> LinkBound:
    """The bound (module doc) of the replay ``sim`` (an order without offload, `pp_offload.sim.simulate`)
    with per-stage bytes ``stage_bytes`` (`pp_offload.order.offload_inputs.StageBytes`), for a per-rank
    peak of ``target`` bytes, a host link of ``bandwidth`` bytes per second each way and ``slack`` seconds
    of extra time: the moment with the largest need / can over every rank and every forward start."""
    worst = LinkBound(0.0, 0, 0.0, 0, 0, 0)
    for rank in sorted(sim.timeline):
        passes: dict[tuple[int, int], dict[str, tuple[float, float]]] = {}
        for (stage, kind, mb), start, finish in sim.timeline[rank]:
            passes.setdefault((stage, mb), {})[kind] = (start, finish)
        chunks = []
        for (stage, _), p in passes.items():
            f = p[F]
            backs = sorted(p[k] for k in (I, W, B) if k in p)
            b = stage_bytes[stage]
            chunks.append((f[0], backs, b))
        for t, _, _ in chunks:  # the level jumps at every forward start
            live = [(f, backs, b) for f, backs, b in chunks if f <= t < backs[-1][1]]
            level = sum(b.total if t < backs[0][1] else b.saved for _, backs, b in live)
            need = level - target
            if need <= 0:
                continue
            saved = np.array([b.saved for _, _, b in live], dtype=float)
            ready = np.array([f for f, _, _ in live])
            due = np.array([next(end for _, end in backs if end > t) for _, backs, _ in live])
            can = most_off_device(t, saved, ready, due, bandwidth, slack)
            ratio = need / can if can > 0 else math.inf
            if ratio > worst.ratio:
                worst = LinkBound(ratio, rank, t, int(need), int(can), int(level))
    return worst
