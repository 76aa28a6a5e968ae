"""The data pipeline of the Hugging Face fine-tuning recipe: load, tokenize and pack, then batch.

    config = DataConfig(path="embedded", seq_len=128)
    examples = load_examples(config)                      # a datasets.Dataset with the needed columns
    format_examples(examples, config, tokenizer)          # optional: the texts packing tokenizes, to look at
    packed = pack_examples(examples, tokenizer, config)   # blocks of input_ids / labels / position_ids
    batches = PackedBatches(packed, global_batch_size=32, dp_rank=r, dp_size=n, seed=0)
    batch = batches.batch(step)                           # pure function of (seed, step): resumable

At scale, `prepare` tokenizes and packs once per machine into a content-addressed cache that every rank and
every later run memory-maps (`PackedBatches(prepare(...).blocks, ...)`: each rank copies only its own rows),
and `StreamingBatches` packs a `datasets.IterableDataset` on the fly (``data.streaming``). docs/data.md.

``path="embedded"`` needs no download: the corpus and a tokenizer for it are built from the standard library
(`embedded_assets`). Heavy libraries (datasets, transformers, torch) are imported on first use, so a rank that
only builds the embedded assets starts fast.

Supervised fine-tuning (``prompt_column`` + ``response_column``) can format each prompt first, with a format
string (``prompt_template="### Instruction:\\n{prompt}\\n\\n### Response:\\n"``, other ``{column}``s allowed)
or the tokenizer's chat template (``chat_template=True``); the formatted prompt stays masked from the loss.
"""

from __future__ import annotations

from pp_offload.data.batches import PackedBatches
from pp_offload.data.config import DataConfig
from pp_offload.data.embedded import EmbeddedAssets, default_cache_dir, embedded_assets, embedded_dir
from pp_offload.data.errors import DataError
from pp_offload.data.loading import load_examples
from pp_offload.data.packing import IGNORE_INDEX, format_examples, pack_examples
from pp_offload.data.prepared import Prepared, prepare
from pp_offload.data.streaming import StreamingBatches

__all__ = [
    "IGNORE_INDEX",
    "DataConfig",
    "DataError",
    "EmbeddedAssets",
    "PackedBatches",
    "Prepared",
    "StreamingBatches",
    "default_cache_dir",
    "embedded_assets",
    "embedded_dir",
    "format_examples",
    "load_examples",
    "pack_examples",
    "prepare",
]
