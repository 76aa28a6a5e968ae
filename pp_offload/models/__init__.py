"""Hugging Face causal LMs as pipeline stages: split, loss, export, LoRA (peft), evaluation."""

from pp_offload.models.evaluate import EvalResult, evaluate_model, evaluate_pipeline
from pp_offload.models.export import export_pretrained
from pp_offload.models.families import UnsupportedModelError, family_of
from pp_offload.models.lora import (
    LoraError,
    apply_lora,
    default_target_modules,
    export_adapter,
    init_adapters,
    is_peft_model,
    merged_state,
    unwrap_peft,
)
from pp_offload.models.loss import IGNORE_INDEX, TokenCrossEntropy
from pp_offload.models.router_aux import RouterAux, router_aux_of
from pp_offload.models.split import (
    CausalLMStage,
    KeptLayers,
    ModelSplit,
    balanced_layers,
    chain_stages,
    split_model,
)

__all__ = [
    "IGNORE_INDEX",
    "TokenCrossEntropy",
    "export_pretrained",
    "EvalResult",
    "LoraError",
    "apply_lora",
    "default_target_modules",
    "evaluate_model",
    "evaluate_pipeline",
    "export_adapter",
    "init_adapters",
    "is_peft_model",
    "merged_state",
    "unwrap_peft",
    "CausalLMStage",
    "KeptLayers",
    "ModelSplit",
    "UnsupportedModelError",
    "RouterAux",
    "balanced_layers",
    "chain_stages",
    "family_of",
    "router_aux_of",
    "split_model",
]
