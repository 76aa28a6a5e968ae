"""Which decoder layers of a stage recompute their activations in backward, and how: one plan string shared
by the planner, ``pp-offload plan --recompute``, the recipe's ``train.activation_checkpointing`` and the
runtime's `pp_offload.parallel.activation_checkpointing`.

A plan is a mode (``none``, ``selective``, ``full``), optionally with the share of each stage's layers it
applies to: ``"selective:0.75"`` recomputes (selectively) the first ``ceil(0.75 x n)`` of a stage's ``n``
decoder layers and leaves the others keeping everything. Why a share: recompute is all or nothing per layer,
so recomputing every layer is the only other step between no recompute and the next mode; a share buys
memory in steps of one layer per stage, at the recompute time of just those layers (e.g. Llama-3-8B on an
H100 at seq 4096: selective recompute of every layer costs +11.5% step time; three layers of four cost
three quarters of it). Why the earliest layers: within a chunk, the earliest layers' tensors are the last
ones its backward frees, so they are held longest; and the budget offload policies move a chunk's earliest
layers first, so a mixed stage offloads its smaller (recomputed) layers first, which is what the planner
models (`pp_offload.plan.evaluate`).

Pure Python: the planner imports it without torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "MODES",
    "PASSES",
    "RECOMPUTE_FORMS",
    "RecomputeForm",
    "RecomputePlan",
    "parse_recompute",
    "recompute_examples",
    "recomputations",
]

MODES = ("none", "mlp", "selective", "full")
"""Per-layer modes, least recompute first: keep everything; selective recompute of the MLP block only (keep
its matmul outputs, recompute its activation function and gated product: the ops that free the most bytes
per byte of HBM traffic they cost); keep matmul and attention outputs and recompute the elementwise ops
of the whole layer (`pp_offload.runtime.recompute`); keep only the layer input and recompute the whole
layer."""


PASSES = ("F", "I", "W", "B")
"""A stage's passes for one microbatch: forward, input-gradient, weight-gradient, full backward."""


def recomputations(
    kind: str, *, first_stage: bool = False, once: bool = False, deferred_w: bool = True
) -> int:
    """How many times one pass of ``kind`` re-runs each recomputed layer of its stage, for one microbatch.

    The one rule the runtime follows and the planner charges (``tests/test_recompute_counts.py`` counts the
    runtime's recomputations against it). With deferred W (``deferred_w``, the default of every
    split-backward schedule pp-offload runs: `pp_offload.runtime.deferred_w`), I is one ordinary backward
    and W runs only the queued weight-gradient GEMMs:

    - ``F`` runs the forward, nothing recomputed; ``I`` and ``B`` recompute once; ``W`` recomputes nothing.

    So a recomputed layer runs twice per microbatch (F, I or F, B) on every stage, with or without ``once``
    (``+once`` is no longer needed; it is still accepted and changes nothing).

    Under torch's retained-graph split (``deferred_w=False``): ``I`` and ``W`` are separate autograd calls
    and each recomputes once (W's per-parameter-group calls share one recomputation:
    `pp_offload.runtime.compat.share_weight_pass_recomputation`), torch's first stage (``first_stage``)
    does nothing at I and runs its whole backward at W (0 at I, 1 at W): 3 runs per microbatch. ``once``
    (`pp_offload.runtime.recompute_once`) keeps I's recomputation for W there (0 at W but on the first
    stage): 2 runs."""
    if kind not in PASSES:
        raise ValueError(f"pass kind must be one of {', '.join(PASSES)}, got {kind!r}")
    if kind == "F":
        return 0
    if deferred_w:
        return 0 if kind == "W" else 1
    if kind == "I" and first_stage:
        return 0
    if kind == "W" and once and not first_stage:
        return 0
    return 1


@dataclass(frozen=True)
class RecomputeForm:
    """One way to write a recompute plan: ``form`` (``<x>`` marks a number or a mode), an ``example`` that
    `parse_recompute` reads, what it does, and when the planner (``pp-offload plan``, ``schedule: auto``)
    picks it."""

    form: str
    example: str
    meaning: str
    picked: str


RECOMPUTE_FORMS: tuple[RecomputeForm, ...] = (
    RecomputeForm(
        "none",
        "none",
        "No recompute: each layer keeps what autograd saves (`false` in the recipe).",
        "Whenever the fastest candidate fits without recompute (recompute only costs time).",
    ),
    RecomputeForm(
        "mlp",
        "mlp",
        "Each layer's MLP keeps its matmul outputs and recomputes its activation function and "
        "gated product: the op group that frees the most bytes per byte of recompute traffic.",
        "The cheapest recompute: when it is enough to fit.",
    ),
    RecomputeForm(
        "selective",
        "selective",
        "Each layer keeps its matmul and attention outputs and recomputes norms, "
        "rotary, activation functions and products.",
        "When the MLP-only and the two-mode plans free too little and full recompute costs more.",
    ),
    RecomputeForm(
        "full",
        "full",
        "Each layer keeps only its input and recomputes its whole forward (`true` in the recipe).",
        "Only when nothing lighter fits.",
    ),
    RecomputeForm(
        "<mode>:<share>",
        "selective:0.75",
        "The mode on the first `ceil(share x n)` of each stage's `n` "
        "layers (share in (0, 1]); the others keep everything.",
        "When recomputing part of each stage's layers is enough: one step of a layer per stage between "
        "none and every layer.",
    ),
    RecomputeForm(
        "<mode>:<share>,<mode>",
        "selective:0.75,mlp",
        "The first mode on that share of each stage's layers, the second on the others.",
        "When the gap between `mlp` and `selective` on every layer is where the fastest fit lies.",
    ),
    RecomputeForm(
        "<plan>+once",
        "selective+once",
        "Accepted, no longer needed: with deferred weight gradients (the default of every split-backward "
        "schedule) every plan recomputes once per microbatch. Under torch's retained-graph split "
        "(pipeline.deferred_w: false) the input-gradient pass keeps what it recomputed for the weight pass "
        "instead of each pass recomputing.",
        "Not by default: under deferred W it prices as the same plan without +once; the pickers weigh it "
        "only when listed.",
    ),
)
"""Every form `parse_recompute` reads, in one place: its error message lists them, and the recipe's config
reference (`pp_offload.recipe.config_doc`) renders them as the table of recompute plans."""


def recompute_examples() -> tuple[str, ...]:
    """Every form `parse_recompute` reads, one plan string each (`RECOMPUTE_FORMS`' examples), and each
    mode alone: what tests walking the catalog (``--check`` on every plan) enumerate."""
    return tuple(dict.fromkeys([*MODES, *(f.example for f in RECOMPUTE_FORMS)]))


@dataclass(frozen=True)
class RecomputePlan:
    """``mode`` on the first ``share`` of every stage's decoder layers (module doc), ``rest`` on the others
    (``"selective:0.75,mlp"``: MLP-only recompute on the last quarter); ``share`` in (0, 1]."""

    mode: str
    share: float = 1.0
    rest: str = "none"
    once: bool = False
    """Recompute once per microbatch under split backward, keeping I's recomputed tensors for W
    (`recomputations`, `pp_offload.runtime.recompute_once`)."""

    def __post_init__(self) -> None:
        for mode in (self.mode, self.rest):
            if mode not in MODES:
                raise ValueError(f"unknown recompute mode {mode!r}; use one of {', '.join(map(repr, MODES))}")
        if (
            isinstance(self.share, bool)
            or not isinstance(self.share, (int, float))
            or not 0 < self.share <= 1
        ):
            raise ValueError(f"the recompute share must be a number in (0, 1], got {self.share!r}")
        if self.rest != "none" and (self.share == 1 or self.rest == self.mode or self.mode == "none"):
            raise ValueError(
                f"recompute {self.mode}:{self.share:g},{self.rest}: a mode for the other layers needs a "
                "share below 1 and a first mode other than it and than 'none'"
            )
        if self.once and self.mode == "none":
            raise ValueError("recompute none+once: '+once' applies to a plan that recomputes; drop it")

    @property
    def uniform(self) -> bool:
        """Every layer in one mode."""
        return self.mode == "none" or self.share == 1

    @property
    def label(self) -> str:
        """The plan as a string `parse_recompute` reads back: ``"selective"``, ``"selective:0.75"``,
        ``"selective:0.75,mlp"``."""
        once = "+once" if self.once else ""
        if self.uniform:
            return self.mode + once
        return f"{self.mode}:{self.share:g}" + (f",{self.rest}" if self.rest != "none" else "") + once

    def count(self, layers: int) -> int:
        """How many of a stage's ``layers`` decoder layers get ``mode``: the first ``ceil(share x layers)``
        (0 without recompute)."""
        if self.mode == "none" or layers <= 0:
            return 0
        return min(layers, math.ceil(self.share * layers - 1e-9))

    def modes(self, layers: int) -> list[str]:
        """The mode of each of a stage's ``layers`` layers, first layer first."""
        k = self.count(layers)
        return [self.mode] * k + [self.rest] * (layers - k)


def parse_recompute(value: str | RecomputePlan) -> RecomputePlan:
    """``"none"``, ``"mlp"``, ``"selective"``, ``"full"``, one of the last three with a share,
    ``"selective:0.75"``, and another mode for the other layers after a comma, ``"selective:0.75,mlp"``;
    any of them but ``none`` with ``+once``. ValueError naming the forms otherwise."""
    if isinstance(value, RecomputePlan):
        return value
    text = str(value).strip().lower()
    base, plus, suffix = text.partition("+")
    if plus:
        if suffix.strip() != "once":
            raise ValueError(
                f"recompute {value!r}: the only modifier after '+' is 'once' ('selective+once'), got "
                f"{suffix.strip()!r}"
            )
        plan = parse_recompute(base)
        return RecomputePlan(plan.mode, plan.share, plan.rest, once=True)  # refuses none+once
    text, comma, rest = text.partition(",")
    if comma:
        first = parse_recompute(text)
        return RecomputePlan(first.mode, first.share, rest.strip())
    mode, sep, share = text.partition(":")
    if mode not in MODES or (sep and mode == "none"):
        raise ValueError(
            f"unknown recompute mode {value!r}; use one of "
            + ", ".join(f"'{f.form}'" for f in RECOMPUTE_FORMS)
            + " (e.g. 'selective:0.75' for the first three quarters of each stage's layers, "
            "'selective:0.75,mlp' for another mode on the others; 'mlp': recompute the MLP's activation and "
            "product, 'selective': every elementwise op, 'full': the whole layer; '+once' after any of them: "
            "recompute once per microbatch under split backward)"
        )
    if not sep:
        return RecomputePlan(mode)
    try:
        number = float(share)
    except ValueError:
        raise ValueError(f"recompute {value!r}: the share after ':' must be a number in (0, 1]") from None
    return RecomputePlan(mode, number)
