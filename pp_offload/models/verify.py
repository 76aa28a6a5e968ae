"""Prove, at split time, that a model's stages chained together compute the unsplit model.

Why: a family's own forward may do more than embed -> layers -> norm -> head (input scalings, logit
scalings, soft-caps, per-layer-type rotary embeddings, ...). A split that misses one still trains, on a
different model. So before splitting, :func:`verify_split` builds a shrunken copy of the model's own config
(`pp_offload.models.shrink`: same class and every non-size setting, few layers covering each layer kind,
random fp32 weights large enough that logit soft-caps and scalings change the result), runs it unsplit and
as chained stages on a packed batch, and compares the logits and every parameter's gradient. Any mismatch,
or any failure of the stage code on it, refuses the model with :class:`UnsupportedModelError` naming the
family and the size of the difference. Results are cached per config fingerprint; it costs milliseconds
to a few hundred milliseconds. ``split_model(..., verify=False)`` skips it (for experts who checked).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pp_offload.models.chain import chain_stages
from pp_offload.models.families import UnsupportedModelError
from pp_offload.models.router_aux import router_aux_of
from pp_offload.models.shrink import ShrinkError, shrunken_config

__all__ = ["SplitCheck", "check_split", "verify_split"]

MAX_PARAMS = 5_000_000  # a shrunken copy beyond this is not small: refuse rather than spend seconds
RTOL = 1e-5  # stage chaining runs the same ops in the same order: differences are rounding at most
_SEQ = 12
_BATCH = 2
_cache: dict[str, SplitCheck] = {}


@dataclass(frozen=True)
class SplitCheck:
    """The outcome of one proof: ``ok``, the largest logit and gradient differences relative to the
    reference's largest magnitude, and why it failed (``reason``, empty when ok)."""

    ok: bool
    logits_rel: float = 0.0
    grad_rel: float = 0.0
    worst: str = ""
    reason: str = ""


def fingerprint(model: nn.Module) -> str:
    """What the proof depends on: the model class, its config and its attention implementation."""
    config = model.config
    try:
        text = config.to_json_string(use_diff=False)
    except (TypeError, ValueError):
        text = repr(sorted(config.to_dict().items()))
    key = json.dumps([type(model).__module__, type(model).__qualname__, text, config._attn_implementation])
    return hashlib.sha256(key.encode()).hexdigest()


def _randomize(model: nn.Module, head: nn.Module | None) -> None:
    """Weights of unit-ish scale (biases and norm weights perturbed, not left at their 0/1 init, so a
    missed bias or norm shows), and a head large enough that a logit soft-cap or scale is not ~identity."""
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 1.0 / max(p.shape[-1], 1) ** 0.5)
            else:
                p.add_(torch.randn_like(p) * 0.1)
        if head is not None and getattr(head, "weight", None) is not None:
            head.weight.mul_(8.0)


def _batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (_BATCH, _SEQ), generator=gen)
    positions = torch.cat([torch.arange(7), torch.arange(_SEQ - 7)]).expand(_BATCH, -1)  # two packed docs
    return ids, positions


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    scale = float(b.abs().max()) if b.numel() else 0.0
    diff = float((a - b).abs().max()) if b.numel() else 0.0
    if diff != diff:  # NaN
        return float("inf")
    return diff / scale if scale > 0 else diff


class _Refused(Exception):
    """Internal: the proof cannot go on; ``args[0]`` is the reason."""


_CPU_ATTENTION = ("eager", "sdpa")


def _build_small(model: nn.Module) -> nn.Module:
    """The shrunken fp32 copy, on the CPU. A GPU-only attention kernel (flash attention, ...) is replaced
    by sdpa (or eager, for families without sdpa): the kernel computes attention inside a layer, the
    same in the unsplit model and in the stages, and is not what a split can get wrong."""
    try:
        small_config = shrunken_config(model.config)
    except ShrinkError as exc:
        raise _Refused(f"no small copy of the config to prove the split on: {exc}") from exc
    if int(getattr(small_config, "vocab_size", 0) or 0) <= 0:
        raise _Refused("the config has no vocab_size")
    wanted = small_config._attn_implementation
    kernels = [wanted] if wanted in _CPU_ATTENTION else list(_CPU_ATTENTION)
    failure: Exception | None = None
    for attn in kernels:
        try:
            with torch.device("meta"):
                skeleton = type(model)._from_config(small_config, attn_implementation=attn)
            count = sum(p.numel() for p in skeleton.parameters())
            if count > MAX_PARAMS:
                raise _Refused(f"the shrunken copy still has {count:,} parameters (sub-configs not shrunk)")
            return (
                type(model)._from_config(small_config, attn_implementation=attn, dtype=torch.float32).train()
            )
        except _Refused:
            raise
        except Exception as exc:  # transformers' own constructor on the shrunken config
            failure = exc
    raise _Refused(f"could not build the shrunken copy: {type(failure).__name__}: {failure}")


def _chained_logits(
    small: nn.Module,
    split_fn: Callable[..., Any],
    ids: torch.Tensor,
    positions: torch.Tensor,
    num_stages: int,
) -> tuple[torch.Tensor, torch.Tensor | None, set[str]]:
    layers = _layer_count(small)
    stages = min(num_stages, layers)
    per = [layers // stages + (1 if s < layers % stages else 0) for s in range(stages)]
    try:
        split = split_fn(
            small, num_stages=stages, stage_indices=list(range(stages)), layers_per_stage=per, verify=False
        )
        torch.manual_seed(1)
        h, aux = chain_stages([split.stages[s] for s in range(stages)], ids, position_ids=positions)
    except UnsupportedModelError as exc:
        raise _Refused(str(exc)) from exc
    except Exception as exc:
        raise _Refused(f"the stage forward fails: {type(exc).__name__}: {exc}") from exc
    return h, aux, {n for n, _ in split.module.named_parameters()}


def _compare(
    small: nn.Module,
    got: torch.Tensor,
    want: torch.Tensor,
    want_grads: dict[str, torch.Tensor],
    held: set[str],
) -> SplitCheck:
    logits_rel = _rel(got.detach(), want.detach())
    grad_rel, worst = 0.0, ""
    for name, p in small.named_parameters():
        ref = want_grads.get(name)
        if ref is None and p.grad is None:
            continue
        if name not in held and ref is not None and float(ref.abs().max()) > 0:
            return SplitCheck(
                ok=False,
                logits_rel=logits_rel,
                grad_rel=float("inf"),
                worst=name,
                reason=f"parameter {name} is used by the model but held by no stage",
            )
        zeros = torch.zeros_like(p)
        rel = _rel(p.grad if p.grad is not None else zeros, ref if ref is not None else zeros)
        if rel > grad_rel:
            grad_rel, worst = rel, name
    if logits_rel <= RTOL and grad_rel <= RTOL:
        return SplitCheck(ok=True, logits_rel=logits_rel, grad_rel=grad_rel, worst=worst)
    reason = (
        f"chained stages differ from the unsplit model: logits by {logits_rel:.3g} (relative to their "
        f"largest magnitude), gradients by {grad_rel:.3g} (worst: {worst})"
    )
    return SplitCheck(ok=False, logits_rel=logits_rel, grad_rel=grad_rel, worst=worst, reason=reason)


def check_split(model: nn.Module, split_fn: Callable[..., Any], *, num_stages: int = 3) -> SplitCheck:
    """Run the proof for ``model``'s class and config (``split_fn`` is ``split_model``); never raises for
    a model problem: the returned :class:`SplitCheck` says what went wrong."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        try:
            small = _build_small(model)
            _randomize(small, small.get_output_embeddings())
            ids, positions = _batch(int(small.config.vocab_size))
            # a requested router aux loss is part of the objective: its gradient reaches every router
            try:
                requested = router_aux_of(small)
            except UnsupportedModelError as exc:
                raise _Refused(str(exc)) from exc
            extra = _router_logits_kwargs(small) if requested is not None else {}
            try:
                torch.manual_seed(1)
                output = small(input_ids=ids, position_ids=positions, use_cache=False, **extra)
            except Exception as exc:
                raise _Refused(f"the unsplit shrunken model fails: {type(exc).__name__}: {exc}") from exc
            want = output.logits
            want_aux = output.aux_loss if requested is not None else None
            weight = torch.randn(want.shape, generator=torch.Generator().manual_seed(2)) / want.numel() ** 0.5
            ((want * weight).sum() + (want_aux if want_aux is not None else 0.0)).backward()
            want_grads = {n: p.grad.clone() for n, p in small.named_parameters() if p.grad is not None}
            small.zero_grad(set_to_none=True)
            got, got_aux, held = _chained_logits(small, split_fn, ids, positions, num_stages)
            if got.shape != want.shape:
                raise _Refused(
                    f"the last stage returns shape {tuple(got.shape)}, the model {tuple(want.shape)}"
                )
            if (got_aux is None) != (want_aux is None):
                raise _Refused(f"the model's router aux loss is {want_aux}, the stages' {got_aux}")
            ((got * weight).sum() + (got_aux if got_aux is not None else 0.0)).backward()
        except _Refused as refused:
            return SplitCheck(ok=False, reason=str(refused))
        if want_aux is not None:
            coef_error = _coefficient_error(small, ids, positions, float(want_aux.detach()))
            if coef_error:
                return SplitCheck(ok=False, reason=coef_error)
        if got_aux is not None and want_aux is not None:  # compared with the logits: both are outputs
            got = torch.cat([got.detach().flatten(), got_aux.detach().reshape(1)])
            want = torch.cat([want.detach().flatten(), want_aux.detach().reshape(1)])
        return _compare(small, got, want, want_grads, held)


def _router_logits_kwargs(model: nn.Module) -> dict[str, Any]:
    """``output_router_logits=True`` for a forward that takes it: the config asks for the aux loss, and some
    transformers versions' forwards default the argument to False instead of reading the config (JetMoE in
    5.17), so the reference would otherwise leave out what the stages compute."""
    import inspect

    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}
    return {"output_router_logits": True} if "output_router_logits" in params else {}


def _coefficient_error(small: nn.Module, ids: torch.Tensor, positions: torch.Tensor, aux: float) -> str:
    """Why the aux loss's weight the loss function will use is not the model's own (empty if it is).

    The weight is read from attributes (`pp_offload.models.router_aux`); the model's forward with labels
    says what it really adds: ``loss - cross entropy = coef x aux``.
    """
    import torch.nn.functional as F

    coef = router_aux_of(small).coef  # type: ignore[union-attr]
    try:
        with torch.no_grad():
            torch.manual_seed(1)
            out = small(
                input_ids=ids,
                labels=ids,
                position_ids=positions,
                use_cache=False,
                **_router_logits_kwargs(small),
            )
            ce = F.cross_entropy(out.logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
            implied = (float(out.loss) - float(ce)) / aux
    except Exception as exc:  # the model's own forward with labels
        return f"the unsplit shrunken model fails with labels: {type(exc).__name__}: {exc}"
    if abs(implied - coef) <= 1e-3 * abs(coef) + 1e-6:
        return ""
    return f"the model weighs its router aux loss by {implied:.4g}, the stages' loss would by {coef:.4g}"


def _layer_count(model: nn.Module) -> int:
    """The number of decoder layers the split sees (some configs count differently: LongCat's
    num_hidden_layers is twice its layer modules)."""
    from pp_offload.models.families import family_of

    family = family_of(model)
    return len(getattr(getattr(model, family.base), family.layers))


def verify_split(model: nn.Module, split_fn: Callable[..., Any]) -> SplitCheck:
    """Raise :class:`UnsupportedModelError` unless the proof passes for ``model``'s class and config
    (cached per fingerprint)."""
    key = fingerprint(model)
    result = _cache.get(key)
    if result is None:
        result = check_split(model, split_fn)
        _cache[key] = result
    if not result.ok:
        family = getattr(model.config, "model_type", type(model).__name__)
        raise UnsupportedModelError(
            f"{type(model).__name__} (model_type={family!r}) is refused: the split could not be proven exact "
            f"on a shrunken copy of its config. {result.reason}. If you have checked the split another way, "
            "split_model(..., verify=False) (recipe: model.verify_split: false) skips this proof."
        )
    return result
