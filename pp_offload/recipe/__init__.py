"""The Hugging Face fine-tuning recipe: config, pipeline pieces, checkpoints, training loop and CLI."""

from pp_offload.recipe.config import (
    ConfigError,
    LoraConfig,
    ModelConfig,
    OutputConfig,
    PipelineConfig,
    RecipeConfig,
    TrainConfig,
    load_config,
)

__all__ = [
    "ConfigError",
    "LoraConfig",
    "ModelConfig",
    "OutputConfig",
    "PipelineConfig",
    "RecipeConfig",
    "TrainConfig",
    "load_config",
]
