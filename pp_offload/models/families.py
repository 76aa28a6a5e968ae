"""Which parts of a Hugging Face causal LM each pipeline stage needs, per model family.

Why a table and not one code path per model: transformers' decoder families (Llama, Mistral, Qwen2/3,
Gemma, Phi-3, ...) share one shape, declared by their config's ``base_model_pp_plan``: input embedding(s)
-> a list of decoder layers -> a final norm, with the LM head on top and a rotary embedding that every stage
recomputes from the position ids. GPT-2 declares no plan and adds learned position embeddings at the input,
so it gets a row of its own. Anything else is refused with an error that says what is missing, instead of a
split that silently computes something else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Family", "UnsupportedModelError", "family_of"]


class UnsupportedModelError(ValueError):
    """The model cannot be split into pipeline stages; the message names what is missing."""


@dataclass(frozen=True)
class Family:
    """Where a causal LM keeps the parts a pipeline stage needs.

    ``base`` is the attribute of the causal LM holding the base model (``model``, ``transformer``);
    ``embeddings`` the base-model modules only the first stage runs; ``layers`` the decoder layer list;
    ``norm`` the final norm only the last stage runs; ``shared`` parameter-free modules every stage needs
    (the rotary embedding); ``head`` the LM head of the causal LM. ``kind`` picks the stage's forward:
    ``"decoder"`` (rotary, masks per layer type) or ``"gpt2"`` (learned positions, dropout).
    """

    kind: str
    base: str
    embeddings: tuple[str, ...]
    layers: str
    norm: str
    head: str = "lm_head"
    shared: tuple[str, ...] = ()


_GPT2 = Family(kind="gpt2", base="transformer", embeddings=("wte", "wpe", "drop"), layers="h", norm="ln_f")


def family_of(model: Any) -> Family:
    """The :class:`Family` of ``model`` (a transformers ``*ForCausalLM``), or a clear error."""
    config = getattr(model, "config", None)
    if config is None:
        raise UnsupportedModelError(
            f"{type(model).__name__} has no .config: pass a transformers causal LM (AutoModelForCausalLM)"
        )
    name = type(model).__name__
    if getattr(config, "model_type", None) == "gpt2":
        family = _GPT2
    else:
        family = _decoder_family(model, config, name)
    _check_present(model, family, name)
    return family


def _decoder_family(model: Any, config: Any, name: str) -> Family:
    plan = getattr(config, "base_model_pp_plan", None)
    if not plan:
        raise UnsupportedModelError(
            f"{name} (model_type={getattr(config, 'model_type', None)!r}) cannot be split: its config "
            "declares no base_model_pp_plan (supported: GPT-2 and decoder families that declare one, "
            "such as Llama, Mistral, Qwen2, Qwen3, Gemma)"
        )
    names = list(plan)
    layer_keys = [key for key in names if key == "layers"]
    if not layer_keys:
        raise UnsupportedModelError(f"{name}: base_model_pp_plan {names} has no 'layers' entry")
    at = names.index("layers")
    base = getattr(model, "base_model_prefix", None) or "model"
    if getattr(getattr(model, base, None), "rotary_emb", None) is None:
        raise UnsupportedModelError(
            f"{name} cannot be split: its base model {base!r} has no shared 'rotary_emb' module "
            "(stages recompute rotary embeddings from position ids)"
        )
    if not hasattr(model, "lm_head"):
        raise UnsupportedModelError(
            f"{name} cannot be split: it has no 'lm_head' (pass a *ForCausalLM model)"
        )
    norms = names[at + 1 :]
    if len(norms) != 1:
        raise UnsupportedModelError(
            f"{name}: expected exactly one module after 'layers' in base_model_pp_plan, got {norms}"
        )
    return Family(
        kind="decoder",
        base=base,
        embeddings=tuple(names[:at]),
        layers="layers",
        norm=norms[0],
        shared=("rotary_emb",),
    )


def _check_present(model: Any, family: Family, name: str) -> None:
    base = getattr(model, family.base, None)
    if base is None:
        raise UnsupportedModelError(f"{name} has no base model at .{family.base}")
    missing = [
        f"{family.base}.{part}"
        for part in (*family.embeddings, family.layers, family.norm, *family.shared)
        if getattr(base, part, None) is None
    ]
    if getattr(model, family.head, None) is None:
        missing.append(family.head)
    if missing:
        raise UnsupportedModelError(f"{name} cannot be split: missing module(s) {', '.join(missing)}")
