"""The candidates of a plan ranked, and the words that explain the ranking: which offload and recompute
candidates are useless, the recommendation's reason, what nothing fitting misses by, and the assumptions.

Why a module of its own: ranking and explaining read only the filled candidates (`pp_offload.plan.result`),
never how they were evaluated (`pp_offload.plan.sweep`), and their tie rule (`_TIE`) must be one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pp_offload.plan.machines import Machine
from pp_offload.plan.memory import RECOMPUTE, activation_is_modelled
from pp_offload.plan.model import ModelSpec
from pp_offload.plan.result import GIB, Candidate

_TIE = 1e-6


def _mark_useless(candidates: list[Candidate]) -> None:
    """Flag offload and recompute candidates that are a plainer candidate at a cost (`Candidate.useless`):
    an offload that moves nothing, or one slower than the same schedule and recompute without offload
    for no lower activation peak; a recompute slower than the schedule without recompute or offload for
    no lower activation peak."""
    plain = {(c.name, c.recompute): c for c in candidates if c.offload == "none" and c.evaluated}
    for c in candidates:
        if not c.evaluated or (c.offload == "none" and c.recompute == "none"):
            continue
        if c.offload != "none" and c.offloaded_share == 0:
            c.useless = "moves nothing: no chunk's forward-to-backward window hides a copy out and back"
            continue
        if c.offload.endswith(":close-w") and c.pulled_w == 0:
            c.useless = "moves no W next to its I: the plan of the order as given (as without close-w)"
            continue
        for base, what in (
            (plain.get((c.name, c.recompute)) if c.offload != "none" else None, "without offload"),
            (plain.get((c.name, "none")) if c.recompute != "none" else None, "without recompute"),
        ):
            if base is None or base is c or base.step_time is None or c.step_time is None:
                continue
            slower = c.step_time > base.step_time * (1 + _TIE)
            if slower and c.activation_peak >= base.activation_peak:
                c.useless = (
                    f"{100 * (c.step_time / base.step_time - 1):+.1f}% step time for no lower activation "
                    f"peak ({c.activation_peak / GIB:.1f} GiB, as {what})"
                )
                break


def _dp_sync_seconds(c: Candidate, dp: int, machine: Machine) -> float:
    """Ring all-reduce of the largest rank's gradients over ``dp`` replicas, after the pipeline."""
    if dp <= 1 or not c.breakdown:
        return 0.0
    grads = max(parts["grads"] for parts in c.breakdown)
    return 2.0 * (dp - 1) / dp * grads / machine.p2p_bandwidth


def _rank(
    candidates: list[Candidate],
    names: Sequence[str],
    policies: Sequence[str],
    modes: Sequence[str] = RECOMPUTE,
) -> list[Candidate]:
    def key(c: Candidate):
        extra = modes.index(c.recompute)
        if not c.evaluated:
            failed = 2 if c.error else 1.5
            return (failed, 0.0, 0, extra, 0, names.index(c.schedule), policies.index(c.offload))
        # equal step times (within 1e-6) tie: no offload first, no recompute, then lower memory, then the
        # listed order
        step = round(math.log(c.step_time), 6) if c.step_time and c.step_time > 0 else 0.0
        return (
            0 if c.fits else 1,
            step,
            policies.index(c.offload),
            extra,
            c.peak_bytes,
            names.index(c.schedule),
        )

    return sorted(candidates, key=key)


def _seconds(t: float) -> str:
    return f"{t:.3g} s" if t >= 1 else f"{1e3 * t:.3g} ms"


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.1f} GiB"


def _reason(best: Candidate, ranked: list[Candidate], memory_gib: float, aliases: dict[str, str]) -> str:
    text = (
        f"fastest that fits in {memory_gib:g} GiB: {best.label}, {_seconds(best.step_time)} per step, "
        f"device peak {_gib(best.peak_bytes)} (rank {best.peak_rank})"
    )
    faster = [c for c in ranked if c.evaluated and not c.fits and c.step_time < best.step_time * (1 - _TIE)]
    if faster:
        seen, shown = set(), []
        for c in faster:
            if c.name in seen:
                continue
            seen.add(c.name)
            shown.append(f"{c.label} does not fit by {_gib(c.over_bytes)}")
            if len(shown) == 2:
                break
        text += "; faster but too large: " + ", ".join(shown)

    def alias(c: Candidate) -> bool:  # the same orders under another name (V-Adaptive at a fixed cap)
        return aliases.get(c.schedule) == best.schedule or aliases.get(best.schedule) == c.schedule

    same = [
        c
        for c in ranked
        if c is not best
        and c.evaluated
        and c.fits
        and c.useless is None
        and not alias(c)
        and abs(c.step_time / best.step_time - 1) <= _TIE
    ]
    if same:
        text += f"; ties on time with {same[0].label} ({_gib(same[0].peak_bytes)})"
    return text


def _nothing_fits(closest: Candidate, memory_gib: float) -> str:
    parts = closest.breakdown[closest.peak_rank]
    state = parts["params"] + parts["grads"] + parts["optimizer"]
    return (
        f"nothing fits in {memory_gib:g} GiB per GPU: the smallest peak, {closest.label}, needs "
        f"{_gib(closest.peak_bytes)} on rank {closest.peak_rank}, {_gib(closest.over_bytes)} too much "
        f"(parameters + gradients + optimizer {_gib(state)}, activations {_gib(parts['activations'])}, "
        f"receive buffers {_gib(parts['recv_buffers'])}, transient + reserve "
        f"{_gib(parts['transient'] + parts['reserve'])})."
    )


def _assumptions(spec: ModelSpec, dtype: str, mode: str, dp: int, dp_shard: bool) -> list[str]:
    notes = [
        "sdpa/flash attention without padding mask (no seq^2 tensor saved); model in "
        f"{dtype}{' with fp32 master weights' if dtype != 'fp32' else ''}; AdamW with fp32 moments",
        "pass times from matmul FLOPs / (peak x MFU); simulator costs per chunk from the busiest rank",
        "torch keeps a receive buffer per microbatch for each stage's input and output gradient; "
        "step(..., return_outputs=False) assumed (else the last stage keeps every microbatch's logits)",
        "loss computed after the last stage's forward (its fp32 log-probabilities are not offloaded)",
        f"our V orders built with search={mode!r}; step times from the orders of all m microbatches, "
        "or, past the planner's time budget, extrapolated from three sizes a whole steady-phase period "
        "apart after checking the phase is reached (pp_offload.plan.evaluate.simulation_sizes)",
    ]
    if dp > 1:
        notes.append(
            f"dp={dp}: gradient all-reduce after the pipeline, not overlapped"
            + ("; optimizer state sharded over dp" if dp_shard else "")
        )
    if not activation_is_modelled(spec.hidden_act):
        notes.append(f"activation {spec.hidden_act!r} assumed to save only its input")
    if spec.resid_dropout > 0 or spec.embd_dropout > 0:
        notes.append("dropout masks counted as 1 byte per element")
    return notes
