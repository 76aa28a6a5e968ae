"""Continued pretraining of GPT-2 on a text dataset, pipeline-parallel (pp-offload's V-ZB schedule, bf16).

Plain language modelling: documents are packed into blocks of 1024 tokens and every token is learned. Every
process runs this script; the result is a plain Hugging Face model in <output-dir>/export.

1 node x 4 GPUs (GPT-2 has 12 layers and a V schedule holds 2 stages per rank: at most 6 ranks; use
--model gpt2-medium, 24 layers, for 8 or 12):
    torchrun --nproc-per-node 4 hf_examples/continued_pretraining_gpt2.py --output-dir runs/gpt2
    accelerate launch --config_file recipes/accelerate_gpu.yaml --num_processes 4 \
        hf_examples/continued_pretraining_gpt2.py --output-dir runs/gpt2
2 nodes x 8 GPUs (on every node; NODE=0 or 1, MAIN=node 0's address; GPT-2 XL has 48 layers):
    torchrun --nnodes 2 --node-rank $NODE --nproc-per-node 8 --master-addr $MAIN --master-port 29500 \
        hf_examples/continued_pretraining_gpt2.py --model gpt2-xl --output-dir /shared/gpt2
    accelerate launch --config_file recipes/accelerate_gpu.yaml --num_machines 2 --num_processes 16 \
        --machine_rank $NODE --main_process_ip $MAIN --main_process_port 29500 \
        hf_examples/continued_pretraining_gpt2.py --model gpt2-xl --output-dir /shared/gpt2
With several nodes the output dir must be on a shared filesystem (every rank writes its part of the
checkpoints and of the export there). Offline smoke test: tiny random GPT-2, embedded corpus, 2 CPU processes:
    torchrun --nproc-per-node 2 hf_examples/continued_pretraining_gpt2.py --tiny --steps 3 --output-dir /tmp/g
"""

import argparse
import os
import sys

from pp_offload.data import DataConfig
from pp_offload.recipe import ModelConfig, OutputConfig, PipelineConfig, RecipeConfig, TrainConfig
from pp_offload.recipe.train import run

TINY_GPT2 = {"model_type": "gpt2", "n_embd": 64, "n_layer": 4, "n_head": 4, "n_positions": 128,
             "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--model", default="gpt2", help="hub id or local directory")
p.add_argument("--dataset", default="Salesforce/wikitext", help="hub dataset or local .txt/.jsonl/.parquet")
p.add_argument("--dataset-config", help="the hub dataset's config (default dataset: wikitext-103-raw-v1)")
p.add_argument("--text-column", default="text")
p.add_argument("--output-dir", default="runs/gpt2")
p.add_argument("--steps", type=int, default=2000)
p.add_argument("--schedule", default="ScheduleVZB", help="e.g. ScheduleVHalf, ScheduleInterleaved1F1B")
p.add_argument("--dp", type=int, default=1,
               help="data-parallel replicas (FSDP2); pipeline ranks: processes / dp")
p.add_argument("--tiny", action="store_true", help="offline smoke test: tiny random GPT-2, embedded corpus")
args = p.parse_args()
if args.dataset == "Salesforce/wikitext" and args.dataset_config is None:
    args.dataset_config = "wikitext-103-raw-v1"

config = RecipeConfig(
    model=ModelConfig(path=args.model),
    data=DataConfig(path=args.dataset, name=args.dataset_config, text_column=args.text_column, seq_len=1024),
    pipeline=PipelineConfig(schedule=args.schedule, dp=args.dp, microbatches=16),
    train=TrainConfig(steps=args.steps, global_batch_size=64, lr=1e-4, warmup_steps=min(100, args.steps),
                      weight_decay=0.1, precision="bf16"),
    output=OutputConfig(dir=args.output_dir, save_every=500, log_every=20),
)
if args.tiny:  # config-built GPT-2, the offline corpus (and its tokenizer), fp32 on CPU
    config.model = ModelConfig(config=TINY_GPT2)
    config.data = DataConfig(path="embedded", seq_len=64, max_examples=600)
    config.pipeline.microbatches, config.train.global_batch_size = 4, 8
    config.train.lr, config.train.precision, config.train.device = 3e-3, "fp32", "cpu"
    config.output.log_every = 1

result = run(config, progress=sys.stderr.isatty())
if os.environ.get("RANK", "0") == "0" and result.losses:  # none when a relaunch finds the run finished
    print(f"cpt: loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}; model in {result.export_dir}")
