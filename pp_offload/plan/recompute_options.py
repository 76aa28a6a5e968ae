"""Activation recompute as `choose` weighs it: a probe's measurement rescaled as if its decoder layers were
recomputed (`RecomputeOption.apply`), and the planner's model of each plan as options (`recompute_options`).

Why a module of its own: the probe runs without recompute, so every recompute candidate of ``schedule: auto``
is the same measurement transformed by one option; how bytes and times scale per mode is independent of
how `pp_offload.plan.auto.choose` judges and ranks the candidates it then makes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from pp_offload.plan.probe import Measurement, StageMeasurement
from pp_offload.recompute_plan import RecomputePlan, parse_recompute, recomputations

__all__ = ["DEFAULT_RECOMPUTE", "RecomputeOption", "recompute_options"]

DEFAULT_RECOMPUTE = (
    "mlp",
    "selective:0.5",
    "selective:0.75",
    "selective:0.5,mlp",
    "selective:0.75,mlp",
    "selective",
    "full",
)
"""Recompute plans `recompute_options` offers by default (`pp_offload.recompute_plan`), from little
recompute to the most: MLP-only; selective on half or three quarters of each stage's layers, alone or
with the MLP-only recompute on the others (the MLP group frees 54% of selective's bytes for 25% of its
time, `pp_offload.plan.recompute_groups`, so the other layers give up much of their bytes for little);
every layer selective; full. No ``+once`` plans: under deferred weight gradients (the default of every
split-backward schedule, `pp_offload.runtime.deferred_w`) every plan recomputes once per microbatch, so a
``+once`` plan prices as the plan without it and would only double the candidates. Why the two-mode
plans: they fill the gaps between the one-mode steps,
e.g. Llama-3-8B, seq 4096, pp 4, m 8 on the H100 at half of 1F1B's memory: ``selective:0.75,mlp`` fits
where ``selective:0.75`` does not, 1.6% faster than ``selective`` (tests/test_auto.py)."""


@dataclass(frozen=True)
class RecomputeOption:
    """What recomputing decoder layers in backward changes in a measured stage.

    mode: ``"mlp"``, ``"selective"`` or ``"full"`` (`pp_offload.plan.memory.RECOMPUTE`).
    share: the share of each stage's layers recomputed, earliest first (`pp_offload.recompute_plan`); 1: all.
    kept_share: share of one layer's saved bytes that stays saved (in (0, 1]).
    forward_share: time one backward pass (I or W) spends recomputing one layer, as a share of the layer's
        forward: 1 for full recompute; for selective, the elementwise ops' HBM traffic over the layer's
        forward time (`recompute_options`). Used only where the measurement carries no measured recompute
        cost for the mode (`Measurement.recompute_costs`, see `apply`).

    rest, rest_kept_share, rest_forward_share: the mode of the other layers of each stage and its two
        shares, for a two-mode plan (``"selective:0.75,mlp"``: selective on the first three quarters, the
        MLP-only recompute on the rest); ``"none"`` (keep everything) by default.
    once: a ``+once`` plan (`pp_offload.runtime.recompute_once`): I recomputes and keeps what it recomputed
        for W, so W recomputes nothing and the freed bytes are back on the device from I to W.

    Why shares of bytes: the kept share scales the probe's own measured bytes per layer, so the same
    option serves any probe. Why the time is measured seconds where the probe measured them, and a share
    only otherwise: a share of "the layer's forward" needs that forward, and the probe's per-layer F (its
    stage's forward over its layers) also holds the stage's mask building, the activation store's capture
    hooks and the action bookkeeping, while the traffic model has no per-op cost at all (selective's
    dispatch mode over every op, the checkpoint hooks in the forward); on the CPU bench the shares priced
    full recompute at +65-74% of the step for +40-46% measured and selective at +5% for +25-40%
    (`pp_offload.plan.recompute_calibration`). The shares stay for `pp-offload plan`, which models an
    H100 run without a probe.
    """

    mode: str
    kept_share: float
    forward_share: float
    share: float = 1.0
    rest: str = "none"
    rest_kept_share: float = 1.0
    rest_forward_share: float = 0.0
    once: bool = False

    def __post_init__(self) -> None:
        if self.mode not in ("mlp", "selective", "full"):
            raise ValueError(f"RecomputeOption.mode must be 'mlp', 'selective' or 'full', got {self.mode!r}")
        RecomputePlan(self.mode, self.share, self.rest, self.once)  # checks the share and the pair of modes
        for name in ("kept_share", "rest_kept_share"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"RecomputeOption.{name} must be in (0, 1], got {getattr(self, name)!r}")
        for name in ("forward_share", "rest_forward_share"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"RecomputeOption.{name} must be >= 0, got {getattr(self, name)!r}")

    @property
    def label(self) -> str:
        """The plan string (``"selective:0.75"``, ``"selective:0.75,mlp"``): what
        ``train.activation_checkpointing`` applies."""
        return RecomputePlan(self.mode, self.share, self.rest, self.once).label

    def apply(self, measurement: Measurement) -> Measurement:
        """``measurement`` as if its decoder layers (the option's share of each stage's, earliest first)
        were recomputed: per stage, those layers' saved bytes
        scaled by ``kept_share`` (each layer's bytes taken as the smallest measured per layer: first and
        last stages carry the embedding, head and loss besides), copy times in proportion, and I and W
        each lengthened by one recompute of the stage's recomputed layers, as many times as the runtime
        recomputes in each (`pp_offload.recompute_plan.recomputations`, with the split the probe ran,
        ``measurement.deferred_w``): under deferred W I is the microbatch's one backward and pays a full
        backward's recomputation, W none; under torch's retained-graph split I and W recompute once each,
        stage 0's I and W come from one backward (its I is ~0), one recompute added to W, and a full
        backward B recomputes once (``recompute_shared``).

        Per recomputed layer of a mode, where ``measurement.recompute_costs`` measured the mode (the
        probe's calibration, `pp_offload.plan.recompute_calibration.ModeCost`): F grows by its measured
        ``forward`` (the checkpointing's own cost in the forward), a recomputing I by ``backward`` under
        deferred W; under torch's split I and W by their measured ``input`` and ``weight`` per
        recomputation, a full backward by ``backward`` (also stage 0's W, torch's whole backward there).
        Otherwise (a measurement without calibration, e.g. the planner's own): each
        recomputing pass grows by ``forward_share`` x a layer's forward, taken as the smallest measured
        per layer (stage F over its layers), and F is unchanged."""
        with_layers = [st for st in measurement.stages if st.layers > 0]
        if not with_layers:
            raise ValueError(
                "recompute candidates need each stage's decoder layer count (StageMeasurement.layers); "
                "the probe records it from the stage modules"
            )
        per_layer_bytes = min(st.saved_bytes / st.layers for st in with_layers)
        per_layer_forward = min(st.F / st.layers for st in with_layers)
        mine, rest = (
            self._layer_costs(measurement, mode, share, per_layer_forward)
            for mode, share in ((self.mode, self.forward_share), (self.rest, self.rest_forward_share))
        )
        stages = []
        plan = RecomputePlan(self.mode, self.share, self.rest, self.once)
        deferred = measurement.deferred_w
        for index, st in enumerate(measurement.stages):
            count = plan.count(st.layers)
            others = st.layers - count if self.rest != "none" else 0
            freed = count * (1.0 - self.kept_share) + others * (1.0 - self.rest_kept_share)
            saved = max(0, round(st.saved_bytes - per_layer_bytes * freed))
            ratio = saved / st.saved_bytes if st.saved_bytes else 1.0
            added = [count * a + others * b for a, b in zip(mine, rest, strict=True)]  # F, I, W, B
            layer_bytes, units = self._units(st, plan.modes(st.layers), per_layer_bytes)
            first = index == 0
            rule = {"first_stage": first, "once": self.once, "deferred_w": deferred}
            at_i, at_w, at_b = (recomputations(k, **rule) for k in ("I", "W", "B"))
            if deferred:  # I is the microbatch's one backward, so it pays a full backward's recomputation
                at_input, at_weight = added[3] * at_i, added[2] * at_w
            else:  # torch's split: I and W recompute each; its first stage runs its whole backward at W
                at_input, at_weight = added[1] * at_i, (added[3] if first else added[2]) * at_w
            # torch's split with +once: I keeps what it recomputed for W (not on torch's first stage)
            held = st.saved_bytes - saved if self.once and not first and not deferred else 0
            stages.append(
                replace(
                    st,
                    F=st.F + added[0],
                    I=st.I + at_input,
                    W=st.W + at_weight,
                    recompute_shared=st.recompute_shared + max(0.0, at_input + at_weight - added[3] * at_b),
                    saved_bytes=saved,
                    held_after_input=held,  # deferred W: I releases the graph, +once keeps nothing for W
                    offload=st.offload * ratio,
                    reload=st.reload * ratio,
                    layer_bytes=layer_bytes,
                    units=units,
                )
            )
        return replace(measurement, stages=tuple(stages))

    @staticmethod
    def _layer_costs(
        measurement: Measurement, mode: str, forward_share: float, per_layer_forward: float
    ) -> tuple[float, float, float, float]:
        """Seconds one layer in ``mode`` adds to its forward, and to an I, a W and a B pass that recompute
        it once: measured where the probe calibrated the mode, else the share of the layer's forward
        (`apply`)."""
        if mode == "none":
            return 0.0, 0.0, 0.0, 0.0
        calibration = measurement.recompute_costs
        cost = calibration.cost(mode) if calibration is not None else None
        if cost is not None:
            return cost.forward, cost.input, cost.weight, cost.backward
        once = per_layer_forward * forward_share
        return 0.0, once, once, once

    def _units(
        self, st: StageMeasurement, modes: list[str], per_layer_bytes: float
    ) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
        """The stage's measured per-layer and per-unit bytes under the plan's per-layer ``modes``, as the
        runtime then captures them (`pp_offload.plan.memory.layer_unit_bytes` says the same): a layer
        checkpointed whole (full, selective) is one unit of what it keeps; ``mlp`` frees its bytes from
        the second unit (the MLP's); ``none`` keeps both."""
        if not st.units:
            return st.layer_bytes, st.units
        kept = {self.mode: self.kept_share, self.rest: self.rest_kept_share, "none": 1.0}
        layer_bytes, units = [], []
        for whole, parts, mode in zip(st.layer_bytes, st.units, modes, strict=True):
            freed = per_layer_bytes * (1.0 - kept[mode])
            left = max(0, round(whole - freed))
            layer_bytes.append(left)
            if mode in ("full", "selective"):
                units.append((left,))
            elif mode == "mlp":
                units.append((*parts[:-1], max(0, round(parts[-1] - freed))))
            else:
                units.append(parts)
        return tuple(layer_bytes), tuple(units)


def recompute_options(
    model: Any,
    *,
    seq_len: int,
    microbatch_size: int = 1,
    machine: Any = "H100",
    dtype: str = "bf16",
    modes: Sequence[str] = DEFAULT_RECOMPUTE,
) -> list[RecomputeOption]:
    """The planner's recompute model (`pp_offload.plan.memory`, `pp_offload.plan.costs`) as options for
    `choose`: per plan (a mode, a mode on a share of each stage's layers, or that with a second mode on the
    others: `pp_offload.recompute_plan`; default `DEFAULT_RECOMPUTE`),
    the kept share of a recomputed layer's saved bytes and the recompute time per backward pass as a share
    of the layer's forward, for ``model`` (anything `pp_offload.plan.model.model_spec` reads) on
    ``machine`` (a preset name or `pp_offload.plan.Machine`)."""
    from pp_offload.plan.costs import recompute_seconds, stage_times
    from pp_offload.plan.machines import resolve_machine
    from pp_offload.plan.memory import layer_activation_bytes
    from pp_offload.plan.model import model_spec

    spec, mach = model_spec(model), resolve_machine(machine)
    kw = {"microbatch_size": microbatch_size, "seq_len": seq_len}
    plain = layer_activation_bytes(spec, dtype, **kw)
    forward = stage_times(spec, mach, dtype, layers=1, first=False, last=False, **kw).F

    def shares(mode: str) -> tuple[float, float]:
        if mode == "none":
            return 1.0, 0.0
        kept = layer_activation_bytes(spec, dtype, recompute=mode, **kw) / plain
        return kept, recompute_seconds(spec, mach, dtype, recompute=mode, **kw) / forward

    out = []
    for label in modes:
        plan = parse_recompute(label)
        if plan.mode == "none":
            continue
        kept, seconds = shares(plan.mode)
        rest_kept, rest_seconds = shares(plan.rest)
        out.append(
            RecomputeOption(
                plan.mode, kept, seconds, plan.share, plan.rest, rest_kept, rest_seconds, once=plan.once
            )
        )
    return out
