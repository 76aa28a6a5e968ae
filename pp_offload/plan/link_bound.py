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

__all__ = ["LinkBound", "LinkGap", "link_bound", "most_off_device", "reach_at"]


@dataclass(frozen=True)
class LinkBound:
    """The tightest moment of the bound: on ``rank`` at ``time_s`` (the plain order's clock), ``need``
    bytes must be off the device for the target and at most ``can`` can be; ``live`` bytes are held there
    without offload. ``ratio`` = need / can (0: the target needs no offload anywhere). ``chunk``: the
    (stage, microbatch) whose forward starts at that moment (the same pass can be found in a replay with
    offload, whose clock runs later)."""

    ratio: float
    rank: int
    time_s: float
    need: int
    can: int
    live: int
    chunk: tuple[int, int] = (-1, -1)


@dataclass(frozen=True)
class LinkGap:
    """A missed target split at `link_bound`'s tightest moment (``rank``, the forward of ``chunk``): ``need``
    bytes must be off the device there; an offload plan's replay has ``off`` off at that pass (the
    placement); any placement could have ``can_plain`` off in the plain order's own timing (the lanes' time
    up to that pass, no step-time room spent) and ``can`` with the room as slack (the bound's figure).
    ``off`` close to ``can_plain``: the placement takes all the plain timing allows, and the rest needs
    the order itself to wait for the copies; ``can`` below ``need``: no placement reaches the target.
    ``idle_after``: seconds the rank's compute idles after that forward in the plain order, a hint of what
    a forward held back for its copies would cost there."""

    rank: int
    chunk: tuple[int, int]
    need: int
    off: int
    can_plain: int
    can: int
    idle_after: float = 0.0


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
        chunks = _chunks(sim, stage_bytes, rank)
        for t, _, _, key in chunks:  # the level jumps at every forward start
            need = _live(chunks, t)[0] - target
            if need <= 0:
                continue
            level, can = _reach(chunks, t, bandwidth, slack)
            ratio = need / can if can > 0 else math.inf
            if ratio > worst.ratio:
                worst = LinkBound(ratio, rank, t, int(need), int(can), int(level), key)
    return worst


def reach_at(
    sim: Any, stage_bytes: Any, *, rank: int, time_s: float, bandwidth: float, slack: float = 0.0
) -> tuple[int, int]:
    """``rank``'s live bytes at ``time_s`` of the replay ``sim`` (no offload) and the most any placement
    can have off the device then (`most_off_device`). Why at a given moment: to split a missed target at
    `link_bound`'s tightest moment into the link's share (``slack=0``: what the plain order's own timing
    lets the lanes carry by then) and the placement's (what a replay with offload has off at that pass,
    `pp_offload.order.offload_inputs.activation_level`)."""
    level, can = _reach(_chunks(sim, stage_bytes, rank), time_s, bandwidth, slack)
    return int(level), int(can)


def _chunks(sim: Any, stage_bytes: Any, rank: int) -> list[tuple[float, list, Any, tuple[int, int]]]:
    """``rank``'s chunks: forward start, backward passes (start, end) in time order, stage bytes, key."""
    passes: dict[tuple[int, int], dict[str, tuple[float, float]]] = {}
    for (stage, kind, mb), start, finish in sim.timeline[rank]:
        passes.setdefault((stage, mb), {})[kind] = (start, finish)
    return [
        (p[F][0], sorted(p[k] for k in (I, W, B) if k in p), stage_bytes[key[0]], key)
        for key, p in passes.items()
    ]


def _live(chunks: list, t: float) -> tuple[int, list]:
    """The live bytes at ``t`` (a chunk holds its total until its first backward ends, then its saved
    bytes until its last) and the live chunks."""
    live = [(f, backs, b) for f, backs, b, _ in chunks if f <= t < backs[-1][1]]
    return sum(b.total if t < backs[0][1] else b.saved for _, backs, b in live), live


def _reach(chunks: list, t: float, bandwidth: float, slack: float) -> tuple[float, float]:
    """`_live`'s bytes at ``t`` and the most of them any placement can have off the device then."""
    level, live = _live(chunks, t)
    saved = np.array([b.saved for _, _, b in live], dtype=float)
    ready = np.array([f for f, _, _ in live])
    due = np.array([next(end for _, end in backs if end > t) for _, backs, _ in live])
    return level, most_off_device(t, saved, ready, due, bandwidth, slack)
