"""Pipeline-parallel fine-tuning of a Hugging Face causal LM.

    torchrun --nproc-per-node 2 recipes/finetune.py --config recipes/configs/tiny_llama.yaml
    accelerate launch --config_file recipes/accelerate_cpu.yaml recipes/finetune.py \
        --config recipes/configs/tiny_llama.yaml

Options: ``python recipes/finetune.py --help``; the configuration keys are documented in docs/config.md
(generated from ``pp_offload/recipe/config.py``) and the recipe in docs/recipe.md.
"""

import sys

from pp_offload.recipe.cli import main

if __name__ == "__main__":
    sys.exit(main())
