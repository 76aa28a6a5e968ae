"""Which Hugging Face causal LMs split exactly: every causal-LM model type of the installed transformers.

Why a sweep and not a hand-kept list: transformers adds families every release and changes their forwards.
For each model type registered for ``AutoModelForCausalLM``, the sweep builds a tiny model from the
family's default config (shrunken by `pp_offload.models.shrink`), calls :func:`split_model` on it (so the
split-time proof runs), and, when the split is accepted, checks independently (another batch, four stages)
that chained stages give the unsplit logits and gradients. Each family ends as

- ``exact``: accepted, and the independent check agrees;
- ``refused``: :class:`UnsupportedModelError`, with its reason;
- ``untested``: no tiny model could be built from the default config (transformers' own constructor
  fails or the result is not small); ``split_model`` refuses such a family too, since its proof needs one;
- ``wrong`` or ``crash``: a bug in this library (accepted but different, or another exception).

``python -m pp_offload families`` prints the table; ``bench/bench_families.py`` writes it to
``bench/results/families.json`` with the cost of each proof.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from pp_offload.models.families import UnsupportedModelError, family_of
from pp_offload.models.shrink import ShrinkError, shrunken_config

__all__ = ["FamilyResult", "causal_lm_types", "chained_difference", "sweep", "sweep_one", "tiny_model"]

RTOL = 1e-5
MAX_PARAMS = 5_000_000  # a tiny model beyond this means nested sub-configs were not shrunk


@dataclass(frozen=True)
class FamilyResult:
    """One model type's outcome (see the module docstring); ``proof_s`` is the split-time proof's cost
    (uncached, wall clock), ``proof_cpu_s`` its CPU time (what it costs on an unshared core; the wall clock
    on a shared machine also counts the neighbours), ``has_pp_plan`` whether its config declares
    ``base_model_pp_plan``."""

    model_type: str
    model_class: str
    status: str
    reason: str = ""
    has_pp_plan: bool = False
    proof_s: float | None = None
    logits_rel: float | None = None
    grad_rel: float | None = None
    proof_cpu_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def causal_lm_types() -> list[str]:
    """Every model type registered for ``AutoModelForCausalLM`` in the installed transformers."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def tiny_model(model_type: str, **overrides: Any) -> torch.nn.Module:
    """A tiny random fp32 causal LM of ``model_type``: its default config (with ``overrides``), shrunken.

    Raises :class:`ShrinkError` when the config cannot be made small, and whatever transformers raises when
    it cannot build the model.
    """
    import transformers

    config = transformers.AutoConfig.for_model(model_type, **overrides)
    small = shrunken_config(config)
    cls = transformers.AutoModelForCausalLM._model_mapping[type(config)]
    with torch.device("meta"):
        skeleton = cls._from_config(small)
    count = sum(p.numel() for p in skeleton.parameters())
    if count > MAX_PARAMS:
        raise ShrinkError(f"the shrunken model still has {count:,} parameters (nested configs not shrunk)")
    return cls._from_config(small, dtype=torch.float32).train()


def chained_difference(model: torch.nn.Module, split_model: Any) -> tuple[float, float]:
    """Largest relative (logits, gradient) differences of chained stages from the unsplit model, on a batch
    other than the proof's, with 4 stages (fewer for shallower models) and fresh random weights."""
    from pp_offload.models.verify import _layer_count, _randomize, _rel

    torch.manual_seed(5)
    _randomize(model, model.get_output_embeddings())
    vocab = int(model.config.vocab_size)
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, vocab, (3, 10), generator=gen)
    positions = torch.cat([torch.arange(4), torch.arange(6)]).expand(3, -1)
    want = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    weight = torch.randn(want.shape, generator=gen)
    (want * weight).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    layers = _layer_count(model)
    stages = min(4, layers)
    split = split_model(model, num_stages=stages, stage_indices=list(range(stages)), verify=False)
    from pp_offload.models.chain import chain_stages

    h, _ = chain_stages([split.stages[s] for s in range(stages)], ids, position_ids=positions)
    logits_rel = _rel(h.detach(), want.detach())
    (h * weight).sum().backward()
    grad_rel = 0.0
    for name, p in model.named_parameters():
        ref = grads.get(name, torch.zeros_like(p))
        got = p.grad if p.grad is not None else torch.zeros_like(p)
        grad_rel = max(grad_rel, _rel(got, ref))
    return logits_rel, grad_rel


def sweep_one(model_type: str) -> FamilyResult:
    """Classify one model type; never raises for a model problem."""
    import transformers

    from pp_offload.models import verify
    from pp_offload.models.split import split_model

    try:
        config = transformers.AutoConfig.for_model(model_type)
        name = transformers.AutoModelForCausalLM._model_mapping[type(config)].__name__
    except Exception as exc:  # transformers cannot build this family's default config
        return FamilyResult(model_type, "?", "untested", f"default config: {type(exc).__name__}: {exc}"[:300])
    has_plan = bool(getattr(config, "base_model_pp_plan", None))
    with warnings.catch_warnings(), torch.random.fork_rng(devices=[]):
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        try:  # the family's structure, on a weightless full-size skeleton: refused before any shrinking
            with torch.device("meta"):
                skeleton = transformers.AutoModelForCausalLM._model_mapping[type(config)]._from_config(config)
            family_of(skeleton)
        except UnsupportedModelError as exc:
            return FamilyResult(model_type, name, "refused", str(exc)[:400], has_plan, 0.0)
        except Exception:
            pass  # transformers cannot build it even on meta: tried below at tiny size, reported there
        try:
            model = tiny_model(model_type)
        except Exception as exc:  # ShrinkError or transformers' constructor on the small config
            reason = f"no tiny model: {type(exc).__name__}: {exc}"[:300]
            return FamilyResult(model_type, name, "untested", reason, has_plan)
        verify._cache.clear()
        start, cpu = time.perf_counter(), time.process_time()
        try:
            split_model(model, num_stages=min(2, verify._layer_count(model)), stage_indices=[0])
        except UnsupportedModelError as exc:
            return FamilyResult(
                model_type, name, "refused", str(exc)[:400], has_plan, time.perf_counter() - start
            )
        except Exception as exc:
            return FamilyResult(model_type, name, "crash", f"{type(exc).__name__}: {exc}"[:400], has_plan)
        proof_s, proof_cpu_s = time.perf_counter() - start, time.process_time() - cpu
        try:
            logits_rel, grad_rel = chained_difference(model, split_model)
        except Exception as exc:
            return FamilyResult(
                model_type,
                name,
                "crash",
                f"after the proof: {type(exc).__name__}: {exc}"[:400],
                has_plan,
                proof_s,
            )
    ok = logits_rel <= RTOL and grad_rel <= RTOL
    status = "exact" if ok else "wrong"
    return FamilyResult(model_type, name, status, "", has_plan, proof_s, logits_rel, grad_rel, proof_cpu_s)


def sweep(model_types: Iterable[str] | None = None) -> list[FamilyResult]:
    """:func:`sweep_one` for each of ``model_types`` (default: :func:`causal_lm_types`)."""
    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        return [sweep_one(t) for t in (model_types if model_types is not None else causal_lm_types())]
    finally:
        transformers.logging.set_verbosity(verbosity)
