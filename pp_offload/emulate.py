"""Pipeline stages whose compute is emulated by sleeping, and a harness that times real schedule steps.

Why this exists: on a CPU box the realized step time of a pipeline schedule depends on how many cores the
ranks share, which says nothing about the schedule. A stage that *sleeps* for its forward (F), its
input-grad (I) and its weight-grad (W) pass costs the same wall time however many ranks share a core,
so a real multi-process run on gloo measures what the runtime adds to the simulator's prediction
(communication, Python overhead, waiting) and nothing else.

The stage still computes real (tiny) values, ``y = h + h @ w``, with exact gradients for ``h`` and ``w``,
so losses and grads stay meaningful and can be compared across schedules. The trick that gives I and W
separate costs: ``y`` is the sum of two autograd branches,

    y = _InputPath(h, w.detach())  +  _WeightPath(h.detach(), w)
        forward: h + h @ w             forward: zeros
        backward: dh = g + g @ w.T     backward: dw = h.T @ g       (sleeps I / sleeps W)

torch's ``stage_backward_input`` calls ``autograd.grad`` w.r.t. the stage input only, so autograd runs
the input branch alone (the weight branch does not lead to the input); ``stage_backward_weight`` then
re-enters the graph at the ``add`` node with the saved output grad and runs the weight branch alone.
A full backward (``B``) runs both: I + W.

What torch does on the first stage (torch 2.13, ``PipelineStage.backward_one_chunk`` /
``backward_weight_one_chunk``): with split backward, stage 0 *skips* its I action entirely (nothing is
computed, it only stashes the output grad) and runs one full ``stage_backward`` at its W action. So on
stage 0 the I slot costs ~0 and the W slot costs I + W; the total is right, its placement in time is not
what an order with separate I/W assumes. A real model behaves the same (the input-grad work of stage 0's
layers is needed by its earlier layers' weight grads), provided that work is in the graph at all: the
pipeline input does not require grad, so a naive emulated stage 0 would have no input branch to run and
would come out at W only. The first stage therefore scales its input by an ``embed`` parameter
(``h = x * embed``), which puts the input branch on the path to a parameter: its full backward costs
I + W, like a real first stage. ``pp_offload.sim.as_executed_by_torch`` rewrites an order the way torch
executes it (stage 0's I dropped, its W turned into a B) so the simulator can predict either reading.

Activation memory: a stage built with ``saved_bytes=n`` also saves an ``n``-byte tensor for its weight-grad
branch in every forward, so it is freed exactly when autograd frees a real layer's saved activations (after
W, or B; never at I, whose graph is retained for W). `saved_activation_bytes` counts those tensors while
they are alive, per process: its peak is the activation memory a schedule really held on this rank, as the
runtime executed it (receive buffers and forward outputs not included).
"""

from __future__ import annotations

import statistics
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pp_offload.runtime.catalog import stage_indices

__all__ = [
    "EmulatedStage",
    "PassCosts",
    "SavedBytes",
    "StepTiming",
    "build_stages",
    "emulated_modules",
    "measure_p2p_latency",
    "saved_activation_bytes",
    "sleep_until",
    "stage_indices",
    "time_schedule",
]

# time.sleep overshoots by ~0.1-0.2 ms (timer slack, wake-up latency): sleep until this close to the
# deadline, then spin. A spin of at most this long per pass keeps the CPU load negligible.
_SPIN_S = 3e-4


def sleep_until(deadline: float) -> None:
    """Return at ``time.perf_counter() >= deadline``, late by microseconds rather than by timer slack."""
    remaining = deadline - time.perf_counter()
    if remaining > _SPIN_S:
        time.sleep(remaining - _SPIN_S)
    while time.perf_counter() < deadline:
        pass


@dataclass(frozen=True)
class PassCosts:
    """Wall-clock seconds of one microbatch's forward, input-grad and weight-grad pass on one stage."""

    F: float
    I: float
    W: float

    def __post_init__(self) -> None:
        for name in ("F", "I", "W"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"PassCosts.{name} must be >= 0, got {getattr(self, name)!r}")

    def scaled(self, factor: float) -> PassCosts:
        return PassCosts(self.F * factor, self.I * factor, self.W * factor)


PassLog = list[tuple[str, float, float]]
"""(kind, start, end) per emulated pass, kinds "F", "I", "W"; times are ``time.perf_counter()``."""


class _InputPath(torch.autograd.Function):
    """``h + h @ w`` whose backward yields only ``dh`` (``w`` comes in detached) and sleeps I."""

    @staticmethod
    def forward(ctx, h, w, cost_s, log):
        ctx.save_for_backward(w)
        ctx.cost_s, ctx.log = cost_s, log
        return h + h @ w

    @staticmethod
    def backward(ctx, grad):
        start = time.perf_counter()
        (w,) = ctx.saved_tensors
        grad_h = grad + grad @ w.t()
        sleep_until(start + ctx.cost_s)
        ctx.log.append(("I", start, time.perf_counter()))
        return grad_h, None, None, None


class SavedBytes:
    """Bytes of emulated activations alive in this process (``live``) and their high-water mark (``peak``)."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0

    def reset_peak(self) -> None:
        """Start a new high-water mark from what is alive now (e.g. before a step)."""
        self.peak = self.live

    def _alloc(self, numel: int) -> torch.Tensor:
        ballast = torch.empty(numel, dtype=torch.uint8)  # never written: costs no time, counted by size
        self.live += numel
        self.peak = max(self.peak, self.live)
        weakref.finalize(ballast, self._free, numel)
        return ballast

    def _free(self, numel: int) -> None:
        self.live -= numel


_SAVED = SavedBytes()


def saved_activation_bytes() -> SavedBytes:
    """This process's meter of the ``saved_bytes`` tensors of every `EmulatedStage` in it."""
    return _SAVED


class _WeightPath(torch.autograd.Function):
    """Contributes zeros to the output but carries ``dw = h.T @ g`` in its backward, and sleeps W.

    ``ballast`` (a tensor or None) is saved with ``h``: it stands for the layer's saved activations and
    lives as long as autograd keeps this node's saved tensors (until the W or B pass that runs it)."""

    @staticmethod
    def forward(ctx, h, w, cost_s, log, ballast=None):
        ctx.save_for_backward(h, ballast)
        ctx.cost_s, ctx.log = cost_s, log
        return h.new_zeros(h.shape[:-1] + w.shape[-1:])

    @staticmethod
    def backward(ctx, grad):
        start = time.perf_counter()
        h, _ = ctx.saved_tensors
        grad_w = h.reshape(-1, h.shape[-1]).t() @ grad.reshape(-1, grad.shape[-1])
        sleep_until(start + ctx.cost_s)
        ctx.log.append(("W", start, time.perf_counter()))
        return None, grad_w, None, None, None


class EmulatedStage(nn.Module):
    """A pipeline stage computing ``y = h + h @ w`` (``h = x * embed`` on the first stage) in F/I/W seconds.

    Every pass is appended to ``self.log`` as ``(kind, start, end)``; clear it between steps. Weights
    are seeded by ``seed`` so that stages built in different processes or for different schedules agree.
    ``saved_bytes``: activation memory each forward saves for backward, held until its W (or B) and
    counted by `saved_activation_bytes` (0: none beyond the tiny input the weight grad needs).
    """

    # Its I and W are the two autograd branches above, run by torch's retained-graph split: deferred W
    # (`pp_offload.runtime.deferred_w`) would run both at I.
    _pp_offload_own_split = True

    def __init__(
        self,
        hidden: int,
        costs: PassCosts,
        *,
        first: bool = False,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        saved_bytes: int = 0,
    ) -> None:
        super().__init__()
        if saved_bytes < 0:
            raise ValueError(f"saved_bytes must be >= 0, got {saved_bytes!r}")
        gen = torch.Generator().manual_seed(seed)
        self.costs = costs
        self.first = first
        self.saved_bytes = int(saved_bytes)
        self.weight = nn.Parameter(
            torch.randn(hidden, hidden, generator=gen, dtype=dtype) * (0.3 / hidden**0.5)
        )
        # Only the first stage: makes the input branch part of the path to a parameter (module docstring).
        self.embed = (
            nn.Parameter(1.0 + 0.1 * torch.randn(hidden, generator=gen, dtype=dtype)) if first else None
        )
        self.log: PassLog = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        h = x * self.embed if self.embed is not None else x
        w = self.weight
        ballast = _SAVED._alloc(self.saved_bytes) if self.saved_bytes and torch.is_grad_enabled() else None
        y = _InputPath.apply(h, w.detach(), self.costs.I, self.log) + _WeightPath.apply(
            h.detach(), w, self.costs.W, self.log, ballast
        )
        sleep_until(start + self.costs.F)
        self.log.append(("F", start, time.perf_counter()))
        return y

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The same function with plain autograd ops (no sleeping): for checking grads."""
        h = x * self.embed if self.embed is not None else x
        return h + h @ self.weight


# ---------------------------------------------------------------------------------------------------------
# Placement


def build_stages(
    rank: int,
    num_ranks: int,
    *,
    costs: PassCosts,
    hidden: int,
    microbatch_size: int,
    placement: str = "v",
    group: dist.ProcessGroup | None = None,
    device: torch.device | str = "cpu",
    seed: int = 0,
    saved_bytes: int = 0,
) -> list[Any]:
    """This rank's ``PipelineStage`` objects over ``EmulatedStage`` modules.

    ``costs`` are per *chunk* (half a rank's layers; one V stage). Chunk ``c`` is seeded with
    ``seed + c``, so every placement computes the same function of the same weights and all schedules
    must agree on the loss. With ``placement="single"`` a rank's one stage is its two chunks in sequence
    (``2r`` then ``2r+1``), i.e. it costs twice a chunk. ``saved_bytes``: each chunk's saved activation
    bytes per microbatch (`EmulatedStage`).
    """
    from torch.distributed.pipelining import PipelineStage

    def chunk(c: int) -> EmulatedStage:
        return EmulatedStage(hidden, costs, first=(c == 0), seed=seed + c, saved_bytes=saved_bytes).to(device)

    num_stages = num_ranks if placement == "single" else 2 * num_ranks

    def example(requires_grad: bool) -> torch.Tensor:
        # torch derives from requires_grad whether a gradient is sent back / expected across the boundary
        return torch.zeros(microbatch_size, hidden, device=device, requires_grad=requires_grad)

    stages = []
    for s in stage_indices(rank, num_ranks, placement):
        module = nn.Sequential(chunk(2 * s), chunk(2 * s + 1)) if placement == "single" else chunk(s)
        stages.append(
            PipelineStage(
                module,
                s,
                num_stages,
                torch.device(device),
                input_args=example(s != 0),
                output_args=example(True),
                group=group,
            )
        )
    return stages


def emulated_modules(stages: Sequence[Any]) -> list[EmulatedStage]:
    """The ``EmulatedStage`` modules inside ``PipelineStage`` objects (or plain modules)."""
    out: list[EmulatedStage] = []
    for st in stages:
        root = getattr(st, "submod", st)
        out.extend(m for m in root.modules() if isinstance(m, EmulatedStage))
    return out


# ---------------------------------------------------------------------------------------------------------
# Multi-process timing


@dataclass
class StepTiming:
    """Realized timings of the timed steps (seconds).

    ``bubble`` = 1 - busiest rank's time inside emulated passes / makespan: comparable with the simulator's
    bubble, since both count only the stated F/I/W costs as compute. ``action_bubbles`` (runtime
    schedules only, from `pp_offload.runtime.timing`) counts whole compute actions, torch's own
    per-action overhead included, so it is the lower of the two.
    """

    makespans: list[float]
    busy: list[list[float]]  # per step, per rank: seconds inside emulated passes
    losses: list[float] = field(default_factory=list)
    action_bubbles: list[float] = field(default_factory=list)

    @property
    def makespan(self) -> float:
        return statistics.median(self.makespans)

    @property
    def bubble(self) -> float:
        return statistics.median(1.0 - max(b) / m for b, m in zip(self.busy, self.makespans, strict=True))

    @property
    def action_bubble(self) -> float | None:
        return statistics.median(self.action_bubbles) if self.action_bubbles else None


def measure_p2p_latency(
    *, shape: Sequence[int], rounds: int = 100, group: dist.ProcessGroup | None = None
) -> float:
    """One-way latency (seconds) of a ``shape`` float tensor between ranks 0 and 1: median round trip / 2.

    Uses ``batch_isend_irecv`` like torch's pipelining runtime. Collective over the group; ranks other
    than 0 and 1 only join the final broadcast. Returns the same value on every rank.
    """
    rank = dist.get_rank(group)
    buf = torch.zeros(*shape)

    def hop(op: Callable[..., Any], peer: int) -> None:
        for work in dist.batch_isend_irecv([dist.P2POp(op, buf, peer, group)]):
            work.wait()

    trips = []
    for _ in range(rounds):
        if rank == 0:
            start = time.perf_counter()
            hop(dist.isend, 1)
            hop(dist.irecv, 1)
            trips.append(time.perf_counter() - start)
        elif rank == 1:
            hop(dist.irecv, 0)
            hop(dist.isend, 0)
    result = torch.tensor([statistics.median(trips) / 2 if trips else 0.0], dtype=torch.float64)
    dist.broadcast(result, src=0, group=group)
    return float(result.item())


def time_schedule(
    schedule: Any,
    stages: Sequence[Any],
    *,
    make_inputs: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    warmup: int = 2,
    steps: int = 5,
    record_actions: bool = True,
    group: dist.ProcessGroup | None = None,
) -> StepTiming:
    """Run ``warmup`` + ``steps`` calls of ``schedule.step`` on every rank and time the last ``steps``.

    ``make_inputs()`` returns the whole batch ``(x, target)``; it is passed to whichever local stage is
    first / last. A step's realized makespan is the latest end minus the earliest start over ranks,
    after a barrier (``perf_counter`` is system-wide on Linux, so the ranks' clocks agree). With
    ``record_actions`` and a schedule on torch's ``_PipelineScheduleRuntime``, the timed steps also run
    under `pp_offload.runtime.timing.record_actions` for the per-action realized bubble. Collective:
    every rank of ``group`` must call it with the same arguments.
    """
    from pp_offload.runtime import compat
    from pp_offload.runtime.timing import ActionTimer, realized_bubble

    world = dist.get_world_size(group)
    modules = emulated_modules(stages)
    has_first = any(st.is_first for st in stages)
    has_last = any(st.is_last for st in stages)
    x, target = make_inputs()
    timing = StepTiming(makespans=[], busy=[])
    for i in range(warmup + steps):
        for mod in modules:
            mod.log.clear()
            mod.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        args = (x,) if has_first else ()
        kwargs = {"target": target, "losses": losses} if has_last else {}
        timer = (
            ActionTimer(schedule)
            if record_actions and i >= warmup and compat.is_runtime_schedule(schedule)
            else None
        )
        dist.barrier(group=group)
        start = time.perf_counter()
        try:
            schedule.step(*args, **kwargs)
        finally:
            end = time.perf_counter()
            if timer is not None:
                timer.detach()
        busy = sum(e - s for mod in modules for _, s, e in mod.log)
        loss = float(torch.stack([v.detach() for v in losses]).sum()) if losses else float("nan")
        mine = torch.tensor([start, end, busy, loss], dtype=torch.float64)
        gathered = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine, group=group)
        if timer is not None:
            timing.action_bubbles.append(realized_bubble(timer.gather(group)))
        if i < warmup:
            continue
        starts, ends = [g[0].item() for g in gathered], [g[1].item() for g in gathered]
        timing.makespans.append(max(ends) - min(starts))
        timing.busy.append([g[2].item() for g in gathered])
        timing.losses.append(next((g[3].item() for g in gathered if g[3] == g[3]), float("nan")))
    return timing
