"""Which parts of a Hugging Face causal LM each pipeline stage needs, per model family.

Why a table and not one code path per model: transformers' decoder families (Llama, Mistral, Qwen2/3,
Gemma, Phi-3, ...) share one shape, declared by their config's ``base_model_pp_plan``: input embedding(s)
-> a list of decoder layers -> a final norm, with the LM head on top and a rotary embedding that every stage
recomputes from the position ids. GPT-2 declares no plan and adds learned position embeddings at the input,
so it gets a row of its own. Anything else is refused with an error that says what is missing, instead of a
split that silently computes something else.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["INPUT_OPS", "LOGIT_OPS", "Family", "UnsupportedModelError", "family_of"]


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
    ``input_ops`` / ``logit_ops`` name what the family's own forward does to the embedding output (first
    stage only), to the final hidden states before the head and to the logits (last stage only): keys of
    :data:`INPUT_OPS` / :data:`LOGIT_OPS`. ``mask_positions`` is false for families whose forward builds
    its attention masks without the position ids (so packed documents are not separated: GPT-OSS, AFMoE).
    ``nope_scaling``: layer kinds without rotary embedding get the model's query scaling (Beam).
    ``rotary_kinds``: the layer kinds that get the (shared) rotary embedding, where the others get none
    (LaraMini: its global layers use no positional encoding); None: every kind gets it.
    ``mask_extra`` / ``layer_extra``: keyword arguments the base model adds to its mask builder and to each
    layer call (Falcon: a materialised mask, ``alibi=None``).
    """

    kind: str
    base: str
    embeddings: tuple[str, ...]
    layers: str
    norm: str
    head: str = "lm_head"
    shared: tuple[str, ...] = ()
    input_ops: tuple[str, ...] = ()
    head_ops: tuple[str, ...] = ()
    logit_ops: tuple[str, ...] = ()
    mask_positions: bool = True
    nope_scaling: bool = False
    rotary_kinds: tuple[str, ...] | None = None
    mask_extra: tuple[tuple[str, Any], ...] = ()
    layer_extra: tuple[tuple[str, Any], ...] = ()


def _softcap(config: Any, logits: torch.Tensor) -> torch.Tensor:
    cap = config.final_logit_softcapping
    return logits if cap is None else torch.tanh(logits / cap) * cap


Op = Callable[[Any, torch.Tensor], torch.Tensor]
# What a family's base model does between the input embedding and the first layer (read from its forward).
INPUT_OPS: dict[str, Op] = {
    "embedding_multiplier": lambda config, h: h * config.embedding_multiplier,  # Granite*
    "mup": lambda config, h: h * config.hidden_size**0.5 if config.mup_enabled else h,  # AFMoE
    # MiniCPM3 divides the final hidden states by logits_scaling before its LM head
    "hidden_logits_scaling": lambda config, h: h / config.logits_scaling,
}
# What a family's causal LM does to the LM head's output (read from its forward).
LOGIT_OPS: dict[str, Op] = {
    "logits_scaling": lambda config, x: x / config.logits_scaling,  # Granite*: logits / logits_scaling
    "logit_scale": lambda config, x: x * config.logit_scale,  # Cohere*: logits * logit_scale
    "final_logit_softcapping": _softcap,  # Gemma2/3/4, VaultGemma: tanh(x / cap) * cap, when cap is set
}
_GRANITE = (("embedding_multiplier",), (), ("logits_scaling",))
_COHERE = ((), (), ("logit_scale",))
_SOFTCAP = ((), (), ("final_logit_softcapping",))
# model_type -> (input ops, ops on the hidden states before the head, logit ops); families not listed do
# none. The split-time proof (`pp_offload.models.verify`) refuses any family whose forward does something
# this table misses.
FAMILY_OPS: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    "afmoe": (("mup",), (), ()),
    "minicpm3": ((), ("hidden_logits_scaling",), ()),
    **dict.fromkeys(
        ("granite", "granite_swa", "granitemoe", "granitemoe_swa", "granitemoeshared", "granitemoehybrid"),
        _GRANITE,
    ),
    **dict.fromkeys(("cohere", "cohere2", "cohere2_moe", "cohere_compass_text"), _COHERE),
    **dict.fromkeys(
        ("gemma2", "gemma3_text", "gemma3n_text", "gemma4_text", "gemma4_unified_text", "vaultgemma", "beam"),
        _SOFTCAP,
    ),
}


_GPT2 = Family(kind="gpt2", base="transformer", embeddings=("wte", "wpe", "drop"), layers="h", norm="ln_f")
# Falcon (no pp plan): rotary, a mask built without position ids and always materialised, alibi=None in each
# layer call (FalconModel.forward). Falcon configs with alibi=True are refused in family_of.
_FALCON = Family(
    kind="decoder",
    base="transformer",
    embeddings=("word_embeddings",),
    layers="h",
    norm="ln_f",
    shared=("rotary_emb",),
    mask_positions=False,
    mask_extra=(("allow_is_causal_skip", False),),
    layer_extra=(("alibi", None),),
)


def family_of(model: Any) -> Family:
    """The :class:`Family` of ``model`` (a transformers ``*ForCausalLM``), or a clear error."""
    config = getattr(model, "config", None)
    if config is None:
        raise UnsupportedModelError(
            f"{type(model).__name__} has no .config: pass a transformers causal LM (AutoModelForCausalLM)"
        )
    name = type(model).__name__
    if getattr(config, "model_type", None) in _GPT2_LIKE:
        family = _GPT2
    elif getattr(config, "model_type", None) == "falcon":
        if getattr(config, "alibi", False):
            raise UnsupportedModelError(
                f"{name} with alibi=True cannot be split: its alibi bias is built from the whole batch's "
                "attention mask inside the base model (rotary Falcon configs split)"
            )
        family = _FALCON
        if _mask_reads_positions(getattr(model, _FALCON.base, None)):
            family = dataclasses.replace(family, mask_positions=True)
    else:
        family = _decoder_family(model, config, name)
    _check_present(model, family, name)
    return family


# Families whose config declares no base_model_pp_plan but whose base model has the same shape (read from
# their modeling files): the plan they would declare.
_PLANS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(
        (
            "granitemoe",
            "granitemoe_swa",
            "granitemoeshared",
            "stablelm",
            "persimmon",
            "nemotron",
            "olmoe",
            "phimoe",
            "hunyuan_v1_dense",
            "hunyuan_v1_moe",
            "llama4_text",
            "bitnet",
            "diffllama",
            "nanochat",
            "jetmoe",
        ),
        ("embed_tokens", "layers", "norm"),
    ),
    "persimmon": ("embed_tokens", "layers", "final_layernorm"),
    **dict.fromkeys(("gptj", "codegen"), ("wte", "drop", "h", "ln_f")),  # rotary inside their attention
}
# GPT-2-shaped families (learned positions added to the token embedding): the GPT-2 stage forward.
_GPT2_LIKE = frozenset({"gpt2", "gpt_bigcode", "gpt_neo"})


# Families whose base model builds attention masks without position_ids (read from their forwards).
_MASKS_WITHOUT_POSITIONS = frozenset({"afmoe", "gpt_oss"})
# Families whose NoPE layer kinds take a position-dependent query scaling instead of rotary embeddings.
_NOPE_SCALING = frozenset({"beam"})
# Families whose base model passes its one rotary embedding to some layer kinds only (read from the forward).
_ROTARY_KINDS = {"lara_mini": ("sliding_attention",)}


_MASK_CALL = re.compile(r"create_(?:sliding_window_)?(?:causal|bidirectional)_mask\(")


def _mask_reads_positions(base: Any) -> bool | None:
    """Whether the installed transformers' forward of ``base`` hands ``position_ids`` to its mask builder.

    Why: the families that built their masks without position ids (so packed documents attend across
    their boundaries) change with transformers releases: Falcon's forward passes them since 5.24. The split
    must build the mask exactly as the unsplit model does, so for those families the installed forward is
    read. None when its source cannot be read (the table's value stands)."""
    return None if base is None else _forward_passes_positions(type(base))


@functools.cache
def _forward_passes_positions(cls: type) -> bool | None:
    """`_mask_reads_positions` for a module class (its source is read once)."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return None
    found = False
    for match in _MASK_CALL.finditer(source):
        depth, end = 1, match.end()
        while end < len(source) and depth:
            depth += {"(": 1, ")": -1}.get(source[end], 0)
            end += 1
        found = True
        if re.search(r"\bposition_ids\s*=", source[match.end() : end]):
            return True
    return False if found else None


def _decoder_family(model: Any, config: Any, name: str) -> Family:
    plan = getattr(config, "base_model_pp_plan", None) or _PLANS.get(getattr(config, "model_type", ""))
    if not plan:
        raise UnsupportedModelError(
            f"{name} (model_type={getattr(config, 'model_type', None)!r}) cannot be split: its config "
            "declares no base_model_pp_plan (supported: GPT-2 and decoder families that declare one, "
            "such as Llama, Mistral, Qwen2, Qwen3, Gemma; `python -m pp_offload families` lists those that "
            "split exactly)"
        )
    names = list(plan)
    layer_keys = [key for key in names if key in ("layers", "h")]
    if not layer_keys:
        raise UnsupportedModelError(f"{name}: base_model_pp_plan {names} has no 'layers' entry")
    at = names.index(layer_keys[0])
    base = getattr(model, "base_model_prefix", None) or "model"
    # stages recompute rotary embeddings from position ids; a base model without one (Kimi-Linear: NoPE
    # layers) passes none to its layers, and so do the stages
    rotary = getattr(getattr(model, base, None), "rotary_emb", None) is not None
    if not hasattr(model, "lm_head"):
        raise UnsupportedModelError(
            f"{name} cannot be split: it has no 'lm_head' (pass a *ForCausalLM model)"
        )
    norms = names[at + 1 :]
    if len(norms) != 1:
        raise UnsupportedModelError(
            f"{name}: expected exactly one module after the layers in base_model_pp_plan, got {norms}"
        )
    input_ops, head_ops, logit_ops = FAMILY_OPS.get(getattr(config, "model_type", ""), ((), (), ()))
    return Family(
        kind="decoder",
        base=base,
        embeddings=tuple(names[:at]),
        layers=names[at],
        norm=norms[0],
        shared=("rotary_emb",) if rotary else (),
        input_ops=input_ops,
        head_ops=head_ops,
        logit_ops=logit_ops,
        mask_positions=getattr(config, "model_type", "") not in _MASKS_WITHOUT_POSITIONS
        or bool(_mask_reads_positions(getattr(model, base, None))),
        nope_scaling=getattr(config, "model_type", "") in _NOPE_SCALING,
        rotary_kinds=_ROTARY_KINDS.get(getattr(config, "model_type", "")),
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
