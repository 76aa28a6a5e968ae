"""Dropout that does not depend on the schedule: every dropout mask keyed to (seed, step, microbatch, site).

Why: dropout draws from the process's random number generator, whose state at a given layer depends on
everything drawn before it on that rank: which stages the rank holds, in which order the schedule runs the
microbatches' forwards, whether offload or recompute ran first. So with dropout on, the same model, data and
seed gave different losses under V-Half and Interleaved1F1B, and neither equalled the unsplit model's.

Here, right before each dropout *site* runs its forward (a decoder layer, or the embedding's dropout module),
a forward pre-hook seeds the generator of the input's device (the CPU's for a CPU input) from a key derived
from ``(seed, step, global microbatch, site)``, and a forward hook puts the generator's previous state back,
so nothing around the site sees a difference. A site's masks are then a function of the key alone: the same
for every schedule, split, placement, offload policy and recompute plan, and for one process running the
unsplit model microbatch by microbatch with the same keys (`DropoutKeys.running`). Cost: a few tens of
microseconds of host time per site and microbatch (Python hooks, a hash, a seed), nothing on the device.

Sites: each decoder layer (its index in the whole model; everything random inside it, attention dropout in
the SDPA kernel, residual and MLP dropout, peft's ``lora_dropout``, a router's jitter, draws from the keyed
state in the layer's own order) and each ``nn.Dropout`` among the family's embedding modules (GPT-2's
``drop``, GPT-NeoX's ``emb_dropout``; site `EMBEDDING`). A dropout module with p > 0 anywhere else in a
stage is not keyed: `unkeyed_dropout` names it, and the recipe prints it on the console.

Recompute: the checkpointed forward runs inside the layer's module call, after the pre-hook, and
``torch.utils.checkpoint`` (``preserve_rng_state=True``, the default) stashes the keyed state and restores it
for the recomputation, so the recomputed masks are the forward's. A checkpoint taken around the whole module
call (transformers' own gradient checkpointing) runs the hooks again while recomputing: the runtime then
still names the microbatch being run (`key_schedule` sets it for backward passes too), so the key is the
same.

Which microbatch and step: `key_schedule` wraps each pipeline stage's ``forward_one_chunk``,
``backward_one_chunk`` and ``backward_weight_one_chunk`` (the offload runtime wraps the same methods, the
order does not matter) to set `DropoutKeys.microbatch` to ``microbatch_offset + chunk id``; under data
parallelism the offset is ``dp rank x microbatches``, the replica's first microbatch in the global batch.
The training loop sets `DropoutKeys.step`. In eval mode, and outside a microbatch, the hooks do nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "EMBEDDING",
    "DropoutKeys",
    "dropout_sites",
    "key_dropout",
    "key_pipeline_dropout",
    "key_schedule",
    "unkeyed_dropout",
]

EMBEDDING = -1
"""The site index of the embedding's dropout (decoder layers are sites 0, 1, ... by their model index)."""

_HOOKS = "_pp_offload_dropout_key_hooks"


@dataclass
class DropoutKeys:
    """The key state of one process: the run's ``seed``, the optimizer ``step`` and, while a pass runs, the
    global ``microbatch`` (None outside one: the sites then draw from the generators as they are)."""

    seed: int = 0
    step: int = 0
    microbatch: int | None = None

    def seed_for(self, site: int) -> int:
        """The generator seed of ``site`` for the current step and microbatch: a hash of the four numbers
        (63 bits), so nearby steps, microbatches and layers get unrelated streams."""
        if self.microbatch is None:
            raise RuntimeError("no microbatch is running: set DropoutKeys.microbatch (or use running())")
        packed = struct.pack("<4q", int(self.seed), int(self.step), int(self.microbatch), int(site))
        return int.from_bytes(hashlib.blake2b(packed, digest_size=8).digest(), "little") >> 1

    @contextlib.contextmanager
    def running(self, microbatch: int) -> Iterator[DropoutKeys]:
        """Name ``microbatch`` as the one running, for its forward and backward (a one-process reference
        that runs the model microbatch by microbatch)."""
        previous, self.microbatch = self.microbatch, int(microbatch)
        try:
            yield self
        finally:
            self.microbatch = previous


def dropout_sites(module: nn.Module, family: Any = None) -> list[tuple[int, nn.Module]]:
    """``(site, module)`` of a causal LM (a transformers model, peft-wrapped or not), a pipeline stage
    (`pp_offload.models.split.CausalLMStage`) or a rank's `ModelSplit.module`: the decoder layers it holds,
    by their index in the whole model, and its embedding dropout (`EMBEDDING`)."""
    from pp_offload.models.families import family_of
    from pp_offload.models.lora import unwrap_peft
    from pp_offload.models.split import KeptLayers

    module = unwrap_peft(module)
    if family is None:
        family = getattr(module, "_family", None) or family_of(module)
    base = getattr(module, family.base, None)
    if base is None:
        return []
    sites: list[tuple[int, nn.Module]] = []
    layers = getattr(base, family.layers, None)
    if layers is not None:
        sites += layers.indexed() if isinstance(layers, KeptLayers) else list(enumerate(layers))
    for name in family.embeddings:
        child = getattr(base, name, None)
        if isinstance(child, nn.Dropout):
            sites.append((EMBEDDING, child))
    return sites


def key_dropout(modules: Any, keys: DropoutKeys) -> list[tuple[int, nn.Module]]:
    """Key the dropout of ``modules`` to ``keys``: a causal LM, a `ModelSplit` (its stages) or a list of
    stage modules. Replaces hooks an earlier call installed on the same sites (the recipe builds a probe
    pipeline before the real one on the same model). Returns the keyed sites."""
    stages = _stage_modules(modules)
    family = getattr(modules, "family", None)
    found: dict[int, tuple[int, nn.Module]] = {}
    for stage in stages:
        for site, child in dropout_sites(stage, family):
            found.setdefault(id(child), (site, child))
    for site, child in found.values():
        _install(child, site, keys)
    return list(found.values())


def unkeyed_dropout(modules: Any) -> list[str]:
    """Names of the ``nn.Dropout`` modules with p > 0 outside every keyed site of ``modules`` (as
    `key_dropout` takes them): their masks still depend on the schedule."""
    stages = _stage_modules(modules)
    family = getattr(modules, "family", None)
    names: list[str] = []
    for stage in stages:
        inside = {id(m) for _, site in dropout_sites(stage, family) for m in site.modules()}
        for name, child in stage.named_modules():
            if (
                isinstance(child, nn.Dropout)
                and child.p > 0
                and id(child) not in inside
                and name not in names
            ):
                names.append(name)
    return names


def key_schedule(schedule: Any, keys: DropoutKeys, *, microbatch_offset: int = 0) -> None:
    """Tell ``keys`` which microbatch each pass of ``schedule`` (a torch pipeline schedule) runs: its
    stages' forward and backward passes set `DropoutKeys.microbatch` to ``microbatch_offset`` + the chunk
    id while they run."""
    from pp_offload.runtime import compat

    compat.wrap_stage_compute(
        compat.schedule_stages(schedule), lambda method: _running(method, keys, microbatch_offset)
    )


def key_pipeline_dropout(split: Any, schedule: Any, *, seed: int, offset: int = 0) -> DropoutKeys:
    """`key_dropout` on a rank's `ModelSplit` and `key_schedule` on its schedule, with one `DropoutKeys`
    (returned: set its ``step`` before each step). ``offset``: the global index of this data-parallel
    replica's first microbatch (``dp rank x microbatches``)."""
    keys = DropoutKeys(seed=int(seed))
    key_dropout(split, keys)
    key_schedule(schedule, keys, microbatch_offset=offset)
    return keys


def _running(original: Any, keys: DropoutKeys, offset: int) -> Any:
    def run(chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        with keys.running(offset + int(chunk_id)):
            return original(chunk_id, *args, **kwargs)

    return run


def _stage_modules(modules: Any) -> list[nn.Module]:
    stages = getattr(modules, "stages", None)
    if isinstance(stages, dict):  # a ModelSplit
        return list(stages.values())
    if isinstance(modules, nn.Module):
        return [modules]
    return list(modules)


def _generators(device: torch.device | None) -> list[torch.Generator]:
    """The generator the site's random ops draw from: the input's device's default generator (a CUDA
    tensor's dropout never touches the CPU one), the CPU generator for CPU (or meta) inputs."""
    if device is not None and device.type not in ("cpu", "meta"):
        backend = getattr(torch, device.type, None)
        defaults = getattr(backend, "default_generators", ())
        if defaults:
            index = device.index if device.index is not None else backend.current_device()
            if index < len(defaults):
                return [defaults[index]]
    return [torch.default_generator]


def _device(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device
    return None


def _install(module: nn.Module, site: int, keys: DropoutKeys) -> None:
    for handle in getattr(module, _HOOKS, ()):
        handle.remove()
    saved: list[list[tuple[torch.Generator, torch.Tensor]] | None] = []

    def seed(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not mod.training or keys.microbatch is None:
            saved.append(None)
            return
        gens = _generators(_device(args, kwargs))
        saved.append([(g, g.get_state()) for g in gens])
        number = keys.seed_for(site)
        for g in gens:
            g.manual_seed(number)

    def restore(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        states = saved.pop() if saved else None
        for g, state in states or ():
            g.set_state(state)

    handles = [
        module.register_forward_pre_hook(seed, with_kwargs=True),
        module.register_forward_hook(restore, with_kwargs=True, always_call=True),
    ]
    setattr(module, _HOOKS, handles)
