"""What activation recompute costs on this machine, measured on one real decoder layer of the probed model.

Why measure: the planner's recompute model prices a recomputation from HBM traffic and FLOPs
(`pp_offload.plan.costs.recompute_seconds`), which has no per-op cost. Where ops are small (a CPU rehearsal,
a small model, a short sequence) the cost is mostly per-op: selective recompute runs a Python dispatch mode
over every aten op of the forward and of each recomputation (`pp_offload.runtime.recompute`), and
checkpointing adds hooks to the forward itself, which the traffic model does not charge at all. On the CPU
bench (`bench/bench_hotpath.py`: Llama, hidden 256, seq 256) the traffic model priced selective at +5% of
the step where it costs +25-40%, and full recompute at a layer forward as the probe sees it (its stage's
forward over its layers, which holds the stage's mask building, the activation store's capture hooks and
the action bookkeeping: +65-74% predicted for +40-46% measured).

What is measured: the probe captures one decoder layer's real inputs (its microbatch's hidden states,
mask, rotary embeddings: the probe's own shapes, on the probe's device, under the step's autocast) and
`calibrate_recompute` times that layer plain and under each recompute mode, applied with
`pp_offload.parallel.activation_checkpointing` (the code path training runs): its forward; forward + one
full backward (one autograd call over the input and the trainable parameters: B); forward + the input's
gradient keeping the graph + the parameters' (I then W, as a split backward runs them). Rounds alternate
the modes and the fastest of each figure is kept, so a disturbance on a shared machine lengthens one
sample, not one mode. The differences to the plain layer are the mode's `ModeCost`:

- ``forward``: what a recomputed layer's forward costs beyond the plain one (checkpoint hooks, selective's
  output-caching mode);
- ``input`` / ``weight`` / ``backward``: what one recomputation adds to an I, a W and a full backward
  pass: the price of each recomputation `pp_offload.recompute_plan.recomputations` counts.

`pp_offload.plan.auto.RecomputeOption.apply` adds these seconds as they are (per recomputed layer) when the
measurement carries them, and falls back to the traffic model's shares otherwise (`pp-offload plan`, which
has no probe). Why seconds and not shares here: they are the probe's own device and shapes, so nothing
needs rescaling, and a share would need "the layer's forward" from the probe's stage forward, which holds
more than the layer. Why one layer: every decoder layer has the same shapes and ops, and the calibration
stays cheap (a few dozen passes of one layer: 0.2 s for the tests' tiny Llama, 1-2 s at the bench's
shape on one CPU core; ``budget_s`` caps the rounds).

Pure Python at import: torch is imported by `calibrate_recompute` only.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

__all__ = ["CALIBRATED_MODES", "ModeCost", "RecomputeCalibration", "calibrate_recompute", "layer_inputs"]

CALIBRATED_MODES = ("full", "selective", "mlp")
"""The recompute modes the probe times by default (`pp_offload.recompute_plan.MODES` less ``none``)."""


@dataclass(frozen=True)
class ModeCost:
    """Seconds one decoder layer under a recompute mode costs beyond the same layer without recompute.

    forward: added to each forward of the layer (checkpoint hooks; selective's caching mode).
    input, weight: added to the input-gradient pass (I) and to the weight-gradient pass (W) of a split
        backward, each of which recomputes the layer once.
    backward: added to a full backward (B: one autograd call for both gradients), which recomputes once;
        also what torch's first stage runs at W (its whole backward).

    Why I and W apart from B: a split pass redoes the recomputation on its own, and what it costs differs
    by pass (W's recomputation also runs the ops I's backward did not need; selective's replaying mode
    dispatches every op again); a share of one figure would misprice one of them.
    """

    forward: float
    input: float
    weight: float
    backward: float

    def __post_init__(self) -> None:
        for name in ("forward", "input", "weight", "backward"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ValueError(f"ModeCost.{name} must be a number >= 0 (seconds), got {value!r}")


@dataclass(frozen=True)
class RecomputeCalibration:
    """One decoder layer's measured times (seconds, fastest of ``rounds``): its plain ``forward`` and
    ``backward``, and per recompute mode its `ModeCost`. ``shape``: the layer input's shape it was timed
    on; ``device``: where."""

    forward: float
    backward: float
    modes: Mapping[str, ModeCost] = field(default_factory=dict)
    rounds: int = 0
    shape: tuple[int, ...] = ()
    device: str = "unknown"

    def __post_init__(self) -> None:
        for name in ("forward", "backward"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ValueError(
                    f"RecomputeCalibration.{name} must be a number >= 0 (seconds), got {value!r}"
                )
        modes = {str(k): v if isinstance(v, ModeCost) else ModeCost(**v) for k, v in dict(self.modes).items()}
        object.__setattr__(self, "modes", modes)
        object.__setattr__(self, "shape", tuple(int(x) for x in self.shape))

    def cost(self, mode: str) -> ModeCost | None:
        """``mode``'s measured cost; zero for ``none``; None when it was not measured."""
        if mode == "none":
            return ModeCost(0.0, 0.0, 0.0, 0.0)
        return self.modes.get(mode)

    def to_dict(self) -> dict[str, Any]:
        return {
            "forward": self.forward,
            "backward": self.backward,
            "modes": {k: asdict(v) for k, v in self.modes.items()},
            "rounds": self.rounds,
            "shape": list(self.shape),
            "device": self.device,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RecomputeCalibration:
        return cls(**dict(data))

    @classmethod
    def combine(cls, found: Sequence[RecomputeCalibration]) -> RecomputeCalibration | None:
        """The per-figure median of several ranks' calibrations (each rank timed its own layer while the
        others did too, as in a step); modes measured on every rank only. None when ``found`` is empty."""
        import statistics

        if not found:
            return None
        modes = set.intersection(*(set(c.modes) for c in found))
        return cls(
            forward=statistics.median(c.forward for c in found),
            backward=statistics.median(c.backward for c in found),
            modes={
                m: ModeCost(
                    **{
                        f.name: statistics.median(getattr(c.modes[m], f.name) for c in found)
                        for f in fields(ModeCost)
                    }
                )
                for m in sorted(modes)
            },
            rounds=min(c.rounds for c in found),
            shape=found[0].shape,
            device=found[0].device,
        )

    def summary(self) -> str:
        """One line: the layer's times and each mode's costs in ms."""
        parts = [f"layer forward {self.forward * 1e3:.3f} ms, backward {self.backward * 1e3:.3f} ms"]
        parts += [
            f"{m} +{c.forward * 1e3:.3f} ms forward, +{c.input * 1e3:.3f} / {c.weight * 1e3:.3f} / "
            f"{c.backward * 1e3:.3f} ms in I / W / B"
            for m, c in self.modes.items()
        ]
        return f"recompute measured on {self.device} {list(self.shape)}: " + "; ".join(parts)


def layer_inputs(layer: Any) -> tuple[dict[str, Any], Callable[[], None]]:
    """Hook ``layer`` to keep (detached) the positional and keyword arguments of its latest call; returns
    the holder (``args``, ``kwargs`` once called, and ``autocast``: the (device type, dtype) autocast
    ran the call under, or None) and the undo. A key/value cache (transformers'
    ``Cache``, which a training forward does not use) is kept as None: a cache grows with every call."""
    import torch
    from transformers.cache_utils import Cache

    held: dict[str, Any] = {}

    def keep(value: Any) -> Any:
        if isinstance(value, Cache):
            return None
        return value.detach() if isinstance(value, torch.Tensor) else value

    def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        held["args"] = tuple(_map(keep, a) for a in args)
        held["kwargs"] = {k: _map(keep, v) for k, v in kwargs.items()}
        device = next((t.device.type for t in args if isinstance(t, torch.Tensor)), "cpu")
        enabled = torch.is_autocast_enabled(device)
        held["autocast"] = (device, torch.get_autocast_dtype(device)) if enabled else None

    handle = layer.register_forward_pre_hook(hook, with_kwargs=True)
    return held, handle.remove


def _map(fn: Callable[[Any], Any], value: Any) -> Any:
    if isinstance(value, tuple):
        return tuple(_map(fn, v) for v in value)
    if isinstance(value, list):
        return [_map(fn, v) for v in value]
    return fn(value)


def calibrate_recompute(
    layer: Any,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any] | None = None,
    *,
    modes: Sequence[str] = CALIBRATED_MODES,
    rounds: int = 5,
    budget_s: float = 2.0,
    autocast: tuple[str, Any] | None = None,
) -> RecomputeCalibration:
    """Time ``layer`` (a decoder layer without checkpointing) on its real inputs ``args``/``kwargs`` plain and
    under each of ``modes`` (module doc); the layer is given back as it was.

    The first floating-point tensor of ``args`` (else ``kwargs["hidden_states"]``) is the layer input whose
    gradient the backward computes, as the pipeline's I pass does; the backward also computes the
    gradients of the layer's trainable parameters, in one autograd call (B: one recomputation), without
    touching their ``.grad``; and, as a split backward does, the input's gradient (I, keeping the graph)
    then the parameters' (W). ``rounds``: timed rounds after one warm-up round (at least 2 run; more stop
    once ``budget_s`` seconds have passed). On CUDA each timing is bracketed by synchronizations.
    ``autocast``: (device type, dtype) to run under, as the training step does (`layer_inputs` notes it).
    Like any use of `activation_checkpointing`, it installs
    `pp_offload.runtime.compat.share_weight_pass_recomputation` (process-wide, idempotent, gradients
    unchanged), so a run that then picks recompute finds it in place.
    """
    import torch

    from pp_offload.parallel import activation_checkpointing
    from pp_offload.runtime.deferred_w import own_forwards

    kwargs = dict(kwargs or {})
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be an int >= 1, got {rounds!r}")
    wanted = [m for m in dict.fromkeys(modes) if m != "none"]
    for mode in wanted:
        if mode not in CALIBRATED_MODES:
            raise ValueError(f"calibrate_recompute modes must be among {CALIBRATED_MODES}, got {mode!r}")
    wrapped = [m for m in (layer, getattr(layer, "mlp", None)) if m is not None and "forward" in vars(m)]
    if wrapped:
        raise ValueError(
            f"calibrate_recompute needs a layer without checkpointing; {type(layer).__name__} already has a "
            "wrapped forward (train.activation_checkpointing set?)"
        )
    position = next(
        (i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point()), None
    )
    source = args[position] if position is not None else kwargs.get("hidden_states")
    if not isinstance(source, torch.Tensor) or not source.is_floating_point():
        raise ValueError("calibrate_recompute found no floating-point layer input (hidden states) in args")
    params = [p for p in layer.parameters() if p.requires_grad]
    sync = torch.cuda.synchronize if source.device.type == "cuda" else (lambda: None)
    grad_out: list[Any] = []

    def run(split: bool) -> tuple[float, float, float]:
        """One forward and backward: (forward, I or B, W or 0) seconds."""
        x = source.detach().requires_grad_(True)
        call_args = list(args)
        call_kwargs = dict(kwargs)
        if position is not None:
            call_args[position] = x
        else:
            call_kwargs["hidden_states"] = x
        marks = []
        cast = torch.autocast(autocast[0], dtype=autocast[1]) if autocast else contextlib.nullcontext()
        with torch.enable_grad(), cast:
            sync()
            marks.append(time.perf_counter())
            out = layer(*call_args, **call_kwargs)
            out = out[0] if isinstance(out, (tuple, list)) else out
            if not grad_out:
                grad_out.append(torch.ones_like(out))
            sync()
            marks.append(time.perf_counter())
            if split and params:
                torch.autograd.grad(out, [x], grad_outputs=grad_out[0], retain_graph=True)
                sync()
                marks.append(time.perf_counter())
                torch.autograd.grad(out, params, grad_outputs=grad_out[0])
            else:
                torch.autograd.grad(out, [x, *params], grad_outputs=grad_out[0])
            sync()
            marks.append(time.perf_counter())
        spans = [b - a for a, b in zip(marks, marks[1:], strict=False)]
        return spans[0], spans[1], spans[2] if len(spans) > 2 else 0.0

    every = ["none", *wanted]
    best: dict[tuple[str, str], float] = {}
    done = 0
    began = time.perf_counter()
    # A layer of a deferred-W pipeline (`pp_offload.runtime.deferred_w`) is timed with its linears' own
    # forward: the two autograd calls below split I and W as torch does, which a deferring layer cannot.
    with own_forwards(layer):
        try:
            for round_ in range(rounds + 1):  # round 0 warms up
                for mode in every:
                    activation_checkpointing([layer], layers=lambda m: [m], mode=mode)
                    for split in (True, False):
                        f, first, second = run(split)
                        if not round_:
                            continue
                        for key, seconds in (("F", f), ("I" if split else "B", first), ("W", second)):
                            if key != "W" or split:
                                best[mode, key] = min(best.get((mode, key), math.inf), seconds)
                done = round_
                if round_ >= 2 and time.perf_counter() - began > budget_s:
                    break
        finally:
            activation_checkpointing([layer], layers=lambda m: [m], mode="none")
    costs = {
        mode: ModeCost(*(max(0.0, best[mode, key] - best["none", key]) for key in ("F", "I", "W", "B")))
        for mode in wanted
    }
    forward, backward = best["none", "F"], best["none", "B"]
    return RecomputeCalibration(
        forward=forward,
        backward=backward,
        modes=costs,
        rounds=done,
        shape=tuple(source.shape),
        device=str(source.device),
    )
