"""Split a Hugging Face causal LM into pipeline stage modules that keep the model's parameter names.

Why modules that keep the names: a stage's ``named_parameters()`` are exactly the unsplit model's
(``model.layers.5.mlp.up_proj.weight``), so checkpoints (torch.distributed.checkpoint) and the final export
map back to the Hugging Face model one to one, whatever the split and placement. Stages share the
parameters with the model they were cut from: nothing is copied, and a weight tied between the input
embedding and the LM head stays one ``Parameter`` when both ends land on one rank (V placement puts stages
0 and 2d-1 on rank 0), so its gradient is the sum of both uses, as in the unsplit model.

Only hidden states cross stage boundaries. Position ids, an optional attention mask and the host's
packed-rows fact (`pp_offload.models.masks`) are keyword arguments of ``schedule.step`` and reach every
stage; each stage recomputes rotary embeddings and attention masks (cheap) exactly as the unsplit model
does, with the mask kind chosen per layer from the config's ``layer_types`` (sliding-window layers stay
sliding-window).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from pp_offload.balance import balanced_layers
from pp_offload.models.chain import chain_stages
from pp_offload.models.families import INPUT_OPS, LOGIT_OPS, Family, UnsupportedModelError, family_of
from pp_offload.models.lora import unwrap_peft
from pp_offload.models.masks import build_mask
from pp_offload.models.router_aux import RouterAux, router_aux_of
from pp_offload.models.verify import verify_split

__all__ = ["CausalLMStage", "KeptLayers", "ModelSplit", "balanced_layers", "chain_stages", "split_model"]


class KeptLayers(nn.ModuleList):
    """Some of a model's decoder layers, registered under their original indices.

    A plain ``ModuleList`` would renumber them (``layers.0`` for the model's layer 5), and the stage's
    parameter names would no longer be the model's. Iteration and positional indexing work as on a list.
    """

    def __init__(self, layers: Mapping[int, nn.Module]) -> None:
        super().__init__()
        for index, layer in sorted(layers.items()):
            self.add_module(str(index), layer)

    def __getitem__(self, idx: Any) -> Any:
        return list(self._modules.values())[idx]

    def indexed(self) -> list[tuple[int, nn.Module]]:
        """``(original layer index, layer)`` pairs in order."""
        return [(int(key), layer) for key, layer in self._modules.items()]


def _trimmed(
    model: nn.Module, family: Family, layer_ids: Iterable[int], first: bool, last: bool
) -> nn.Module:
    """A module tree holding the parts of ``model`` a stage (or a rank) needs, under the model's names."""
    source = getattr(model, family.base)
    layers = getattr(source, family.layers)
    base = nn.Module()
    if first:
        for name in family.embeddings:
            base.add_module(name, getattr(source, name))
    base.add_module(family.layers, KeptLayers({i: layers[i] for i in layer_ids}))
    if last:
        base.add_module(family.norm, getattr(source, family.norm))
    for name in family.shared:
        base.add_module(name, getattr(source, name))
    root = nn.Module()
    root.add_module(family.base, base)
    if last:
        root.add_module(family.head, getattr(model, family.head))
    return root


class CausalLMStage(nn.Module):
    """One pipeline stage of a causal LM: ``forward(x, router_stats=None, position_ids=None,
    attention_mask=None, packed_rows=None)``.

    ``packed_rows`` is the host's answer to "does this row pack several documents?" (a CPU bool tensor per
    row, `pp_offload.models.masks.packed_rows` of the batch's position ids): with it the stage builds its
    attention masks without reading a device tensor (no host synchronization in a training step).

    ``x`` is ``input_ids`` on the first stage and the previous stage's hidden states elsewhere; the last
    stage returns logits, the others hidden states. Built by :func:`split_model`.

    With a router aux loss (``router_aux`` set: the model asked for ``output_router_logits`` with a
    non-zero ``router_aux_loss_coef``) and in train mode, the running router sums travel with the hidden
    states (`pp_offload.models.router_aux`): stages after the first take them as ``router_stats``, stages
    before the last return ``(hidden, router_stats)``, and the last returns ``(logits, aux_loss)`` (the
    microbatch's aux loss, shape ``(1,)``) for
    :class:`~pp_offload.models.loss.TokenCrossEntropy`. In eval mode the stages return what they return
    without it (evaluation measures the language-model loss only).
    """

    def __init__(
        self,
        model: nn.Module,
        family: Family,
        stage_index: int,
        num_stages: int,
        layer_ids: Sequence[int],
        router_aux: RouterAux | None = None,
    ) -> None:
        super().__init__()
        self.router_aux = router_aux
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self.layer_ids = tuple(layer_ids)
        self._family = family
        self._config = model.config
        # tensor masks only, never None (set by `pp_offload.runtime.compile.compile_layers`): one compiled
        # graph for packed and unpacked microbatches (`pp_offload.models.masks.build_mask`'s ``uniform``)
        self.tensor_masks = False
        trimmed = _trimmed(model, family, layer_ids, self.is_first, self.is_last)
        for name, child in trimmed.named_children():
            self.add_module(name, child)

    def extra_repr(self) -> str:
        return f"stage {self.stage_index} of {self.num_stages}, layers {list(self.layer_ids)}"

    @property
    def carries_router_stats(self) -> bool:
        """Whether this forward takes and returns the router aux sums (a router aux loss, train mode)."""
        return self.router_aux is not None and self.training

    def forward(
        self,
        x: torch.Tensor,
        router_stats: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        packed_rows: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        masks = _MaskFacts(attention_mask, packed_rows)
        if not self.carries_router_stats:
            if router_stats is not None:
                raise ValueError(
                    f"stage {self.stage_index} got router_stats but carries none (no router aux loss, or "
                    "eval mode)"
                )
            return self._forward(x, position_ids, masks)
        aux = self.router_aux
        assert aux is not None
        if attention_mask is not None:
            raise ValueError(
                "a padding attention_mask with the router aux loss is not supported: transformers then "
                "leaves padded tokens out of the routing statistics, which the stages do not; pack the "
                "sequences (position_ids, no mask) or set config.output_router_logits = False"
            )
        if router_stats is None:
            if not self.is_first:
                raise ValueError(
                    f"stage {self.stage_index} needs the previous stage's router_stats (the model has a "
                    "router aux loss): pass the previous stage's whole output"
                )
            router_stats = aux.empty(x.device)
        with aux.capture(self) as router_logits:
            out = self._forward(x, position_ids, masks)
        stats = aux.accumulate(router_stats, router_logits)
        # the aux loss as shape (1,), not a scalar: schedule.step's returned outputs concatenate the
        # microbatches' outputs, giving one aux loss per microbatch (a 0-d tensor cannot be concatenated)
        return (out, aux.loss(stats).reshape(1)) if self.is_last else (out, stats)

    def _forward(self, x: torch.Tensor, position_ids: Any, masks: _MaskFacts) -> torch.Tensor:
        base = getattr(self, self._family.base)
        if position_ids is None:
            position_ids = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
            masks = _MaskFacts(masks.attention_mask, torch.zeros(1, dtype=torch.bool))  # one document a row
        if self._family.kind == "gpt2":
            hidden = self._gpt2(base, x, position_ids, masks)
        else:
            hidden = self._decoder(base, x, position_ids, masks)
        if not self.is_last:
            return hidden
        hidden = getattr(base, self._family.norm)(hidden)
        for op in self._family.head_ops:
            hidden = INPUT_OPS[op](self._config, hidden)
        logits = getattr(self, self._family.head)(hidden)
        for op in self._family.logit_ops:
            logits = LOGIT_OPS[op](self._config, logits)
        return logits

    def _decoder(
        self, base: nn.Module, x: torch.Tensor, position_ids: torch.Tensor, facts: _MaskFacts
    ) -> torch.Tensor:
        hidden = getattr(base, self._family.embeddings[0])(x) if self.is_first else x
        if self.is_first:
            for name in self._family.embeddings[1:]:  # modules applied to the embedding (GPT-NeoX's dropout)
                hidden = getattr(base, name)(hidden)
            for op in self._family.input_ops:
                hidden = INPUT_OPS[op](self._config, hidden)
        kinds = {index: _layer_type(self._config, index) for index in self.layer_ids}
        mask_positions = position_ids if self._family.mask_positions else None
        masks = _attention_masks(
            self._config,
            set(kinds.values()),
            hidden,
            facts,
            mask_positions,
            dict(self._family.mask_extra),
            uniform=self.tensor_masks,
        )
        rotary: dict[str, Any] = {}
        if "rotary_emb" not in self._family.shared:
            pass  # no rotary embedding in the base model: its layers get none
        elif _rotary_per_layer_type(base.rotary_emb):
            rotary = {kind: self._rotary(base, hidden, position_ids, kind) for kind in set(kinds.values())}
        else:
            shared = base.rotary_emb(hidden, position_ids)
            given = self._family.rotary_kinds
            rotary = {
                kind: {"position_embeddings": shared if given is None or kind in given else None}
                for kind in kinds.values()
            }
        for index, layer in getattr(base, self._family.layers).indexed():
            extra = {**(rotary[kinds[index]] if rotary else {}), **dict(self._family.layer_extra)}
            out = layer(
                hidden,
                attention_mask=masks[kinds[index]],
                position_ids=position_ids,
                use_cache=False,
                **extra,
            )
            hidden = out[0] if isinstance(out, tuple) else out
        return hidden

    def _rotary(self, base: nn.Module, hidden: torch.Tensor, position_ids: torch.Tensor, kind: str) -> dict:
        """The rotary keyword arguments of a layer of ``kind``, when the rotary embedding depends on the
        layer type: its own frequencies, or none for a NoPE kind (Beam's ``rope_parameters[kind]`` is None,
        and those layers scale queries by the model's ``compute_attention_scaling`` instead)."""
        params = getattr(self._config, "rope_parameters", None)
        if self._family.nope_scaling and isinstance(params, dict) and kind in params and params[kind] is None:
            module = sys.modules[type(base.rotary_emb).__module__]  # the family's modeling file
            return {
                "position_embeddings": None,
                "attention_scaling": module.compute_attention_scaling(position_ids),
            }
        return {"position_embeddings": base.rotary_emb(hidden, position_ids, kind)}

    def _gpt2(
        self, base: nn.Module, x: torch.Tensor, position_ids: torch.Tensor, facts: _MaskFacts
    ) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        hidden = base.drop(base.wte(x) + base.wpe(position_ids)) if self.is_first else x
        causal = build_mask(
            create_causal_mask,
            config=self._config,
            hidden=hidden,
            attention_mask=facts.attention_mask,
            position_ids=position_ids,
            packed=facts.packed_rows,
            uniform=self.tensor_masks,
        )
        for _, block in getattr(base, self._family.layers).indexed():
            out = block(hidden, attention_mask=causal, use_cache=False, position_ids=position_ids)
            hidden = out[0] if isinstance(out, tuple) else out
        return hidden


def _layer_type(config: Any, index: int) -> str:
    """The attention kind of layer ``index``, decided as the unsplit model decides it."""
    types = getattr(config, "layer_types", None)
    if types:
        return types[index]
    return "sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"


def _rotary_per_layer_type(rotary: nn.Module) -> bool:
    """Whether the rotary embedding takes the layer type (Gemma3, Olmo3: one frequency set per kind)."""
    return "layer_type" in inspect.signature(rotary.forward).parameters


class _MaskFacts(NamedTuple):
    """What a stage's masks are built from besides the hidden states and position ids: the caller's
    padding mask and the host's packed-rows fact (`pp_offload.models.masks.packed_rows`)."""

    attention_mask: Any
    packed_rows: torch.Tensor | None


def _attention_masks(
    config: Any,
    kinds: set[str],
    hidden: torch.Tensor,
    facts: _MaskFacts,
    position_ids: torch.Tensor | None,
    family_extra: dict[str, Any] | None = None,
    *,
    uniform: bool = False,
) -> dict[str, Any]:
    """One mask per layer kind, built as the families' base models build them (transformers 5.x), with
    no host read of a device tensor (`pp_offload.models.masks`)."""
    from transformers import masking_utils as mu

    builders: dict[str, tuple[Any, dict[str, Any]]] = {
        "full_attention": (mu.create_causal_mask, {}),
        "sliding_attention": (mu.create_sliding_window_causal_mask, {}),
        "chunked_attention": (mu.create_chunked_causal_mask, {}),
        # DeepSeek-V3.2, GLM-MoE-DSA: a causal mask always materialised, for the indexer
        "indexed_attention": (mu.create_causal_mask, {"allow_is_causal_skip": False}),
    }
    if hasattr(mu, "create_recurrent_attention_mask"):  # Qwen3-Next, MiniMax: padding mask of linear layers
        builders["linear_attention"] = (mu.create_recurrent_attention_mask, {})
    masks: dict[str, Any] = {}
    for kind in kinds:
        if kind not in builders:
            raise UnsupportedModelError(f"layer attention type {kind!r} is not supported by the stage split")
        build, extra = builders[kind]
        masks[kind] = build_mask(
            build,
            config=config,
            hidden=hidden,
            attention_mask=facts.attention_mask,
            position_ids=position_ids,
            packed=facts.packed_rows,
            kind=kind,
            extra={**extra, **(family_extra or {})},
            uniform=uniform,
        )
    return masks


@dataclass
class ModelSplit:
    """This rank's part of a split model.

    ``stages`` maps stage index -> :class:`CausalLMStage` for the stages this rank holds;
    ``module`` holds all of them together under the model's parameter names (one entry per parameter,
    tied weights once): give it to the optimizer, to ``torch.distributed.checkpoint`` and to the export.
    ``layers_per_stage`` is the split of the whole model. ``router_aux``: the model's router aux loss
    when it asks for one (its stages then carry the router sums; the loss function weighs the loss).
    """

    stages: dict[int, CausalLMStage]
    module: nn.Module
    layers_per_stage: list[int]
    family: Family
    router_aux: RouterAux | None = None

    @property
    def stage_indices(self) -> list[int]:
        return list(self.stages)


def _head_work(model: nn.Module, family: Family) -> float:
    """Work of the LM head (and of the embedding) in decoder-layer units: parameters over a layer's.

    The head's matmul has as many multiply-adds per token as it has parameters, like a layer's linear
    maps; the embedding's lookup is cheap but its gradient and optimizer update are the same size.
    """
    layers = getattr(getattr(model, family.base), family.layers)
    per_layer = sum(p.numel() for p in layers[0].parameters())
    head = getattr(model, family.head).weight.numel()
    return head / max(per_layer, 1)


def split_model(
    model: nn.Module,
    *,
    num_stages: int,
    stage_indices: Sequence[int],
    layers_per_stage: Sequence[int] | None = None,
    verify: bool = True,
) -> ModelSplit:
    """Cut a transformers causal LM into ``num_stages`` stages and return the ones in ``stage_indices``.

    ``layers_per_stage`` overrides the automatic split (contiguous layers, balanced with the embedding and
    the LM head counted as work). Put the model in train mode and on its device before or after; the stages
    share its parameters. A peft ``PeftModel`` is split underneath its wrapper (LoRA layers and peft's
    parameter names kept).

    ``verify`` (default on) first proves the split on a shrunken copy of the model's config
    (`pp_offload.models.verify`): chained stages must give the unsplit logits and gradients, or the model is
    refused with :class:`UnsupportedModelError`. The proof is cached per config; ``verify=False`` skips it.
    """
    model = unwrap_peft(model)  # a PeftModel: split the model it wraps, LoRA layers and peft names kept
    family = family_of(model)
    source = getattr(model, family.base)
    extra = [name for name in family.embeddings[1:] if not isinstance(getattr(source, name), nn.Dropout)]
    if family.kind == "decoder" and extra:
        raise UnsupportedModelError(
            f"{type(model).__name__}: expected one input embedding (and dropout) before 'layers', got "
            f"{family.embeddings}"
        )
    router_aux = router_aux_of(model)  # None unless output_router_logits with a non-zero coefficient
    if verify:
        verify_split(model, split_model)
    layers = getattr(getattr(model, family.base), family.layers)
    num_layers = len(layers)
    bad = [s for s in stage_indices if not 0 <= s < num_stages]
    if bad or len(set(stage_indices)) != len(stage_indices):
        raise ValueError(f"stage_indices {list(stage_indices)} must be distinct and in [0, {num_stages})")
    if layers_per_stage is None:
        extra = _head_work(model, family)
        split = balanced_layers(num_layers, num_stages, first_extra=extra, last_extra=extra)
    else:
        split = [int(n) for n in layers_per_stage]
        if len(split) != num_stages or sum(split) != num_layers or min(split) < 0:
            raise ValueError(
                f"layers_per_stage {split} must have {num_stages} non-negative entries summing to the "
                f"model's {num_layers} layers"
            )
    starts = [sum(split[:s]) for s in range(num_stages)]
    stages = {
        s: CausalLMStage(model, family, s, num_stages, range(starts[s], starts[s] + split[s]), router_aux)
        for s in stage_indices
    }
    held = sorted(i for stage in stages.values() for i in stage.layer_ids)
    module = _trimmed(model, family, held, 0 in stages, num_stages - 1 in stages)
    return ModelSplit(
        stages=stages, module=module, layers_per_stage=split, family=family, router_aux=router_aux
    )
