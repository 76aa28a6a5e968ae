"""The MoE router load-balancing (auxiliary) loss of transformers' MoE families, through pipeline stages.

transformers' ``load_balancing_loss_func`` (Mixtral, Qwen2/3-MoE, OLMoE, ...) concatenates the router
logits of ALL layers over the whole forward's tokens: ``aux = E * sum_e f_e * P_e`` with ``f_e`` the share
of (token, top-k slot) pairs routed to expert ``e`` and ``P_e`` the mean router probability of ``e``, both
over every (layer, token) row. The gradient reaching a layer's router is proportional to the GLOBAL
``f_e``, which counts the routing of later stages too, so no stage can add it from local information.

Why two running sums travel with the hidden states: the loss is a function of three sums over layers only
(routed counts per expert, probability sums per expert, rows), which transformers itself accumulates layer
by layer. Each stage adds its layers' terms to a small ``(2, E + 1)`` fp32 tensor received from the stage
before and sends it on with the hidden states; the last stage finishes the loss from the totals. Autograd
sends the probability sums' gradient back through the pipeline's own point-to-point backward, so every
router gets its exact gradient, in the same order of operations as transformers (bit-identical in fp32).
The price is one extra ``2 * (E + 1)`` float tensor per microbatch and stage boundary (64 experts: 520
bytes next to megabytes of hidden states), one more small send/recv each way.

Layout of the running tensor: row 0 = routed (token, slot) counts per expert, then the row count; row 1 =
router probability sums per expert, then 0. Counts are integers held exactly in fp32 below 2**24 rows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pp_offload.models.families import UnsupportedModelError

__all__ = ["RouterAux", "RouterTap", "router_aux_of"]


@dataclass(frozen=True)
class RouterTap:
    """Where router logits come from, as transformers' ``OutputRecorder`` for ``router_logits`` says: the
    forward output (``[index]`` of a tuple) of modules of ``router_class``, narrowed to those whose
    qualified name ends with ``layer_name`` when given."""

    router_class: type[nn.Module]
    index: int = 0
    layer_name: str | None = None

    def matches(self, name: str, module: nn.Module) -> bool:
        return isinstance(module, self.router_class) and (
            self.layer_name is None or name.endswith(self.layer_name)
        )


@dataclass(frozen=True)
class RouterAux:
    """What a stage needs to add its layers' share of the router aux loss.

    ``taps``: where the router logits come from (one per router kind; JetMoE has two). ``coef`` is
    ``router_aux_loss_coef``, applied by the loss function, not by the stage.
    """

    num_experts: int
    top_k: int
    coef: float
    taps: tuple[RouterTap, ...]

    def routers(self, module: nn.Module) -> list[tuple[nn.Module, int]]:
        """``(router module, output index)`` for the routers inside ``module`` (a stage's layers)."""
        found = []
        for name, sub in module.named_modules():
            for tap in self.taps:
                if tap.matches(name, sub):
                    found.append((sub, tap.index))
                    break
        return found

    def empty(self, device: torch.device) -> torch.Tensor:
        """The running sums before the first layer (no gradient: nothing before it)."""
        return torch.zeros(2, self.num_experts + 1, dtype=torch.float32, device=device)

    def accumulate(self, stats: torch.Tensor, router_logits: list[torch.Tensor]) -> torch.Tensor:
        """``stats`` plus the terms of each layer's ``router_logits``, layer by layer as transformers does."""
        counts, probs = stats[0, :-1], stats[1, :-1]
        rows, zero = stats[0, -1:], stats[1, -1:]
        for logits in router_logits:
            logits = logits.reshape(-1, logits.shape[-1])
            weights = torch.softmax(logits, dim=-1)
            _, selected = torch.topk(weights, self.top_k, dim=-1)
            # as transformers counts: histc (no device-to-host sync), on integers on GPUs (deterministic)
            kind = torch.float32 if selected.device.type in ("cpu", "mps") else torch.int32
            routed = torch.histc(
                selected.reshape(-1).to(kind), bins=self.num_experts, min=0, max=self.num_experts
            )
            counts = counts + routed.to(torch.float32)
            probs = probs + weights.float().sum(dim=0)
            rows = rows + logits.shape[0]
        return torch.stack([torch.cat([counts, rows]), torch.cat([probs, zero])])

    def loss(self, stats: torch.Tensor) -> torch.Tensor:
        """The aux loss of one forward (one microbatch) from its final running sums (unweighted by coef)."""
        rows = stats[0, -1]
        tokens_per_expert = stats[0, :-1] / rows
        prob_per_expert = stats[1, :-1] / rows
        return torch.sum(tokens_per_expert * prob_per_expert.unsqueeze(0)) * self.num_experts

    @contextlib.contextmanager
    def capture(self, module: nn.Module) -> Iterator[list[torch.Tensor]]:
        """Collect the router logits computed inside ``module`` while the block runs (hooks removed after,
        so an activation-checkpoint recompute outside the block records nothing twice)."""
        seen: list[torch.Tensor] = []  # in the order the routers run, as transformers records them

        def tap(index: int) -> Any:
            def hook(_mod: nn.Module, _args: Any, output: Any) -> None:
                seen.append(output[index] if isinstance(output, (tuple, list)) else output)

            return hook

        handles = [router.register_forward_hook(tap(index)) for router, index in self.routers(module)]
        try:
            yield seen
        finally:
            for handle in handles:
                handle.remove()


def _coefficient(model: nn.Module) -> float | None:
    """The weight the model's own forward gives the aux loss: its ``router_aux_loss_coef`` attribute
    (``aux_loss_coef`` for JetMoE, whose config has no ``router_aux_loss_coef``), else the config's."""
    for name in ("router_aux_loss_coef", "aux_loss_coef"):
        value = getattr(model, name, None)
        if isinstance(value, (int, float)):
            return float(value)
    return getattr(model.config, "router_aux_loss_coef", None)


def router_aux_of(model: nn.Module) -> RouterAux | None:
    """The router aux loss ``model`` asks for, or None (``output_router_logits`` off or a zero coefficient).

    Raises :class:`UnsupportedModelError` when it is asked for but the model does not say, the way the
    standard transformers MoE families do, which module's output the router logits are and how many experts
    and slots there are: dropping the loss silently would train a different objective.
    """
    config = model.config
    coef = float(_coefficient(model) or 0.0)
    if not getattr(config, "output_router_logits", False) or coef == 0.0:
        return None
    name = type(model).__name__
    refusal = (
        f"{name}: output_router_logits=True (router_aux_loss_coef={coef}) asks for a router aux loss this "
        "model does not compute the standard transformers way"
    )
    fix = "set config.output_router_logits = False to train without it"
    recorders = (getattr(model, "_can_record_outputs", None) or {}).get("router_logits")
    num_experts = getattr(model, "num_experts", None)
    top_k = getattr(model, "num_experts_per_tok", None)
    if recorders is None or not isinstance(num_experts, int) or not isinstance(top_k, int):
        raise UnsupportedModelError(
            f"{refusal} (a router_logits recorder, num_experts, num_experts_per_tok); {fix}"
        )
    taps = tuple(
        RouterTap(r) if isinstance(r, type) else RouterTap(r.target_class, int(r.index or 0), r.layer_name)
        for r in (recorders if isinstance(recorders, (list, tuple)) else [recorders])
    )
    aux = RouterAux(num_experts=num_experts, top_k=top_k, coef=coef, taps=taps)
    if not aux.routers(model):
        raise UnsupportedModelError(f"{refusal} (no router module found in the model); {fix}")
    return aux
