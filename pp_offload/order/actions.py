"""Plain-Python pipeline actions and costs.

Orders are produced without torch.distributed so they can be generated, checked and simulated in
milliseconds. `Action` deliberately has the same field names as torch's private `_Action`
(`stage_index`, `computation_type`, `microbatch_index`) and prints the same way (`2F0`, `7I3`), so the
simulator reads either kind and the runtime converts ours to torch's in exactly one place
(`pp_offload.runtime.compat`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

F = "F"  # forward
I = "I"  # backward w.r.t. the stage input (the papers call it B)
W = "W"  # backward w.r.t. the weights
B = "B"  # full backward (I + W in one pass)
COMPUTE_KINDS = (F, I, W, B)
OFFLOAD = "OFFLOAD"  # copy a chunk's saved activations device -> host, then free them on the device
RELOAD = "RELOAD"  # copy them back host -> device before the chunk's backward
TRANSFER_KINDS = (OFFLOAD, RELOAD)


class Action(NamedTuple):
    """One pass of one microbatch on one stage, e.g. ``Action(3, "F", 1)`` prints as ``3F1``."""

    stage_index: int
    computation_type: str
    microbatch_index: int

    def __str__(self) -> str:
        return f"{self.stage_index}{self.computation_type}{self.microbatch_index}"

    __repr__ = __str__


Order = dict[int, list[Action]]
"""rank -> that rank's actions in execution order (compute only)."""


@dataclass(frozen=True)
class Costs:
    """Relative durations of one chunk's passes, of one point-to-point transfer and of one host copy.

    A *chunk* is one V stage (half of a rank's layers). Only ratios matter; unit costs are the
    papers' default. ``comm`` is the latency added when a pass depends on a pass of another rank.
    ``transfer`` is the time to copy one chunk's saved activations one way between device and host (one
    OFFLOAD or one RELOAD); copies run on copy lanes beside the compute stream (see `pp_offload.sim`).

    ``stages`` (optional): per stage index, the ``(F, I, W)`` of one chunk *of that stage*, in the same
    per-chunk units as ``F``/``I``/``W`` (a stage of ``c`` chunks takes ``c`` times as long). Real pipelines
    are imbalanced (embedding on the first stage, LM head and loss on the last), so `pp_offload.sim.simulate`
    times each compute pass with its own stage's entry when given (`of_stage`). The order generators keep
    using the scalar ``F``/``I``/``W`` (an order is a plan; only its evaluation needs each stage's truth).
    ``None``: every stage costs ``F``/``I``/``W``. An entry may carry a fourth number, the time counted in
    both its I and its W that one full backward B runs only once (a recomputation:
    `pp_offload.recompute_plan.recomputations`): that stage's B then takes ``I + W - shared``.

    ``queue`` (optional): deferred weight gradients (`pp_offload.runtime.deferred_w`): the W queue a chunk
    holds from the end of its I to the end of its W, as a multiple of the bytes one ``transfer`` copies (a
    chunk's saved activations; the planner uses the largest stage's), one number for every stage or one per
    stage index. Under deferred W, I frees the chunk's saved tensors and
    only the queue waits for W, so the simulator counts that share of a chunk unit from I to W, and a copy
    between I and W (an offload plan's OFFLOAD after I and its second RELOAD before W) moves the queue:
    ``queue`` times a chunk's copy time. ``None``: torch's retained-graph split, where the saved tensors live
    until W and a copy after I just drops the device copy (its host copy is still exact).
    """

    F: float = 1.0
    I: float = 1.0
    W: float = 1.0
    comm: float = 0.0
    transfer: float = 0.0
    stages: tuple[tuple[float, ...], ...] | None = None
    queue: float | tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("F", "I", "W"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"costs[{name!r}] must be > 0, got {value!r}")
        for name in ("comm", "transfer"):
            value = getattr(self, name)
            if not value >= 0:
                raise ValueError(f"costs[{name!r}] must be >= 0, got {value!r}")
        if self.stages is not None:
            object.__setattr__(self, "stages", _stage_costs(self.stages))
        if self.queue is not None:
            object.__setattr__(self, "queue", _queue_ratio(self.queue))

    @classmethod
    def coerce(cls, costs: Costs | Mapping[str, float] | None) -> Costs:
        """Accept ``None`` (unit costs), a ``Costs`` or a mapping like ``{"F": 3, "I": 4, "W": 2}``.

        Allowed keys: ``F``, ``I``, ``W``, ``comm``, ``transfer``, ``stages`` (a list of ``[F, I, W]``
        per stage), ``queue`` (a number, or one per stage); missing ones keep their defaults.
        """
        if costs is None:
            return cls()
        if isinstance(costs, Costs):
            return costs
        if not isinstance(costs, Mapping):
            raise TypeError(
                f"costs must be a mapping like {{'F': 1, 'I': 1, 'W': 1, 'comm': 0}}, got {costs!r}"
            )
        unknown = set(costs) - {"F", "I", "W", "comm", "transfer", "stages", "queue"}
        if unknown:
            raise ValueError(
                f"unknown cost keys {sorted(unknown)}; allowed keys are 'F', 'I', 'W', 'comm', 'transfer', "
                "'stages', 'queue'"
            )
        return cls(**{k: v if k in ("stages", "queue") else float(v) for k, v in costs.items()})

    def of(self, kind: str) -> float:
        """Duration of one pass of ``kind`` (F, I, W or B = I + W) on one chunk."""
        if kind == B:
            return self.I + self.W
        return getattr(self, kind)

    def of_stage(self, stage: int, kind: str) -> float:
        """Duration of one pass of ``kind`` (F, I, W or B = I + W) on one chunk of ``stage``: its own entry
        in ``stages`` when given, else `of`."""
        if self.stages is None:
            return self.of(kind)
        f, i, w, *shared = self.stages[stage]
        return {F: f, I: i, W: w, B: i + w - sum(shared)}[kind]

    def queue_of(self, stage: int) -> float | None:
        """Stage ``stage``'s deferred-W queue as a multiple of its chunk's saved activations (``queue``);
        None under torch's retained-graph split."""
        if self.queue is None or isinstance(self.queue, float):
            return self.queue
        if stage >= len(self.queue):
            raise ValueError(
                f"costs.queue has {len(self.queue)} entries but the order has stage {stage}; give one per "
                "stage"
            )
        return self.queue[stage]


def _queue_ratio(queue: object) -> float | tuple[float, ...]:
    """``queue`` as one float or a tuple (hashable) of floats, each finite and >= 0 (`Costs`)."""
    values = queue if isinstance(queue, (list, tuple)) else [queue]
    try:
        out = tuple(float(v) for v in values)  # type: ignore[union-attr]
    except (TypeError, ValueError):
        out = ()
    if not out or any(not 0 <= v < float("inf") for v in out) or isinstance(queue, (str, bytes, bool)):
        raise ValueError(
            f"costs['queue'] must be a finite number >= 0 (the deferred-W queue over a chunk's saved bytes) "
            f"or one per stage, got {queue!r}"
        )
    return out if isinstance(queue, (list, tuple)) else out[0]


def _stage_costs(stages: object) -> tuple[tuple[float, ...], ...]:
    """``stages`` as a tuple (hashable) of ``(F, I, W)`` float triples, each > 0, or ``(F, I, W, shared)``
    with ``0 <= shared < min(I, W)`` (`Costs`); a ValueError names the stage otherwise."""
    if isinstance(stages, (str, bytes, Mapping)) or not hasattr(stages, "__iter__"):
        raise ValueError(f"costs['stages'] must be a list of [F, I, W] per stage, got {stages!r}")
    out = []
    for s, entry in enumerate(stages):
        try:
            triple = tuple(float(v) for v in entry)
        except (TypeError, ValueError):
            triple = ()
        if len(triple) not in (3, 4):
            raise ValueError(
                f"costs['stages'][{s}] must be [F, I, W] or [F, I, W, shared] (3 or 4 numbers), got {entry!r}"
            )
        for name, value in zip((F, I, W), triple, strict=False):
            if not value > 0 or value == float("inf"):
                raise ValueError(
                    f"costs['stages'][{s}] (stage {s}): {name} must be a finite number > 0, got {value!r}"
                )
        if len(triple) == 4 and not 0 <= triple[3] < min(triple[1], triple[2]):
            raise ValueError(
                f"costs['stages'][{s}] (stage {s}): shared must be >= 0 and below both I and W, got "
                f"{triple[3]!r}"
            )
        out.append(triple)
    if not out:
        raise ValueError("costs['stages'] is empty; give [F, I, W] per stage, or None for the scalar F/I/W")
    return tuple(out)


def v_stages(rank: int, num_ranks: int) -> tuple[int, int]:
    """The two stages rank ``rank`` holds in V placement: ``r`` (down the V) and ``2d-1-r`` (back up)."""
    return rank, 2 * num_ranks - 1 - rank


def v_rank_of_stage(stage: int, num_ranks: int) -> int:
    """Rank holding ``stage`` in V placement."""
    return stage if stage < num_ranks else 2 * num_ranks - 1 - stage
