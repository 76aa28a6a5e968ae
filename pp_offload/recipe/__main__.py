"""``python -m pp_offload.recipe``: the fine-tuning recipe's command line."""

import sys

from pp_offload.recipe.cli import main

sys.exit(main())
