"""V-shape pipeline schedules with controllable activation memory, on torch's pipelining runtime.

Each rank holds two stages, ``r`` (down the V) and ``2d-1-r`` (back up), so the first and last stage sit on
rank 0. The order of every pass is produced by a plain-Python generator in `pp_offload.order`; the classes
here hand it to torch's multi-stage runtime, which adds the SEND/RECV (and FSDP UNSHARD/RESHARD,
REDUCE_GRAD) actions, checks the order cannot deadlock, and executes it. They are built exactly like
torch's own multi-stage schedules::

    schedule = ScheduleVHalf([stage_r, stage_2d_1_r], n_microbatches, loss_fn=loss_fn, scale_grads=False)
    schedule.step(x, target=y, losses=losses)

Which one to pick (activation memory relative to 1F1B, bubble with equal F/I/W costs):

- `ScheduleVMin`: ~1/3 of 1F1B's activation memory, the largest bubble of the four.
- `ScheduleVHalf`: ~1/2 of 1F1B's memory and a small bubble: the memory-saving default.
- `ScheduleVZB`: 1F1B's memory with a near-zero bubble (like torch's ``ScheduleZBVZeroBubble``).
- `ScheduleVAdaptive`: the lowest-bubble order found under ``memory_limit`` (fraction of 1F1B's memory).

Tied weights: V placement puts the embedding (stage 0) and the LM head (stage 2d-1) on the same rank, so a
tied parameter is shared by two stages of one rank. With ``scale_grads=True`` torch divides each stage's
gradients by the number of microbatches when that stage's backward ends, so a shared parameter is divided
twice. Use ``scale_grads=False`` with a loss normalised by the global token count instead.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pp_offload.order import Costs, adaptive_v_order, v_half_order, v_min_order, v_zb_order
from pp_offload.order.actions import Order, v_stages
from pp_offload.order.offload_inputs import OffloadInputs
from pp_offload.runtime import compat
from pp_offload.runtime.deferred_w import defer_weight_grads, refuse_compiled_split
from pp_offload.runtime.offload import enable_offload
from pp_offload.runtime.search_group import stage_gather

__all__ = ["ScheduleVAdaptive", "ScheduleVHalf", "ScheduleVMin", "ScheduleVZB"]


class _VSchedule(compat.RuntimeBase):
    """Shared constructor: validate stages and arguments, generate the order, lower it with comms.

    A subclass names its generator in ``_generator``; everything else is here.
    """

    _generator: Callable[..., Order]

    def __init__(
        self,
        stages: Sequence[Any],
        n_microbatches: int,
        loss_fn: Callable[..., Any] | None = None,
        args_chunk_spec: tuple[Any, ...] | None = None,
        kwargs_chunk_spec: dict[str, Any] | None = None,
        output_merge_spec: dict[str, Any] | tuple[Any] | None = None,
        scale_grads: bool = True,
        backward_requires_autograd: bool = True,
        *,
        costs: Costs | Mapping[str, float] | None = None,
        defer_pp_recv: bool = False,
        offload: Any = None,
        offload_inputs: OffloadInputs | Mapping[str, Any] | None = None,
        spread_search: bool = True,
        deferred_w: bool = True,
    ):
        """Arguments as for torch's multi-stage schedules (e.g. ``ScheduleZBVZeroBubble``), plus:

        stages: this rank's two stages, ``r`` and ``2d-1-r`` (any order), out of ``2d`` in total.
        scale_grads: keep torch's default only without tied weights; with an embedding tied to the LM head
            pass ``False`` and normalise the loss by the global token count (see the module docstring).
        costs: relative F/I/W/comm durations the order is optimised for (``None``: unit costs).
        defer_pp_recv: post each receive just before the compute that needs it (newer torch only).
        offload: move saved activations to host memory between each chunk's forward and backward:
            ``"full"``, ``"selective"`` (or a fraction like ``0.5``), ``"auto"``, or ``None`` (default);
            see `pp_offload.runtime.offload.enable_offload`.
        offload_inputs: the planner's figures (`pp_offload.order.offload_inputs.OffloadInputs`), so the
            offload plan is the one the planner predicted; without ``costs`` the order is then built from
            their scalar F/I/W/comm, as the planner builds it.
        spread_search: build the order together with the other ranks of the stages' process group (each
            searches a share, all get the same order; every rank must construct its schedule at the same
            time, as pipeline ranks do). ``False``: this rank searches alone.
        deferred_w: defer linear-like weight gradients to W (`pp_offload.runtime.deferred_w`): I is one
            backward without a retained graph, so compiled layers and checkpointed layers run their
            backward once. ``False``: torch's retained-graph split (refused on compiled stages).
        """
        name = type(self).__name__
        stages = list(stages)
        _check_v_stages(name, stages)
        if isinstance(n_microbatches, bool) or not isinstance(n_microbatches, numbers.Integral):
            raise ValueError(f"{name}: n_microbatches must be an int >= 1, got {n_microbatches!r}")
        if n_microbatches < 1:
            raise ValueError(
                f"{name}: n_microbatches must be >= 1, got {n_microbatches}; pass the number of microbatches "
                "each step splits the batch into (>= 2 * pipeline size for a full steady phase)"
            )
        if offload_inputs is not None and not isinstance(offload_inputs, OffloadInputs):
            offload_inputs = OffloadInputs.from_dict(offload_inputs)
        if costs is None and offload_inputs is not None:
            costs = dataclasses.replace(offload_inputs.costs, stages=None)
        try:
            self.costs = Costs.coerce(costs)
        except (TypeError, ValueError) as e:
            raise ValueError(
                f"{name}: invalid costs {costs!r} ({e}); pass None for unit costs, a Costs, or a mapping "
                "like {'F': 1.0, 'I': 1.0, 'W': 1.0, 'comm': 0.0} with positive F/I/W and comm >= 0"
            ) from e
        defer_weight_grads(stages, enabled=deferred_w)
        if not deferred_w:
            compat.check_compile_compatibility(stages, name)
        refuse_compiled_split(stages, name)
        compat.skip_self_p2p_warmup(stages)
        super().__init__(
            stages=stages,
            n_microbatches=int(n_microbatches),
            loss_fn=loss_fn,
            args_chunk_spec=args_chunk_spec,
            kwargs_chunk_spec=kwargs_chunk_spec,
            output_merge_spec=output_merge_spec,
            scale_grads=scale_grads,
            backward_requires_autograd=backward_requires_autograd,
            **compat.runtime_init_kwargs(defer_pp_recv=defer_pp_recv),
        )
        # Who the order search is spread over (None: this process alone); see `search_group`.
        self._search_gather = stage_gather(stages) if spread_search else None
        order = self._generate(self.pp_group_size, self._n_microbatches, self.costs)
        self.pipeline_order = compat.to_torch_order(order)
        self._prepare_schedule_with_comms(self.pipeline_order)
        self.offload = None  # set by enable_offload: the plan and the activation store
        if offload is not None:
            if offload_inputs is not None:
                enable_offload(self, offload, inputs=offload_inputs)
            else:
                enable_offload(self, offload, costs=self.costs)

    def _generate(self, num_ranks: int, num_microbatches: int, costs: Costs) -> Order:
        return type(self)._generator(num_ranks, num_microbatches, costs, gather=self._search_gather)


def _check_v_stages(name: str, stages: list[Any]) -> None:
    """Refuse stage lists that V placement cannot run, with the fix in the message."""
    if len(stages) != 2:
        raise ValueError(
            f"{name}: needs exactly 2 stages on this rank (V placement: stages r and 2d-1-r), "
            f"got {len(stages)}; split the model into 2 * pipeline-size stages and give each rank its two"
        )
    group_size = stages[0].group_size
    rank = stages[0].group_rank
    num_stages = stages[0].num_stages
    if num_stages != 2 * group_size:
        raise ValueError(
            f"{name}: num_stages must be 2 * pipeline size = {2 * group_size}, got {num_stages}; "
            "split the model into exactly two stages per rank"
        )
    indices = [getattr(s, "stage_index", None) for s in stages]
    if not all(isinstance(i, int) for i in indices):
        return  # mock stages (torch's get_schedule_ops) carry no real stage_index
    expected = v_stages(rank, group_size)
    if sorted(indices) != sorted(expected):
        raise ValueError(
            f"{name}: rank {rank} holds stages {sorted(indices)}, but V placement needs stages "
            f"{list(expected)} (r and 2d-1-r with d={group_size}); "
            "build rank r's stages from model chunks r and 2d-1-r"
        )


class ScheduleVMin(_VSchedule):
    """V-Min: about 1/3 of 1F1B's activation memory.

    Why: when activations, not parameters, limit the batch or the model size, V-Min frees the most memory
    of the V family. It pays with the largest bubble of the four (and a bubble in every period once F, I, W
    costs differ), so prefer `ScheduleVHalf` unless memory is that tight.
    """

    _generator = staticmethod(v_min_order)


class ScheduleVHalf(_VSchedule):
    """V-Half: about 1/2 of 1F1B's activation memory with a small bubble.

    Why: half the activation memory of 1F1B at a bubble already below 1F1B's; its steady phase has no
    bubble for realistic F/I/W ratios. The memory-saving default.
    """

    _generator = staticmethod(v_half_order)


class ScheduleVZB(_VSchedule):
    """V-ZB: 1F1B's activation memory with a near-zero bubble.

    Why: when 1F1B's memory fits, this is the fastest V order: weight-gradient passes (W) fill the bubbles
    that 1F1B leaves idle. Comparable to torch's ``ScheduleZBVZeroBubble``, but cost-aware.
    """

    _generator = staticmethod(v_zb_order)


class ScheduleVAdaptive(_VSchedule):
    """The lowest-bubble V order whose peak activation memory stays under ``memory_limit``.

    Why: memory budgets rarely sit exactly at V-Min's 1/3, V-Half's 1/2 or 1F1B's 1; this searches the
    orders in between and keeps the fastest that fits. ``memory_limit`` is the allowed peak activation
    memory as a fraction of 1F1B's, in (0, 1]. A limit below what any V order can reach raises ValueError.
    """

    def __init__(
        self,
        stages: Sequence[Any],
        n_microbatches: int,
        loss_fn: Callable[..., Any] | None = None,
        args_chunk_spec: tuple[Any, ...] | None = None,
        kwargs_chunk_spec: dict[str, Any] | None = None,
        output_merge_spec: dict[str, Any] | tuple[Any] | None = None,
        scale_grads: bool = True,
        backward_requires_autograd: bool = True,
        *,
        memory_limit: float,
        costs: Costs | Mapping[str, float] | None = None,
        defer_pp_recv: bool = False,
        offload: Any = None,
        offload_inputs: OffloadInputs | Mapping[str, Any] | None = None,
        spread_search: bool = True,
        deferred_w: bool = True,
    ):
        if isinstance(memory_limit, bool) or not isinstance(memory_limit, numbers.Real):
            raise ValueError(
                f"{type(self).__name__}: memory_limit must be a number in (0, 1] (fraction of 1F1B's peak "
                f"activation memory), got {memory_limit!r}"
            )
        if not 0.0 < float(memory_limit) <= 1.0:
            raise ValueError(
                f"{type(self).__name__}: memory_limit must be in (0, 1] (fraction of 1F1B's peak activation "
                f"memory), got {memory_limit!r}; e.g. 0.5 for V-Half's memory, 1.0 for 1F1B's"
            )
        self.memory_limit = float(memory_limit)
        super().__init__(
            stages,
            n_microbatches,
            loss_fn,
            args_chunk_spec,
            kwargs_chunk_spec,
            output_merge_spec,
            scale_grads,
            backward_requires_autograd,
            costs=costs,
            defer_pp_recv=defer_pp_recv,
            offload=offload,
            offload_inputs=offload_inputs,
            spread_search=spread_search,
            deferred_w=deferred_w,
        )

    def _generate(self, num_ranks: int, num_microbatches: int, costs: Costs) -> Order:
        return adaptive_v_order(
            num_ranks, num_microbatches, self.memory_limit, costs, gather=self._search_gather
        )
