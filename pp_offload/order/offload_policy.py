"""What the user's ``offload=`` means: the policy grammar (`resolve_offload`), its catalog of forms
(`OFFLOAD_FORMS`, `offload_examples`) and the transfer/compute ratio ``k`` the ``auto`` mode decides from.

Why apart from the planning (`pp_offload.order.offload`): the recipe's config checks, the docs generator
and the planner's candidate lists need the grammar and the catalog, not the placement machinery.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from pp_offload.order.actions import Costs

__all__ = [
    "CHOICES",
    "GRANULARITIES",
    "LANES",
    "MODES",
    "OFFLOAD_FORMS",
    "OffloadForm",
    "OffloadPolicy",
    "auto_from_measurements",
    "auto_offload",
    "offload_examples",
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
