"""Hugging Face causal LMs as pipeline stages: split, loss, export."""

from pp_offload.models.export import export_pretrained
from pp_offload.models.families import UnsupportedModelError, family_of
from pp_offload.models.loss import IGNORE_INDEX, TokenCrossEntropy
from pp_offload.models.split import CausalLMStage, KeptLayers, ModelSplit, balanced_layers, split_model

__all__ = [
    "IGNORE_INDEX",
    "TokenCrossEntropy",
    "export_pretrained",
    "CausalLMStage",
    "KeptLayers",
    "ModelSplit",
    "UnsupportedModelError",
    "balanced_layers",
    "family_of",
    "split_model",
]
