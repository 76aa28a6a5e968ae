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

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
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


@functools.cache
def _checkpointed_class(cls: type, wrapper: Any) -> type:
    """``cls`` whose class-level ``forward`` runs the class's own forward under ``wrapper`` (a checkpoint
    wrapper of `pp_offload.parallel.fsdp`)."""

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return wrapper(functools.partial(cls.forward, self), *args, **kwargs)

    return type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__})


def _checkpoint_by_class(layer: nn.Module) -> None:
    """Turn the per-instance checkpoint wrappers of ``layer``'s submodules (mlp recompute wraps
    ``layer.mlp.forward``) into a shared class: dynamo guards on the identity of a submodule's instance
    ``forward``, so each layer compiled its own graph (and past ``recompile_limit``, 8, layers ran
    eagerly); with a class, one graph serves them all. The layer's own wrapper is what is compiled, no
    guard is on it."""
    for module in layer.modules():
        if module is layer:
            continue
        forward = vars(module).get("forward")
        if not isinstance(forward, functools.partial) or not forward.args:
            continue
        inner = forward.args[0]
        cls = type(module)
        if getattr(inner, "__self__", None) is module and getattr(inner, "__func__", None) is cls.forward:
            del module.forward
            module.__class__ = _checkpointed_class(cls, forward.func)


def check_recompute_compiles(recompute: str | None) -> None:
    """Refuse a ``+once`` recompute plan under compile. Its checkpoint (`pp_offload.runtime.recompute_once`)
    keeps what I recomputed for W through saved-tensor hooks that dynamo does not trace (the recomputation
    then saves other tensors than the forward: an error at the first backward), and under deferred W, the
    default with compile, every plan recomputes once anyway. Full, selective and mlp recompute compile:
    selective and mlp through torch's selective-checkpoint policy
    (`pp_offload.runtime.recompute.selective_context`)."""
    if recompute is not None and "+once" in recompute:
        raise ValueError(
            f"train.compile with train.activation_checkpointing={recompute!r}: '+once' does not compile and "
            f"is no longer needed (deferred weight gradients recompute each layer once per microbatch); use "
            f"{recompute.replace('+once', '')!r}"
        )


def compile_layers(modules: Iterable[nn.Module], options: CompileOptions | None = None) -> int:
    """Compile each decoder layer of ``modules`` in place; returns how many.

    The layer's ``forward`` is compiled, not the module call (``layer.compile()``): the module's hooks
    stay eager. The runtime hooks decoder layers: budget offload opens and closes a capture of the
    activation store around each layer, the dropout keys seed the generators before it. Traced by
    dynamo, the store's pool bookkeeping became guards that failed at the next microbatch: 3 to 4 graphs
    compiled after the first step on each rank of a 2-rank DualPipeV run with ``budget`` offload, none
    with the hooks left eager. One graph still serves every layer of the class.

    Call after activation checkpointing is applied (the layer's checkpointed forward is what is compiled;
    selective and mlp recompute then go through torch's selective-checkpoint policy, a ``+once`` layer is
    refused) and before the first step; compilation itself happens at the first forward."""
    from pp_offload.parallel.fsdp import checkpointed_mode

    options = options or CompileOptions()
    count = 0
    for module in modules:
        if hasattr(module, "tensor_masks"):  # a CausalLMStage: one graph for packed and unpacked microbatches
            module.tensor_masks = True
        for layer in _layers(module):
            mode, once = checkpointed_mode(layer)
            if once:
                check_recompute_compiles(f"{mode}+once")
            _checkpoint_by_class(layer)
            layer.forward = torch.compile(
                layer.forward, mode=options.mode, backend=options.backend, fullgraph=options.fullgraph
            )
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
