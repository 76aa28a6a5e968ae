"""Regional ``torch.compile``: each decoder layer compiled in place, under any schedule.

Why per layer: a stage is a slice of a model whose layers share one class, so compiling the layer (not the
stage) gives one graph that every layer of every stage reuses (torch inlines module parameters as graph
inputs), a short first step, and stage modules torch's own schedules accept (they refuse a stage wrapped by
``torch.compile``). Why it is safe with split backward: pp-offload's split-backward schedules defer weight
gradients (`pp_offload.runtime.deferred_w`), so a compiled layer's backward runs once per microbatch, in I;
a stage left on torch's retained-graph split with a compiled layer is refused before the first step.

Hand-built stages::

    from pp_offload.runtime.compile import compile_layers
    compile_layers(stage_modules)                   # before building PipelineStage / the schedule
    schedule = build_schedule(info, stages, m, ...)  # deferred W for split-backward schedules

The recipe's ``train.compile: true`` (or ``{mode: ..., backend: ..., fullgraph: ...}``) does the same and
prints, once, the compile time of the first step and the number of graphs compiled after it (0 expected).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from pp_offload.runtime import compat

__all__ = ["CompileOptions", "CompileWatch", "check_recompute_compiles", "compile_layers"]


@dataclass(frozen=True)
class CompileOptions:
    """``torch.compile``'s ``mode`` (None: default), ``backend`` and ``fullgraph`` for each layer."""

    mode: str | None = None
    backend: str = "inductor"
    fullgraph: bool = False

    @classmethod
    def coerce(cls, value: bool | Mapping[str, Any] | CompileOptions | None) -> CompileOptions | None:
        """``train.compile``: false/None (no compile), true (defaults), or a mapping of the fields."""
        if isinstance(value, CompileOptions):
            return value
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if not isinstance(value, Mapping):
            raise ValueError(
                "train.compile must be true, false or a mapping like {mode: max-autotune, backend: inductor, "
                f"fullgraph: false}}, got {value!r}"
            )
        unknown = sorted(set(value) - {"mode", "backend", "fullgraph"})
        if unknown:
            raise ValueError(f"train.compile: unknown keys {unknown}; known: mode, backend, fullgraph")
        options = cls(**dict(value))
        if options.mode is not None and not isinstance(options.mode, str):
            raise ValueError(f"train.compile.mode must be a torch.compile mode name, got {options.mode!r}")
        if not isinstance(options.backend, str) or not isinstance(options.fullgraph, bool):
            raise ValueError(
                f"train.compile: backend must be a name and fullgraph true/false, got {options.backend!r}, "
                f"{options.fullgraph!r}"
            )
        return options


def _layers(module: nn.Module) -> list[nn.Module]:
    """The module's decoder layers: its largest ``nn.ModuleList`` (the HF split keeps ``model.layers``)."""
    lists = [m for m in module.modules() if isinstance(m, nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def check_recompute_compiles(recompute: str | None) -> None:
    """Refuse selective and MLP-only recompute under compile: their dispatch modes
    (`pp_offload.runtime.recompute`) run inside ``torch.utils.checkpoint`` through a ``context_fn`` dynamo
    cannot trace (an internal dynamo error at the first step). Full recompute compiles."""
    if recompute is not None and any(mode in recompute for mode in ("selective", "mlp")):
        raise ValueError(
            f"train.compile with train.activation_checkpointing={recompute!r}: selective and mlp recompute "
            "run dispatch modes that torch.compile cannot trace; use full recompute (true) or none with "
            "compile, or turn compile off"
        )


def compile_layers(modules: Iterable[nn.Module], options: CompileOptions | None = None) -> int:
    """Compile each decoder layer of ``modules`` in place (``layer.compile(...)``); returns how many.

    Call after activation checkpointing is applied (the layer's checkpointed forward is what is compiled)
    and before the first step; compilation itself happens at the first forward."""
    options = options or CompileOptions()
    count = 0
    for module in modules:
        for layer in _layers(module):
            layer.compile(mode=options.mode, backend=options.backend, fullgraph=options.fullgraph)
            count += 1
    return count


class CompileWatch:
    """Prints once, after the second step, how long the first step spent compiling and how many graphs
    were compiled after it (a recompilation each step would cost its compile time every step)."""

    def __init__(self, layers: int) -> None:
        self.layers = layers
        self.steps = 0
        self.first: tuple[float, int] | None = None

    def after_step(self, say: Any) -> None:
        self.steps += 1
        seconds, graphs = compat.compile_counters()
        if self.steps == 1:
            self.first = (seconds, graphs)
        elif self.steps == 2 and self.first is not None:
            recompiles = graphs - self.first[1]
            say(
                f"compile: {self.layers} layers, {self.first[1]} graphs, {self.first[0]:.1f} s compiling in "
                f"the first step, {recompiles} graphs compiled after it"
            )
