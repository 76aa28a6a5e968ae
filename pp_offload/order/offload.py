"""Activation offload planning (PipeOffload): which chunks go to host memory, and when they come back.

Why this exists: even V-Min keeps several microbatches' activations on every rank, and the number grows
with pipeline depth. Between a chunk's forward and its backward those activations are dead weight on the
device; PipeOffload copies them to host memory right after the forward (OFFLOAD) and back shortly before
the backward (RELOAD), on copy lanes that run beside compute. When the copies hide behind compute the
device keeps only a few chunks whatever the depth; when they can't (slow host link, short chunks), a
share of the chunks is offloaded, chosen to lower the peak most (the longest-lived first where that
decides), which can cut the peak more than linearly in the offloaded share.

This module is pure Python: it takes any compute order (ours or torch's ``pipeline_order``), simulates it
with `pp_offload.sim.simulate`, and inserts ``OFFLOAD``/``RELOAD`` actions:

- ``OFFLOAD(s, j)`` right after ``F(s, j)`` on its rank (the copy starts when the forward has ended);
- ``RELOAD(s, j)`` before the chunk's first backward pass (``I`` or ``B``; stage 0's ``I`` included,
  since both I and W unpack saved tensors and the reloaded copy must live until W), at the latest
  position where the simulated reload still ends ``reload_margin`` backward passes (one, by default)
  before that backward starts, and at least one compute pass before it when the chunk's window allows.
  Positions are then checked by a replay with the copy lanes and moved earlier where a queued copy
  would end too late.

A transfer is *issued* where it sits: when the compute pass before it ends (see `pp_offload.sim`).

Budgeted, layer-granular offload (``mode="budget"``): whole chunks are all or nothing, and at real model
sizes (a transfer/compute ratio k of 4-7 on PCIe hosts) no whole chunk fits its forward-to-backward
window, so nothing moves. A budget moves part of *every* chunk: its earliest layers (their backward comes
last), each layer's copy starting as soon as that layer's forward has produced its tensors, and reloaded
last layer first so the chunk's own backward of its later layers hides part of the reload (the
simulator's ``layered`` model, `pp_offload.sim.LayeredChunk`; the runtime does the same from hooks on
the stage's layers). ``fraction`` fixes the share of each chunk's layers; without it (``"budget"``) each
chunk moves as many layers as its window hides with idle copy lanes, under a cap on layers per chunk
raised as long as the replayed step stays within ``max_slowdown`` of the order without offload.

Entry points: `resolve_offload` (parse the user's ``offload=`` argument into an `OffloadPolicy`) and
`plan_offload` (policy + order + costs -> `OffloadPlan`). `transfer_compute_ratio`, `auto_offload` and
`auto_from_measurements` give the ``auto`` mode its ratio ``k``.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from pp_offload.order.actions import OFFLOAD, RELOAD, Action, B, Costs, F, I, W
from pp_offload.sim import LayeredChunk, SimResult, flatten, simulate

__all__ = [
    "OFFLOAD_FORMS",
    "offload_examples",
    "OffloadForm",
    "OffloadPlan",
    "OffloadPolicy",
    "auto_from_measurements",
    "auto_offload",
    "plan_offload",
    "resolve_offload",
    "transfer_compute_ratio",
]

MODES = ("none", "full", "selective", "auto", "budget")
GRANULARITIES = ("layer", "sublayer")
LANES = ("duplex", "shared")
CHOICES = ("peak", "lifespan")
_DEFAULT_SELECTIVE_FRACTION = 0.5
_DEFAULT_MAX_SLOWDOWN = 0.03
_CLOSE_W = "close-w"
_SUBLAYER = "sublayer"
_REFINE_ROUNDS = 32
_EPS = 1e-9


@dataclass(frozen=True)
class OffloadForm:
    """One way to write an offload policy as a string: ``form`` (``<x>`` marks a number), an ``example``
    that `resolve_offload` reads, what it does, and when the planner (``pp-offload plan``, ``schedule:
    auto``) picks it: the recipe's config reference (`pp_offload.recipe.config_doc`) prints each line."""

    form: str
    example: str
    meaning: str
    picked: str


OFFLOAD_FORMS: tuple[OffloadForm, ...] = (
    OffloadForm(
        "none",
        "none",
        "No offload (also `null` or `false`).",
        "Whenever the fastest candidate fits without offload (offload never makes an order faster).",
    ),
    OffloadForm(
        "full",
        "full",
        "Every chunk (one stage's activations of one microbatch) goes to host memory.",
        "When moving every chunk is the fastest way to fit: copies that hide behind compute (a fast host "
        "link, long sequences).",
    ),
    OffloadForm(
        "selective",
        "selective",
        f"A share of each rank's chunks ({_DEFAULT_SELECTIVE_FRACTION:g}), the ones "
        "that lower the activation peak most.",
        f"As `selective:{_DEFAULT_SELECTIVE_FRACTION:g}`.",
    ),
    OffloadForm(
        "selective:<fraction>",
        "selective:0.25",
        "That share of each rank's chunks, in [0, 1].",
        "When that share of the chunks is enough to fit and hides better than moving them all.",
    ),
    OffloadForm(
        "auto",
        "auto",
        "A share of the chunks from the ratio k of copy time to compute time: min(1, 1/k) "
        "(PipeOffload's analysis).",
        "Never: the planner models the copy to compute ratio itself and compares explicit policies.",
    ),
    OffloadForm(
        "budget",
        "budget",
        "Layer by layer: as many of each chunk's earliest decoder layers as hide within "
        f"{100 * _DEFAULT_MAX_SLOWDOWN:g}% step time.",
        "When moving layers that hide (almost) for free fits where no offload does not, and costs less "
        "than whole chunks.",
    ),
    OffloadForm(
        "budget:<fraction>",
        "budget:0.5",
        "That share of each offloaded chunk's layers.",
        "Only when given (`pp-offload plan --offload`): a fixed share, not what hides.",
    ),
    OffloadForm(
        "budget:auto:<max slowdown>",
        "budget:auto:0.1",
        "As many layers as fit within that step-time slowdown (0.1: 10%).",
        "When the 3% budget does not free enough and a slower step within that slowdown is the fastest "
        "candidate that fits.",
    ),
    OffloadForm(
        "budget:close-w",
        "budget:close-w",
        "`budget`, also on offload-aware orders: W passes moved right "
        "after their I where that lets more layers move (zero-bubble schedules).",
        "On split-backward schedules, when pulling a W next to its I lets enough more layers move to fit.",
    ),
    OffloadForm(
        "budget:auto:<max slowdown>:close-w",
        "budget:auto:0.1:close-w",
        "The same within that slowdown.",
        "Only when given: `budget:close-w` within a larger slowdown.",
    ),
    OffloadForm(
        "<any budget form>:sublayer",
        "budget:sublayer",
        "Units of half a layer (its attention part, then "
        "the rest) instead of whole layers, e.g. `budget:auto:0.1:sublayer`.",
        "When a whole layer's copy outlasts the compute it could hide behind and half layers hide where "
        "layers cannot (`schedule: auto` judges it where the probe measured the units).",
    ),
)
"""Every string form `resolve_offload` reads, in one place: its error message lists them, and the recipe's
config reference (`pp_offload.recipe.config_doc`) renders them as the table of offload policies."""


def offload_examples() -> tuple[str, ...]:
    """Every shape of policy `resolve_offload` reads, one string each: each form's example, and the
    sub-layer modifier on every budget form (``budget:0.5:sublayer``, ``budget:close-w:sublayer``...).
    Why: tests that walk the catalog (``--check`` on every policy and schedule) stay complete when a form
    is added here."""
    examples = [f.example for f in OFFLOAD_FORMS]
    budget = [e for e in examples if e.startswith("budget") and _SUBLAYER not in e]
    return tuple(dict.fromkeys(examples + [f"{e}:{_SUBLAYER}" for e in budget]))


def _forms(*, budget: bool = False) -> str:
    names = [f.form for f in OFFLOAD_FORMS if "budget" in f.form or not budget]
    return ", ".join(f"'{name}'" for name in names)


@dataclass(frozen=True)
class OffloadPolicy:
    """Which chunks (one stage's activations of one microbatch) to offload, and how reloads are timed.

    mode:
        ``"none"`` keeps everything on the device; ``"full"`` offloads every chunk that gains from it;
        ``"selective"`` offloads a share of each rank's chunks (see ``choose``); ``"auto"`` picks the
        share from the transfer/compute ratio ``k`` (see `auto_offload`); ``"budget"`` moves part of
        every chunk, layer by layer (module doc).
    fraction:
        selective (or resolved auto): share of each rank's chunks to offload, in [0, 1], rounded to the
        nearest count. Selective without ``fraction`` or ``count`` means 0.5. Budget: share of each
        chunk's layers to move (rounded to the nearest layer, earliest layers first; never more than the
        chunk's forward-to-backward window hides with idle copy lanes, so a chunk whose backward follows
        its forward moves nothing); None: as many as each chunk's window hides, within ``max_slowdown``.
    max_slowdown:
        budget without ``fraction``: the largest predicted step-time increase (relative, 0.03 = 3%) the
        cap on moved layers per chunk may cost.
    drop_after_i:
        orders with split backward: a chunk whose W runs well after its I leaves the device again in
        between (W still needs its saved tensors; their host copy is exact, so this OFFLOAD copies
        nothing) and is reloaded before W, where the gap is longer than the reload. Zero-bubble orders,
        and the V orders' cool-down (input gradients first, weight passes at the end), keep every chunk
        from I to W; this is what lets offload reach that span. Whole-chunk modes keep it only where it
        lowers the peak without slowing the replayed step (its second reloads share the host-to-device
        lane with the first ones); budget mode weighs it in its own search.
    granularity:
        budget: the offload unit. ``"layer"``: whole decoder layers. ``"sublayer"``: each layer splits at
        the return of its attention submodule into two units, the attention half (everything the layer
        saves up to and including its attention) and the rest (post-attention norm, MLP), so the first
        unit a chunk moves costs a fraction of a layer's copy; a layer without one attention child, or
        checkpointed as a whole (full or selective recompute), stays one unit. The caller gives
        ``plan_offload`` the stages' units (``layers``, ``layer_copy``, ``unit_compute``): the planner's
        `pp_offload.plan.evaluate.Setup.offload_inputs` and the runtime's ``enable_offload`` build them.
    close_w:
        budget without ``fraction``, orders with split backward: also try offload-aware versions of the
        order, with the held-back W passes moved right after their I (rank by rank), and keep the one
        whose budget plan peaks lowest within ``max_slowdown`` of the order as given
        (`pp_offload.order.zb_offload`). The plan's ``order`` is then that order; ``pulled`` names the
        chunks whose W moved.
    count:
        selective: number of chunks per rank to offload, instead of a fraction.
    choose:
        how a partial share is picked. ``"peak"`` (default): the fewest chunks that bring the rank's
        device-resident peak lowest (in the compute-only timeline; where several can cover a peak, the
        one staying off the device longest, i.e. the longest-lived), then the longest-lived for the
        rest of the share. ``"lifespan"``: the papers' plain rule, longest lifespans first (equal ones
        spread evenly over time); it matches ``"peak"`` on a uniform repeating schedule but can leave
        the peak untouched on compacted or interleaved orders, whose lifespans vary by a pass or two.
    min_lifespan:
        skip chunks whose lifespan (F start to W/B end, in cost units, as simulated) is shorter than
        this: they would be back on the device almost as soon as they left it. ``None``: twice a round
        trip, i.e. ``2 * (offload + reload)`` = ``4 * costs.transfer`` per chunk. Chunks whose window
        from F end to their first backward can't hold an offload and a reload are always skipped.
    reload_margin:
        how early a RELOAD must end, in durations of the backward pass that needs it (the paper: one,
        so a copy running a little slow does not stall compute; 0 = just in time). Ignored when
        ``reload_lead`` is set.
    reload_lead:
        issue each RELOAD this many compute passes before the chunk's first backward (0 = right before
        it). ``None``: the latest position whose reload, in the simulated timeline with the copy lanes,
        ends ``reload_margin`` backward passes before that backward, and at least one pass before it
        when the chunk's window allows.
    lanes:
        ``"duplex"``: one copy lane per direction (device->host and host->device at once, as two CUDA
        copy streams on a full-duplex link); ``"shared"``: one lane for both directions.
    k:
        auto: the ratio ``k`` = (D2H + H2D time) / (F + I + W time) of one chunk the share was derived
        from; ``None`` until resolved (`plan_offload` then derives it from ``costs``).
    """

    mode: str = "none"
    fraction: float | None = None
    count: int | None = None
    choose: str = "peak"
    min_lifespan: float | None = None
    reload_margin: float = 1.0
    reload_lead: int | None = None
    lanes: str = "duplex"
    k: float | None = None
    max_slowdown: float = _DEFAULT_MAX_SLOWDOWN
    drop_after_i: bool = True
    close_w: bool = False
    granularity: str = "layer"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(
                f"unknown offload mode {self.mode!r}; use one of {', '.join(map(repr, MODES))} "
                f"(or 'selective:0.25', or a fraction like 0.25)"
            )
        if self.lanes not in LANES:
            raise ValueError(
                f"offload lanes must be 'duplex' (one copy lane per direction) or 'shared' (one lane), "
                f"got {self.lanes!r}"
            )
        if self.choose not in CHOICES:
            raise ValueError(
                f"offload choose must be 'peak' (lower the peak first) or 'lifespan' (longest-lived "
                f"first), got {self.choose!r}"
            )
        if self.fraction is not None:
            if not _is_real(self.fraction) or not 0.0 <= self.fraction <= 1.0:
                raise ValueError(
                    f"offload fraction must be a number in [0, 1] (the share of each rank's chunks to "
                    f"offload), got {self.fraction!r}; use 0 for none and 1 for all"
                )
            object.__setattr__(self, "fraction", float(self.fraction))
        if self.count is not None and not _is_count(self.count):
            raise ValueError(
                f"offload count must be an integer >= 0 (chunks per rank to offload), got {self.count!r}"
            )
        if self.fraction is not None and self.count is not None:
            raise ValueError(
                f"give either an offload fraction or a count, not both (fraction={self.fraction}, "
                f"count={self.count})"
            )
        if self.mode in ("none", "full") and (self.fraction is not None or self.count is not None):
            raise ValueError(
                f"offload mode {self.mode!r} takes no fraction or count (got fraction={self.fraction}, "
                f"count={self.count}); use mode='selective' to offload a share of the chunks"
            )
        if self.mode == "budget" and self.count is not None:
            raise ValueError(
                f"offload mode 'budget' moves a share of each chunk's layers: give a fraction, not a count "
                f"(got count={self.count})"
            )
        if self.granularity not in GRANULARITIES:
            raise ValueError(
                f"offload granularity must be 'layer' (whole decoder layers) or 'sublayer' (attention half, "
                f"then the rest, of each layer), got {self.granularity!r}"
            )
        if self.granularity != "layer" and self.mode != "budget":
            raise ValueError(
                f"granularity={self.granularity!r} sets budget offload's unit; mode {self.mode!r} moves "
                "whole chunks: use mode='budget' (e.g. 'budget:sublayer')"
            )
        if not isinstance(self.drop_after_i, bool):
            raise ValueError(f"drop_after_i must be True or False, got {self.drop_after_i!r}")
        if not isinstance(self.close_w, bool):
            raise ValueError(f"close_w must be True or False, got {self.close_w!r}")
        if self.close_w and (self.mode != "budget" or self.fraction is not None):
            raise ValueError(
                "close_w (W passes moved next to their I) trades step time within max_slowdown: use "
                f"it with offload mode 'budget' without a fraction (e.g. 'budget:close-w'), not mode="
                f"{self.mode!r}, fraction={self.fraction!r}"
            )
        if not _is_real(self.max_slowdown) or not 0 <= self.max_slowdown < math.inf:
            raise ValueError(
                f"max_slowdown must be a finite number >= 0 (relative step-time increase, 0.03 = 3%), "
                f"got {self.max_slowdown!r}"
            )
        if self.mode == "selective" and self.fraction is None and self.count is None:
            object.__setattr__(self, "fraction", _DEFAULT_SELECTIVE_FRACTION)
        if self.k is not None:
            if self.mode != "auto":
                raise ValueError(f"k (the transfer/compute ratio) belongs to mode='auto', not {self.mode!r}")
            if not _is_real(self.k) or not self.k >= 0 or math.isinf(self.k):
                raise ValueError(f"the transfer/compute ratio k must be a finite number >= 0, got {self.k!r}")
        if self.mode == "auto":
            if self.count is not None:
                raise ValueError(
                    "offload mode 'auto' derives the share from k; use mode='selective' to give a count"
                )
            if (self.fraction is None) != (self.k is None):
                raise ValueError(
                    "offload mode 'auto' derives the fraction from k: give neither (k then comes from the "
                    "costs) or build it with auto_offload(k); use mode='selective' for a fixed fraction"
                )
        if self.min_lifespan is not None and (not _is_real(self.min_lifespan) or not self.min_lifespan >= 0):
            raise ValueError(f"min_lifespan must be a number >= 0 (cost units), got {self.min_lifespan!r}")
        if not _is_real(self.reload_margin) or not 0 <= self.reload_margin < math.inf:
            raise ValueError(
                f"reload_margin must be a number >= 0 (backward passes between a reload's end and the "
                f"backward that needs it), got {self.reload_margin!r}"
            )
        if self.reload_lead is not None and not _is_count(self.reload_lead):
            raise ValueError(
                f"reload_lead must be an integer >= 0 (compute passes between a RELOAD and the backward "
                f"that needs it) or None to place it from the timeline, got {self.reload_lead!r}"
            )

    @property
    def enabled(self) -> bool:
        """Whether this policy may offload anything at all."""
        if self.mode == "none":
            return False
        if self.count is not None:
            return self.count > 0
        return self.fraction is None or self.fraction > 0

    def resolved(self, costs: Costs | Mapping[str, float] | None = None) -> OffloadPolicy:
        """This policy with ``auto`` turned into a share, from ``k`` derived from ``costs`` when unset.

        From costs, ``k = 2 * transfer / (F + I + W)``: a chunk's two copies over its compute (unit
        costs with ``transfer=0.5`` give k = 1/3).
        """
        if self.mode != "auto" or self.k is not None:
            return self
        c = Costs.coerce(costs)
        return auto_offload(2.0 * c.transfer / (c.F + c.I + c.W), **_tuning(self))


@dataclass
class OffloadPlan:
    """An order with OFFLOAD/RELOAD inserted, and what was chosen.

    order: rank -> actions (`pp_offload.order.Action`, compute passes in the input's order, torch
    actions converted, ``None`` slots and OVERLAP_F_B wrappers flattened) with ``OFFLOAD``/``RELOAD``.
    offloaded: rank -> (stage, microbatch) chunks offloaded, in the order they were chosen.
    policy: the policy used (auto resolved, with its ``k``).
    sim: the replay of ``order`` with the planning costs and the policy's lanes.
    layered: budget mode: (stage, microbatch) -> how many of its layers move (`pp_offload.sim.LayeredChunk`);
        empty for whole-chunk policies. Pass it to `pp_offload.sim.simulate` to replay ``order``
        (or use `replay`).
    pulled: ``close_w``: rank -> (stage, microbatch) chunks whose W the plan's ``order`` runs right after
        their I instead of where the input order had it (`pp_offload.order.zb_offload`); empty otherwise.
    """

    order: dict[int, list[Action]]
    offloaded: dict[int, list[tuple[int, int]]]
    policy: OffloadPolicy
    sim: SimResult | None = field(default=None, repr=False)
    layered: dict[tuple[int, int], LayeredChunk] = field(default_factory=dict, repr=False)
    pulled: dict[int, list[tuple[int, int]]] = field(default_factory=dict)

    def replay(self, costs: Costs | Mapping[str, float] | None = None, **changes: Any) -> SimResult:
        """Simulate this plan's order again (other ``costs``, e.g. per-stage), as the runtime runs it.
        ``changes``: `dataclasses.replace` the layered chunks' fields (``layer_copy=0.0``)."""
        layered = self.layered
        if changes:
            layered = {k: replace(v, **changes) for k, v in layered.items()}
        return simulate(self.order, costs, copy_lanes=self.policy.lanes, layered=layered)

    def moved_layers(self, rank: int) -> dict[tuple[int, int], int]:
        """Budget mode: layers moved per chunk of ``rank`` (0 for chunks of whole-chunk policies)."""
        return {
            key: self.layered[key].moved if key in self.layered else 0 for key in self.offloaded.get(rank, ())
        }


def resolve_offload(value: Any) -> OffloadPolicy:
    """Parse a user's ``offload=`` argument.

    Accepts ``None``/``False``/``"none"``, ``True``/``"full"``, ``"selective"`` (half the chunks),
    ``"selective:0.25"``, ``"auto"``, ``"budget"`` (layer by layer, within 3% step time),
    ``"budget:0.5"`` (half of each chunk's layers), ``"budget:auto:0.1"`` (within 10%), ``"budget:close-w"``
    or ``"budget:auto:0.1:close-w"`` (also offload-aware orders: ``close_w``), any budget form followed by
    ``":sublayer"`` (units of half a layer: ``granularity``, e.g. ``"budget:sublayer"``), a float fraction
    in [0, 1] (selective), a dict of `OffloadPolicy` fields (``{"mode": "selective", "count": 2}``;
    ``mode`` defaults to selective when a fraction or count is given) or an `OffloadPolicy`.
    """
    if isinstance(value, OffloadPolicy):
        return value
    if value is None or value is False:
        return OffloadPolicy("none")
    if value is True:
        return OffloadPolicy("full")
    if isinstance(value, str):
        text = value.strip().lower()
        if text in MODES:
            return OffloadPolicy(text)
        head, sep, tail = text.partition(":")
        if sep and head.strip() == "budget":
            return _parse_budget(value, tail.strip())
        if sep and head.strip() == "selective":
            try:
                fraction = float(tail)
            except ValueError:
                raise ValueError(
                    f"cannot read the fraction in offload={value!r}; write e.g. 'selective:0.25'"
                ) from None
            return OffloadPolicy("selective", fraction=fraction)
        raise ValueError(f"unknown offload setting {value!r}; use one of {_forms()}")
    if isinstance(value, int) and not isinstance(value, bool):
        raise TypeError(
            f"offload={value!r} is ambiguous: pass a float fraction of each rank's chunks (e.g. 0.5) or a "
            f"count as {{'mode': 'selective', 'count': {value}}}"
        )
    if isinstance(value, float):
        return OffloadPolicy("selective", fraction=value)
    if isinstance(value, Mapping):
        names = {f.name for f in fields(OffloadPolicy)}
        unknown = set(value) - names
        if unknown:
            raise ValueError(f"unknown offload policy keys {sorted(unknown)}; allowed: {sorted(names)}")
        kwargs = dict(value)
        if "mode" not in kwargs:
            kwargs["mode"] = "selective" if ("fraction" in kwargs or "count" in kwargs) else "full"
        return OffloadPolicy(**kwargs)
    raise TypeError(
        f"offload must be None, 'none', 'full', 'selective', 'selective:<fraction>', 'auto', a fraction, a "
        f"dict of OffloadPolicy fields or an OffloadPolicy, got {value!r}"
    )


def _parse_budget(value: str, tail: str) -> OffloadPolicy:
    """``budget:<fraction>``, ``budget:auto:<max_slowdown>``, either auto form with ``:close-w``, any of
    them with ``:sublayer``."""
    if tail == _SUBLAYER or tail.endswith(":" + _SUBLAYER):
        base = tail.removesuffix(_SUBLAYER).rstrip(":")
        policy = _parse_budget(value, base) if base else OffloadPolicy("budget")
        return replace(policy, granularity="sublayer")
    if tail == _CLOSE_W or tail.endswith(":" + _CLOSE_W):
        base = tail.removesuffix(_CLOSE_W).rstrip(":")
        policy = _parse_budget(value, base) if base else OffloadPolicy("budget")
        return replace(policy, close_w=True)
    head, sep, rest = tail.partition(":")
    try:
        if head == "auto":
            if not sep:
                return OffloadPolicy("budget")
            return OffloadPolicy("budget", max_slowdown=float(rest))
        if sep:
            raise ValueError
        return OffloadPolicy("budget", fraction=float(head))
    except ValueError as e:
        if "max_slowdown" in str(e) or "fraction" in str(e):
            raise
        raise ValueError(
            f"cannot read offload={value!r}; write 'budget:0.5' (share of each chunk's layers) or "
            f"'budget:auto:0.1' (as many layers as fit within a 10% slower step), optionally followed by "
            f"':close-w' (also offload-aware orders) and/or ':sublayer' (units of half a layer); the budget "
            f"forms: {_forms(budget=True)}"
        ) from None


def transfer_compute_ratio(
    hidden_size: int, seq_len: int, flops_per_s: float, host_bandwidth_bytes_per_s: float
) -> float:
    """PipeOffload's ``k`` = (D2H + H2D time of a layer's activations) / (F + B compute of that layer).

    ``k = 10 / (3 * (6h + s)) * flops_per_s / host_bandwidth_bytes_per_s``: compute per layer grows like
    ``h * (6h + s)`` per token while the saved activations grow like ``h``, so large hidden sizes and
    long sequences hide their copies. E.g. h=8192, s=4096 on an A100 (220 TFLOP/s, 15 GB/s): 0.92.
    """
    for name, value in (
        ("hidden_size", hidden_size),
        ("seq_len", seq_len),
        ("flops_per_s", flops_per_s),
        ("host_bandwidth_bytes_per_s", host_bandwidth_bytes_per_s),
    ):
        if not _is_real(value) or not value > 0 or math.isinf(value):
            raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return 10.0 / (3.0 * (6.0 * hidden_size + seq_len)) * flops_per_s / host_bandwidth_bytes_per_s


def auto_offload(k: float, *, lanes: str = "duplex", **tuning: Any) -> OffloadPolicy:
    """The ``auto`` policy for transfer/compute ratio ``k``: offload ``min(1, 1/k)`` of each rank's chunks.

    Why this rule (PipeOffload's k-analysis): each chunk brings F+I+W of compute and, offloaded, one copy
    each way, so over a step the copy lanes must move ``share * k`` times the compute time. The paper
    finds full offload nearly free for ``k <= 1`` and half offloadable for ``k <= 2``; ``1/k`` meets both
    points and keeps the copy traffic at one compute time for larger ``k`` (the share then falls like the
    bandwidth). It is half the bare duplex bound ``2/k`` on purpose: copies come in bursts (the warm-up
    offloads every forward back to back, reloads queue before the cool-down) and two GPUs often share
    one PCIe switch. With a shared lane both directions queue on one lane, so ``k`` counts double.
    ``tuning``: other `OffloadPolicy` fields (``choose``, ``min_lifespan``, ``reload_margin``...).
    """
    if not _is_real(k) or not k >= 0 or math.isinf(k):
        raise ValueError(f"the transfer/compute ratio k must be a finite number >= 0, got {k!r}")
    effective = float(k) * (2.0 if lanes == "shared" else 1.0)
    fraction = 1.0 if effective <= 1.0 else 1.0 / effective
    return OffloadPolicy("auto", fraction=fraction, k=float(k), lanes=lanes, **tuning)


def auto_from_measurements(
    copy_s_per_chunk: float, compute_s_per_chunk: float, *, lanes: str = "duplex"
) -> OffloadPolicy:
    """The ``auto`` policy from measured times of one chunk (one stage, one microbatch).

    ``copy_s_per_chunk``: one-way copy of its saved activations (D2H or H2D; pinned host memory);
    ``compute_s_per_chunk``: its forward plus whole backward (F + I + W). ``k = 2 * copy / compute``.
    """
    if not _is_real(copy_s_per_chunk) or math.isinf(copy_s_per_chunk) or copy_s_per_chunk < 0:
        raise ValueError(f"copy_s_per_chunk must be a finite number >= 0, got {copy_s_per_chunk!r}")
    if not _is_real(compute_s_per_chunk) or math.isinf(compute_s_per_chunk) or not compute_s_per_chunk > 0:
        raise ValueError(f"compute_s_per_chunk must be a finite number > 0, got {compute_s_per_chunk!r}")
    return auto_offload(2.0 * copy_s_per_chunk / compute_s_per_chunk, lanes=lanes)


def plan_offload(
    order: Mapping[int, Iterable[Any]] | Iterable[Iterable[Any]],
    costs: Costs | Mapping[str, float] | None = None,
    policy: Any = "full",
    *,
    layers: int | Sequence[int] | Mapping[int, int] | None = None,
    layer_copy: float | Sequence[float] | Mapping[int, float] | None = None,
    peaks: Callable[[SimResult, Mapping[tuple[int, int], LayeredChunk]], Mapping[int, float]] | None = None,
    unit_compute: Sequence[Sequence[float] | None] | Mapping[int, Sequence[float] | None] | None = None,
) -> OffloadPlan:
    """Choose the chunks to offload in ``order`` and insert their OFFLOAD/RELOAD actions.

    ``order``: rank -> actions, or a list of per-rank action lists (torch's ``pipeline_order`` or
    ``get_schedule_ops`` output included); only compute passes matter. ``costs.transfer`` is one chunk's
    one-way copy time; ``policy``: anything `resolve_offload` accepts.

    The compute-only order is simulated with ``costs``. On every rank, the chunks worth offloading
    (lifespan >= ``min_lifespan``, and a forward-to-backward window longer than an offload plus a
    reload) are taken all (full) or by the policy's share of the rank's chunks (see
    ``OffloadPolicy.choose``). Each OFFLOAD goes right after its F; each RELOAD at the latest position
    that ends ``reload_margin`` backward passes before the chunk's first backward in the timeline, then
    replayed with the copy lanes and moved earlier while a queued copy still ends too late.

    Budget mode (layer by layer, module doc) needs ``layers``: the number of layers of every stage (one
    int for all, or per stage index); ``layer_copy``: one layer's one-way copy time in cost units (one
    number or per stage, a stage's entry possibly one per layer where its layers differ, which the replay
    then times each; default: the chunk's ``costs.transfer`` share of one layer); ``peaks``: the
    per-rank peak the budget lowers, from a replay and its layered chunks (the planner passes the peak
    in bytes, with each stage's real bytes; default: the simulator's chunk units, in which every chunk
    weighs the same); ``unit_compute``: per stage, each unit's share of the stage's passes (None entries:
    equal shares), where the units differ in compute (sub-layer units: `OffloadPolicy.granularity`; then
    ``layers`` counts units and ``layer_copy`` gives each unit's copy). Whole-chunk modes ignore all four,
    so a caller can pass them whatever the policy.
    """
    compute = _compute_order(order)
    costs = Costs.coerce(costs)
    policy = resolve_offload(policy).resolved(costs)
    offloaded: dict[int, list[tuple[int, int]]] = {r: [] for r in compute}
    if not policy.enabled:
        return OffloadPlan(compute, offloaded, policy, simulate(compute, costs, copy_lanes=policy.lanes))
    if policy.close_w:
        from pp_offload.order.zb_offload import plan_close_w

        def budget(order: Mapping[int, list[Action]], inner: OffloadPolicy) -> OffloadPlan:
            return plan_offload(
                order,
                costs,
                inner,
                layers=layers,
                layer_copy=layer_copy,
                peaks=peaks,
                unit_compute=unit_compute,
            )

        def peaks_of(p: OffloadPlan) -> Mapping[int, float]:
            return dict(p.sim.peak_memory) if peaks is None else peaks(p.sim, p.layered)

        return plan_close_w(compute, costs, policy, budget, peaks_of)
    if policy.mode == "budget":
        plan = _plan_budget(compute, costs, policy, layers, layer_copy, peaks, unit_compute)
        if policy.fraction is None and policy.max_slowdown > _DEFAULT_MAX_SLOWDOWN:
            # the search is greedy: a looser limit can end at the same peak for more time than the default
            # one reaches; never return worse than the default limit's plan
            strict = replace(policy, max_slowdown=_DEFAULT_MAX_SLOWDOWN)
            other = _plan_budget(compute, costs, strict, layers, layer_copy, peaks, unit_compute)
            if _plan_lower(other, plan, peaks):
                plan = replace(other, policy=policy)
        return plan

    plan, drops = _plan_whole(compute, costs, policy, drop_after_i=policy.drop_after_i)
    if drops:  # the drop is kept only where it lowers the peak without slowing the step
        kept, _ = _plan_whole(compute, costs, policy, drop_after_i=False)
        if not (plan.sim.makespan <= kept.sim.makespan + _EPS and plan.sim.peak < kept.sim.peak - _EPS):
            plan = kept
    return plan


def _plan_whole(
    compute, costs: Costs, policy: OffloadPolicy, *, drop_after_i: bool
) -> tuple[OffloadPlan, bool]:
    """Whole-chunk modes (full, selective, auto): which chunks move, and where their RELOADs go (and, with
    ``drop_after_i``, where the chunks whose W runs well after their I are reloaded again for it). Also
    whether any candidate chunk could be dropped after its I: where none could, the plan is the one
    without ``drop_after_i``, choice included."""
    drops = False
    offloaded: dict[int, list[tuple[int, int]]] = {r: [] for r in compute}
    base = simulate(compute, costs)
    num_stages = 1 + max(a.stage_index for acts in compute.values() for a in acts)
    scale = 2.0 * len(compute) / num_stages  # chunks per stage, as in the simulator
    copy = costs.transfer * scale
    min_lifespan = 4.0 * copy if policy.min_lifespan is None else policy.min_lifespan

    reloads: dict[int, dict[tuple[int, int], _Chunk]] = {}
    for rank in compute:
        timeline = base.timeline[rank]
        chunks = _chunks(timeline)
        eligible = [
            c for c in chunks.values() if c.lifespan >= min_lifespan - _EPS and c.window > 2.0 * copy + _EPS
        ]
        for c in eligible:
            c.slot = _initial_slot(c, timeline, copy, policy)
        if drop_after_i:  # where each chunk would be reloaded again for its W (-1: it stays from I to W)
            w_of = {(st, mb): i for i, ((st, kind, mb), _, _) in enumerate(timeline) if kind == W}
            for c in eligible:
                if timeline[c.back_index][0][1] == I and c.key in w_of:
                    c.i_index, c.w_index = c.back_index, w_of[c.key]
                    c.w_slot = _w_slot(c, timeline, policy.reload_margin, copy)
                    drops = drops or c.w_slot >= 0
        n = _how_many(policy, len(chunks), len(eligible))
        if n >= len(eligible):
            chosen = sorted(eligible, key=lambda c: (-c.lifespan, c.f_start))
        elif policy.choose == "lifespan":
            chosen = _longest_first(eligible, n)
        else:
            chosen = _lower_peak_first(list(chunks.values()), eligible, n, copy, scale, timeline)
        offloaded[rank] = [c.key for c in chosen]
        reloads[rank] = {c.key: c for c in chosen}

    planned = _insert(compute, reloads)
    result = simulate(planned, costs, copy_lanes=policy.lanes)
    if policy.reload_lead is None:
        for _ in range(_REFINE_ROUNDS):
            if not _move_late_reloads(result, reloads, policy.reload_margin):
                break
            planned = _insert(compute, reloads)
            result = simulate(planned, costs, copy_lanes=policy.lanes)
    return OffloadPlan(planned, offloaded, policy, result), drops


def _per_stage(value: Any, num_stages: int, name: str, *, integer: bool) -> list[Any] | None:
    if value is None:
        return None
    if isinstance(value, Mapping):
        missing = [s for s in range(num_stages) if s not in value]
        if missing:
            raise ValueError(
                f"{name} gives no value for stages {missing}; give one per stage 0..{num_stages - 1}"
            )
        values = [value[s] for s in range(num_stages)]
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        values = [value] * num_stages
    else:
        values = list(value)
        if len(values) < num_stages:
            raise ValueError(f"{name} has {len(values)} entries but the order has {num_stages} stages")
    for v in values:
        # a float entry may be a sequence: one per layer of the stage (layers that save different bytes)
        parts = v if (not integer and isinstance(v, (list, tuple))) else [v]
        ok = all(_is_count(x) if integer else (_is_real(x) and x >= 0 and not math.isinf(x)) for x in parts)
        if not ok:
            what = "an int >= 0 (layers of the stage)" if integer else "a finite number >= 0 (cost units)"
            raise ValueError(f"every {name} entry must be {what}, got {v!r}")
    return values


def _plan_budget(
    compute, costs: Costs, policy: OffloadPolicy, layers, layer_copy, peaks_of=None, unit_compute=None
) -> OffloadPlan:
    """Budget mode: every chunk moves its earliest layers, as many as ``policy`` allows (module doc)."""
    num_stages = 1 + max(a.stage_index for acts in compute.values() for a in acts)
    counts = _per_stage(layers, num_stages, "layers", integer=True)
    if counts is None:
        raise ValueError(
            "offload mode 'budget' moves layers: pass layers= (the number of layers of every stage, one int "
            "or one per stage) to plan_offload; enable_offload counts them on the stage modules"
        )
    copies = _per_stage(layer_copy, num_stages, "layer_copy", integer=False)
    shares = _unit_shares(unit_compute, counts)
    base = simulate(compute, costs)
    scale = 2.0 * len(compute) / num_stages
    chunks: dict[int, list[_Chunk]] = {}
    for rank in compute:
        timeline = base.timeline[rank]
        w_of = {(st, mb): i for i, ((st, kind, mb), _, _) in enumerate(timeline) if kind == W}
        mine = []
        for c in _chunks(timeline).values():
            n = counts[c.key[0]]
            if n == 0:
                continue
            c.layers = n
            c.layer_copy = copies[c.key[0]] if copies is not None else costs.transfer * scale / n
            if isinstance(c.layer_copy, (list, tuple)):  # per layer: exact in the replay, the first for
                c.layer_copies, c.layer_copy = tuple(c.layer_copy), c.layer_copy[0]  # the placement
            c.shares = shares[c.key[0]]
            _, b_start, b_end = timeline[c.back_index]
            c.back_duration = b_end - b_start
            c.fit = _layers_that_fit(c, c.back_start, policy.reload_margin)
            if timeline[c.back_index][0][1] == I and c.key in w_of:
                c.i_index, c.w_index = c.back_index, w_of[c.key]
            mine.append(c)
        chunks[rank] = mine

    def attempt(
        cap: int | None, drop_after_i: bool, extra: Mapping[tuple[int, int], int] | None = None
    ) -> tuple:
        extra = extra or {}
        moved: dict[tuple[int, int], LayeredChunk] = {}
        reloads: dict[int, dict[tuple[int, int], _Chunk]] = {}
        for rank, mine in chunks.items():
            reloads[rank] = {}
            for c in mine:
                if policy.fraction is not None:
                    c.moved = min(c.fit, math.floor(policy.fraction * c.layers + 0.5))
                else:
                    c.moved = min(cap, c.fit)
                    if c.moved > 0:  # extra layers (or fewer) go to chunks whose window hides one at least
                        c.moved = max(0, min(c.layers, c.moved + extra.get((c.key[0], c.key[1] % 2), 0)))
                if c.moved == 0:
                    continue
                moved[c.key] = LayeredChunk(c.moved, c.layers, c.layer_copies or c.layer_copy, c.compute)
                c.slot = _layered_slot(c, base.timeline[rank], policy)
                c.w_slot = _w_slot(c, base.timeline[rank], policy.reload_margin) if drop_after_i else -1
                reloads[rank][c.key] = c
        planned = _insert(compute, reloads)
        result = simulate(planned, costs, copy_lanes=policy.lanes, layered=moved)
        if policy.reload_lead is None:
            for _ in range(_REFINE_ROUNDS):
                if not _move_late_layered(result, reloads, policy.reload_margin):
                    break
                planned = _insert(compute, reloads)
                result = simulate(planned, costs, copy_lanes=policy.lanes, layered=moved)
        offloaded = {r: sorted(reloads[r], key=lambda k: (-moved[k].moved, k)) for r in compute}
        peaks = dict(result.peak_memory) if peaks_of is None else dict(peaks_of(result, moved))
        return planned, offloaded, result, moved, peaks

    if policy.fraction is not None:
        planned, offloaded, result, moved, _ = attempt(None, policy.drop_after_i)
        return OffloadPlan(planned, offloaded, policy, result, moved)
    limit = base.makespan * (1.0 + policy.max_slowdown) + _EPS
    top = max((c.fit for mine in chunks.values() for c in mine), default=0)
    best = None
    halves: list[tuple] = []  # every-other-microbatch starts within the limit
    # per setting of drop_after_i (its second reloads compete for the host->device lane), bisection on
    # the cap of layers per chunk: the largest cap within the slowdown; the lower peak of the two wins
    setting = None
    stages = {c.key[0] for mine in chunks.values() for c in mine}
    for drop in (False, True) if policy.drop_after_i else (False,):
        tried = set()
        low, high = 1, top
        while low <= high:
            mid = (low + high) // 2
            tried.add(mid)
            found = attempt(mid, drop)
            if found[2].makespan <= limit:
                low = mid + 1
                if best is None or _lower(found, best):
                    best, setting = found, (mid, drop, {})
            else:
                high = mid - 1
        # the smallest settings too, since a larger cap may lower the peak no further for more time:
        # one layer per chunk, and one layer on every other microbatch (when one per chunk is already
        # too much for the copy lanes)
        half = {(s, 1): -1 for s in stages}
        for cap, extra in ((1, {}), (1, half)) if top >= 1 else ():
            if extra or cap not in tried:
                found = attempt(cap, drop, extra)
                if found[2].makespan <= limit:
                    if extra:
                        halves.append((found, (cap, drop, extra)))
                    if best is None or _lower(found, best):
                        best, setting = found, (cap, drop, extra)
    if best is not None:
        # second phase from the best first-phase setting and from the every-other-microbatch ones: adding
        # layers where the peak is can beat a uniform cap that reached the same peak at more cost
        raised = [_raise_peak_stages(attempt, best, setting, chunks, limit)]
        others = [(f, st) for f, st in halves if st != setting]
        if others:  # the best every-other-microbatch start only, with fewer tries (each one is a replay)
            start = others[0]
            for f, st in others[1:]:
                if _lower(f, start[0]):
                    start = (f, st)
            raised.append(_raise_peak_stages(attempt, *start, chunks, limit, max_tries=8))
        best = raised[0]
        for found in raised[1:]:
            if _lower(found, best):
                best = found
    if best is None:
        return OffloadPlan(
            compute, {r: [] for r in compute}, policy, simulate(compute, costs, copy_lanes=policy.lanes)
        )
    planned, offloaded, result, moved, _ = best
    return OffloadPlan(planned, offloaded, policy, result, moved)


def _plan_lower(plan: OffloadPlan, than: OffloadPlan, peaks_of) -> bool:
    """`_lower` for two budget plans (their peaks from ``peaks_of``, else the simulator's chunk units)."""

    def key(p: OffloadPlan) -> tuple:
        found = dict(p.sim.peak_memory) if peaks_of is None else dict(peaks_of(p.sim, p.layered))
        return (None, None, p.sim, None, found)

    return _lower(key(plan), key(than))


def _lower(found: tuple, than: tuple, tolerance: float = 1e-3) -> bool:
    """Whether budget attempt ``found`` beats ``than``: a highest peak lower by more than ``tolerance``
    (relative), or the same peak within it in less time. Why the tolerance: the peaks are in bytes, and a
    larger cap can shave a few bytes off the peak for several percent more step time."""
    a, b = max(found[4].values()), max(than[4].values())
    if a < b * (1.0 - tolerance):
        return True
    return a <= b * (1.0 + tolerance) and found[2].makespan < than[2].makespan - _EPS


def _raise_peak_stages(attempt, best, setting, chunks, limit: float, max_tries: int = 24):
    """Budget auto, second phase: one more layer for the chunks of one stage at a time on a rank at the
    highest peak, longest-lived stages first, kept while the step stays within ``limit``, the rank's peak
    falls and the highest peak does not rise: on every microbatch of the stage, else on every other one
    (even, then odd microbatches).
    A rank whose chunks' windows hide no more (the V's turn, where F and B follow each other closely)
    stops the search once it holds the highest peak (``peaks``: in bytes when the caller gives them).

    Why: copy lanes carry a fixed number of layers per step; a uniform cap spends them on every chunk
    alike, while the peak sits on one rank and the long-lived chunks there gain most. Why every other
    microbatch: at real sizes one layer's copy takes several layers' compute (k of 4-7), so one more
    layer on every chunk of a stage can take the copy lanes from half busy to saturated; on half the
    chunks it lowers the peak by about half as much for half the traffic, the granularity between."""
    cap, drop, extra = setting
    lifespans: dict[int, dict[int, list[float]]] = {}
    for rank, mine in chunks.items():
        for c in mine:
            lifespans.setdefault(rank, {}).setdefault(c.key[0], []).append(c.lifespan)
    tries = 0
    improved = True
    stuck: set[int] = set()
    chosen = best  # returned: the lowest highest peak seen (a tie lowered on one rank costs time for nothing)
    while improved and tries < max_tries:
        improved = False
        peaks = best[4]
        top = max(peaks.values())
        # the ranks at the highest peak (within 2%: a tie in all but rounding); lowering another costs
        # copy-lane time and lowers nothing that counts
        for rank in sorted((r for r in peaks if peaks[r] >= 0.98 * top), key=lambda r: -peaks[r]):
            if rank in stuck:
                continue
            stages = sorted(lifespans.get(rank, {}).items(), key=lambda kv: -sum(kv[1]) / len(kv[1]))
            for keys in [
                parities
                for stage, _ in stages
                for parities in (((stage, 0), (stage, 1)), ((stage, 0),), ((stage, 1),))
            ]:
                if tries >= max_tries:
                    break
                tries += 1
                trial = dict(extra)
                for key in keys:
                    trial[key] = trial.get(key, 0) + 1
                found = attempt(cap, drop, trial)
                new = found[4]
                # this rank's peak falls and no other's rises above the highest
                if (
                    found[2].makespan <= limit
                    and max(new.values()) <= top + _EPS
                    and new[rank] < peaks[rank] - _EPS
                ):
                    best, extra, improved = found, trial, True
                    if _lower(found, chosen):
                        chosen = found
                    break
            if improved:
                break
            stuck.add(rank)  # nothing of this rank helped: not retried after other ranks' changes
    return chosen


def _unit_shares(unit_compute: Any, counts: list[int]) -> list[tuple[float, ...]]:
    """Per stage, each unit's share of the stage's passes (``unit_compute`` entries, else equal shares)."""
    given = None
    if unit_compute:  # a stage without units (no decoder layers: the LM head's) has None
        entries = list(unit_compute.values()) if isinstance(unit_compute, Mapping) else list(unit_compute)
        _per_stage([0.0 if e is None else e for e in entries], len(counts), "unit_compute", integer=False)
        given = unit_compute
    out = []
    for s, n in enumerate(counts):
        entry = given[s] if given is not None else None
        if entry is None:
            out.append((1.0 / n,) * n if n else ())
            continue
        entry = tuple(float(x) for x in entry)
        if len(entry) != n or abs(sum(entry) - 1.0) > 1e-6:
            raise ValueError(
                f"unit_compute[{s}] must hold {n} shares summing to 1 (one per unit), got {entry!r}"
            )
        out.append(entry)
    return out


def _offload_end(c: _Chunk, k: int) -> float:
    """When the copy of the chunk's first ``k`` units ends, each issued at its unit's forward end
    (idle lane)."""
    t = c.f_start
    done = 0.0
    for i in range(k):
        done += c.shares[i]
        t = max(c.f_start + done * (c.f_end - c.f_start), t) + c.copy_of(i)
    return t


def _latest_reload_start(
    c: _Chunk, k: int, back_start: float, margin: float, duration: float | None = None
) -> float:
    """The latest start of a reload of units k-1..0 (in that order) that still ends every unit
    ``margin`` unit-backwards before the backward (of ``duration``, default the first) reaches it."""
    span = c.back_duration if duration is None else duration
    latest, before, copied = math.inf, 0.0, 0.0
    after = [0.0] * c.layers  # share of the backward before it reaches unit j (later units first)
    for j in range(c.layers - 1, -1, -1):
        after[j] = before
        before += c.shares[j]
    for j in range(k - 1, -1, -1):
        copied += c.copy_of(j)
        latest = min(latest, back_start + (after[j] - margin * c.shares[j]) * span - copied)
    return latest


def _layers_that_fit(c: _Chunk, back_start: float, margin: float) -> int:
    """The most layers whose round trip the chunk's window hides with idle copy lanes."""
    best = 0
    for k in range(1, c.layers + 1):
        if _offload_end(c, k) <= _latest_reload_start(c, k, back_start, margin) + _EPS:
            best = k
    return best


def _layered_slot(c: _Chunk, timeline, policy: OffloadPolicy) -> int:
    """Budget mode's `_initial_slot`: the latest slot (up to right before the backward, whose later
    layers hide part of the reload) whose reload starts early enough."""
    first, last = c.f_index + 1, c.back_index
    if policy.reload_lead is not None:
        return max(first, last - policy.reload_lead)
    offload_end = _offload_end(c, c.moved)
    latest = _latest_reload_start(c, c.moved, c.back_start, policy.reload_margin)
    for candidate in range(last, first - 1, -1):
        if max(timeline[candidate - 1][2], offload_end) <= latest + _EPS:
            return candidate
    return first


def _move_late_layered(
    result: SimResult, reloads: dict[int, dict[tuple[int, int], _Chunk]], margin: float
) -> bool:
    """Budget mode's `_move_late_reloads`: a RELOAD whose replayed start is later than its layers allow
    moves one pass earlier; a late RELOAD before W that cannot move earlier drops its I-to-W pair."""
    moved = False
    for rank, chunks in reloads.items():
        if not chunks:
            continue
        timeline = result.timeline[rank]
        seen: set[tuple[int, int]] = set()
        for action, start, _ in result.transfers[rank]:
            if action.computation_type != RELOAD:
                continue
            key = (action.stage_index, action.microbatch_index)
            c = chunks[key]
            if key not in seen:  # the first RELOAD, before I (or B)
                seen.add(key)
                back_start = timeline[c.back_index][1]
                if (
                    start > _latest_reload_start(c, c.moved, back_start, margin) + _EPS
                    and c.slot > c.f_index + 1
                ):
                    c.slot -= 1
                    moved = True
                continue
            _, w_start, w_end = timeline[c.w_index]
            if start > _latest_reload_start(c, c.moved, w_start, margin, w_end - w_start) + _EPS:
                c.w_slot = c.w_slot - 1 if c.w_slot > c.i_index + 1 else -1
                moved = True
    return moved


def _w_slot(c: _Chunk, timeline, margin: float, copy: float | None = None) -> int:
    """Where a chunk dropped after its I is reloaded for its W: the latest slot whose reload (issued when
    the pass before the slot ends) still ends in time, if the chunk then stays off the device at least as
    long as the reload takes; else -1 (it stays on the device from I to W). Budget mode (``copy`` None):
    its moved units, each needed ``margin`` unit-backwards before W reaches it; whole chunks: one copy of
    ``copy``, ending ``margin`` W-durations before W starts."""
    if c.i_index < 0 or c.w_index < 0 or c.w_index <= c.i_index + 1:
        return -1
    i_end = timeline[c.i_index][2]
    _, w_start, w_end = timeline[c.w_index]
    if copy is None:
        latest = _latest_reload_start(c, c.moved, w_start, margin, w_end - w_start)
        copy = sum(map(c.copy_of, range(c.moved)))
    else:
        latest = w_start - margin * (w_end - w_start) - copy
    for slot in range(c.w_index, c.i_index, -1):
        issue = timeline[slot - 1][2]
        if issue <= latest + _EPS:
            return slot if issue - i_end >= copy - _EPS else -1
    return -1


@dataclass
class _Chunk:
    """One (stage, microbatch) on its rank: indices into the rank's compute passes and simulated times."""

    key: tuple[int, int]
    f_index: int
    f_start: float
    f_end: float
    back_index: int = -1  # first backward pass (I or B; W when there is neither)
    back_start: float = math.inf
    free_end: float = -math.inf  # end of W or B, when the activations die
    slot: int = -1  # RELOAD goes right before compute pass `slot`
    reload_start: float = math.inf  # estimated from the compute-only timeline
    # budget mode: the stage's layers, one layer's copy time, the backward's duration, layers moved
    layers: int = 0
    layer_copy: float = 0.0
    layer_copies: tuple[float, ...] | None = None  # per layer, when they differ (the replay uses them)
    shares: tuple[float, ...] = ()  # each unit's share of the chunk's passes
    back_duration: float = 0.0
    fit: int = 0
    moved: int = 0
    # budget mode, zero-bubble orders: the I and W passes, and the second RELOAD's slot before W (-1: none)
    i_index: int = -1
    w_index: int = -1
    w_slot: int = -1

    @property
    def lifespan(self) -> float:
        return self.free_end - self.f_start

    @property
    def compute(self) -> tuple[float, ...] | None:
        """The shares for `LayeredChunk.compute` (None where they are equal: the plain layer model)."""
        return None if len(set(self.shares)) <= 1 else self.shares

    def copy_of(self, unit: int) -> float:
        """Unit ``unit``'s one-way copy time."""
        return self.layer_copies[unit] if self.layer_copies is not None else self.layer_copy

    @property
    def window(self) -> float:
        return self.back_start - self.f_end


def _chunks(timeline) -> dict[tuple[int, int], _Chunk]:
    chunks: dict[tuple[int, int], _Chunk] = {}
    for index, ((stage, kind, mb), start, finish) in enumerate(timeline):
        key = (stage, mb)
        if kind == F:
            chunks[key] = _Chunk(key, index, start, finish)
            continue
        chunk = chunks.get(key)
        if chunk is None:
            continue
        if chunk.back_index < 0:  # I or B; W only when the chunk has neither (I always precedes W)
            chunk.back_index, chunk.back_start = index, start
        if kind in (W, B):
            chunk.free_end = max(chunk.free_end, finish)
    return {k: c for k, c in chunks.items() if c.back_index >= 0 and c.free_end > -math.inf}


def _how_many(policy: OffloadPolicy, total: int, eligible: int) -> int:
    if policy.mode == "full":
        return eligible
    if policy.count is not None:
        return min(policy.count, eligible)
    return min(math.floor(policy.fraction * total + 0.5), eligible)


def _longest_first(chunks: list[_Chunk], n: int) -> list[_Chunk]:
    """The ``n`` longest-lived chunks; ties at the cut are spread evenly over forward time."""
    if n <= 0:
        return []
    ranked = sorted(chunks, key=lambda c: (-c.lifespan, c.f_start))
    if n >= len(ranked):
        return ranked
    cut = ranked[n - 1].lifespan
    tol = 1e-6 * max(1.0, abs(cut))
    sure = [c for c in ranked if c.lifespan > cut + tol]
    tied = sorted((c for c in ranked if abs(c.lifespan - cut) <= tol), key=lambda c: c.f_start)
    need = n - len(sure)
    picks = [tied[int((i + 0.5) * len(tied) / need)] for i in range(need)]
    return sure + picks


def _lower_peak_first(
    chunks: list[_Chunk], eligible: list[_Chunk], n: int, copy: float, scale: float, timeline=None
) -> list[_Chunk]:
    """``n`` of ``eligible`` that bring the rank's device-resident peak lowest, then longest-lived.

    In the compute-only timeline an offloaded chunk is off the device from its offload's end to its
    reload's start (its *gap*). For a target peak P, every instant whose level exceeds P needs that many
    chunk units of gaps over it: a multi-cover of points by intervals, which the left-to-right sweep
    taking, where cover is missing, the gap reaching furthest right (the longest-lived among equal ones)
    solves with the fewest chunks. The lowest P reachable within ``n`` is found by bisection; the rest of
    the share goes to the longest-lived chunks left.

    Why not plain longest-first: lifespans of a compacted or interleaved order differ by a pass or two
    between neighbouring microbatches, and longest-first then offloads every other microbatch of the
    steady phase and nothing of the warm-up or cool-down, where the peak may sit unchanged.

    A chunk that is dropped after its I and reloaded for its W (``w_slot``, with the rank's ``timeline``)
    has a second gap, from its I's end to that reload's issue; taking the chunk for one gap takes the
    other too (the sweep counts it where it starts), so the cover sees what the drop frees in the cool-down.
    """
    second = {id(c): _w_gap(c, timeline) for c in eligible if timeline is not None and c.w_slot >= 0}
    times = sorted(
        {t for c in chunks for t in (c.f_start, c.free_end)}
        | {t for c in eligible for t in _gap(c, copy)}
        | {t for gap in second.values() for t in gap}
    )
    index = {t: i for i, t in enumerate(times)}
    delta = [0.0] * (len(times) + 1)
    for c in chunks:
        delta[index[c.f_start]] += scale
        delta[index[c.free_end]] -= scale
    level, running = [], 0.0
    for i in range(len(times)):
        running += delta[i]
        level.append(running)  # on [times[i], times[i + 1])
    spans = []  # (lo, hi, chunk): the gap covers segments lo .. hi-1
    linked: dict[int, list[tuple[int, int]]] = {}  # chunk -> all its gaps (lo, hi)
    for c in eligible:
        for start, end in (_gap(c, copy), *((second[id(c)],) if id(c) in second else ())):
            if index[end] > index[start]:
                spans.append((index[start], index[end], c))
                linked.setdefault(id(c), []).append((index[start], index[end]))
    spans.sort(key=lambda s: s[0])

    def cover(target: float) -> list[_Chunk] | None:
        """Fewest gaps keeping every segment at or below ``target``; None if more than ``n`` needed."""
        heap: list[tuple[int, float, float, int]] = []
        ends = [0] * (len(times) + 1)
        begins = [0] * (len(times) + 1)  # a taken chunk's later gap, counted from where it starts
        chosen: list[_Chunk] = []
        taken: set[int] = set()
        active = nxt = 0
        for i, value in enumerate(level):
            active += begins[i] - ends[i]
            while nxt < len(spans) and spans[nxt][0] <= i:
                heapq.heappush(heap, (-spans[nxt][1], -spans[nxt][2].lifespan, spans[nxt][2].f_start, nxt))
                nxt += 1
            need = math.ceil((value - target) / scale - 1e-9)
            while active < need:
                while heap and (-heap[0][0] <= i or id(spans[heap[0][3]][2]) in taken):
                    heapq.heappop(heap)  # gaps ending before this segment, or of a chunk already taken
                if not heap or len(chosen) == n:
                    return None
                _, _, _, k = heapq.heappop(heap)
                c = spans[k][2]
                chosen.append(c)
                taken.add(id(c))
                for lo, hi in linked[id(c)]:
                    if lo <= i < hi:
                        active += 1
                        ends[hi] += 1
                    elif lo > i:
                        begins[lo] += 1
                        ends[hi] += 1
        return chosen

    peak = max(level)
    best: list[_Chunk] = []
    low, high = 0, round(peak / scale)  # bisect on the number of chunk units removed from the peak
    while low < high:
        mid = (low + high + 1) // 2
        found = cover(peak - mid * scale)
        if found is None:
            high = mid - 1
        else:
            low, best = mid, found
    if low == 0:
        best = []
    taken = {id(c) for c in best}
    rest = sorted((c for c in eligible if id(c) not in taken), key=lambda c: (-c.lifespan, c.f_start))
    return best + rest[: n - len(best)]


def _gap(chunk: _Chunk, copy: float) -> tuple[float, float]:
    """When an offloaded chunk is off the device: its offload's end to its reload's start."""
    return chunk.f_end + copy, max(chunk.f_end + copy, chunk.reload_start)


def _w_gap(chunk: _Chunk, timeline) -> tuple[float, float]:
    """When a chunk dropped after its I is off the device again: its I's end to the issue of its reload for
    W (the end of the pass before ``w_slot``) in the compute-only timeline."""
    i_end = timeline[chunk.i_index][2]
    return i_end, max(i_end, timeline[chunk.w_slot - 1][2])


def _initial_slot(chunk: _Chunk, timeline, copy: float, policy: OffloadPolicy) -> int:
    """Where the RELOAD goes, from the compute-only timeline: before compute pass ``slot``.

    Latest slot whose reload (issued when the pass before the slot ends, started no earlier than the
    OFFLOAD's end) ends ``reload_margin`` backward passes before the backward starts; at least one pass
    before it when the window has room; otherwise right after the OFFLOAD. Also records the estimated
    reload start on ``chunk``.
    """
    first = chunk.f_index + 1  # right after the F (and its OFFLOAD)
    last = chunk.back_index
    offload_end = chunk.f_end + copy
    if policy.reload_lead is not None:
        slot = max(first, last - policy.reload_lead)
    else:
        _, b_start, b_end = timeline[last]
        deadline = b_start - policy.reload_margin * (b_end - b_start) + _EPS
        top = last - 1 if last - 1 >= first else last
        slot = first
        for candidate in range(top, first - 1, -1):
            if max(timeline[candidate - 1][2], offload_end) + copy <= deadline:
                slot = candidate
                break
    chunk.reload_start = max(timeline[slot - 1][2], offload_end)
    return slot


def _move_late_reloads(
    result: SimResult, reloads: dict[int, dict[tuple[int, int], _Chunk]], margin: float
) -> bool:
    """Move one pass earlier every RELOAD that, replayed with the lanes, ends later than ``margin``
    backward passes before its backward starts. Returns whether anything moved."""
    moved = False
    for rank, chunks in reloads.items():
        if not chunks:
            continue
        timeline = result.timeline[rank]
        seen: set[tuple[int, int]] = set()
        for action, _, finish in result.transfers[rank]:
            if action.computation_type != RELOAD:
                continue
            key = (action.stage_index, action.microbatch_index)
            chunk = chunks[key]
            if key in seen:  # the second RELOAD, before W (drop_after_i): earlier, or drop the pair
                _, w_start, w_end = timeline[chunk.w_index]
                if finish > w_start - margin * (w_end - w_start) + _EPS:
                    chunk.w_slot = chunk.w_slot - 1 if chunk.w_slot > chunk.i_index + 1 else -1
                    moved = True
                continue
            seen.add(key)
            _, b_start, b_end = timeline[chunk.back_index]
            if finish > b_start - margin * (b_end - b_start) + _EPS and chunk.slot > chunk.f_index + 1:
                chunk.slot -= 1
                moved = True
    return moved


def _insert(compute: dict[int, list[Action]], reloads: dict[int, dict[tuple[int, int], _Chunk]]):
    """``compute`` with OFFLOAD right after each chosen F and RELOAD right before compute pass ``slot``
    (after any OFFLOAD at the same place; RELOADs sharing a slot in the order of their backwards)."""
    out: dict[int, list[Action]] = {}
    for rank, actions in compute.items():
        chunks = reloads.get(rank, {})
        if not chunks:
            out[rank] = list(actions)
            continue
        before: dict[int, list[_Chunk]] = {}
        for c in chunks.values():
            before.setdefault(c.slot, []).append(c)
            if c.w_slot >= 0:  # budget, zero-bubble orders: dropped after I, reloaded before W
                before.setdefault(c.w_slot, []).append(c)
        for index, group in before.items():
            group.sort(key=lambda c: c.back_index if c.slot == index else c.w_index)
        after_i = {c.i_index: c for c in chunks.values() if c.w_slot >= 0}
        seq: list[Action] = []
        for index, action in enumerate(actions):
            seq.extend(Action(c.key[0], RELOAD, c.key[1]) for c in before.get(index, ()))
            seq.append(action)
            if action.computation_type == F and (action.stage_index, action.microbatch_index) in chunks:
                # the RELOAD of a chunk whose slot is the next pass still comes after this OFFLOAD
                seq.append(Action(action.stage_index, OFFLOAD, action.microbatch_index))
            elif index in after_i:
                seq.append(Action(action.stage_index, OFFLOAD, action.microbatch_index))
        seq.extend(Action(c.key[0], RELOAD, c.key[1]) for c in before.get(len(actions), ()))
        out[rank] = seq
    return out


def _compute_order(order: Mapping[int, Iterable[Any]] | Iterable[Iterable[Any]]) -> dict[int, list[Action]]:
    """Any order (ours, torch's ``_Action`` lists with ``None`` slots) as rank -> compute `Action`s."""
    items = order.items() if isinstance(order, Mapping) else enumerate(order)
    out: dict[int, list[Action]] = {}
    for rank, actions in items:
        actions = list(actions)
        for a in actions:
            if a is not None:
                kind = str(getattr(a.computation_type, "value", a.computation_type))
                if kind in (OFFLOAD, RELOAD):
                    raise ValueError(
                        f"order already holds {a} on rank {rank}; plan_offload takes the compute-only order"
                    )
        out[int(rank)] = [Action(s, k, j) for s, k, j in flatten(actions)]
    if not any(out.values()):
        raise ValueError("order has no compute actions")
    return out


def _tuning(policy: OffloadPolicy) -> dict[str, Any]:
    """The fields of ``policy`` that tune placement rather than choose the share."""
    return {
        "choose": policy.choose,
        "min_lifespan": policy.min_lifespan,
        "reload_margin": policy.reload_margin,
        "reload_lead": policy.reload_lead,
        "lanes": policy.lanes,
        "max_slowdown": policy.max_slowdown,
        "drop_after_i": policy.drop_after_i,
    }


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
