"""Supervised fine-tuning of a Llama-family model, pipeline-parallel (pp-offload's V-Half schedule, bf16).

Prompts are wrapped in an instruction template (the recipe's DataConfig.prompt_template) and masked from
the loss: only responses (and their eos) are learned. Every process runs this script; the result is a plain
Hugging Face model in <output-dir>/export, and <output-dir>/sft_data.jsonl shows the texts it trained on.

1 node x 8 GPUs:
    torchrun --nproc-per-node 8 hf_examples/sft_llama.py --output-dir runs/sft
    accelerate launch --config_file recipes/accelerate_gpu.yaml hf_examples/sft_llama.py --output-dir runs/sft
2 nodes x 8 GPUs (on every node; NODE=0 or 1, MAIN=node 0's address; a V schedule needs >= 2 layers per rank):
    torchrun --nnodes 2 --node-rank $NODE --nproc-per-node 8 --master-addr $MAIN --master-port 29500 \
        hf_examples/sft_llama.py --model meta-llama/Llama-3.1-8B --output-dir /shared/sft
    accelerate launch --config_file recipes/accelerate_gpu.yaml --num_machines 2 --num_processes 16 \
        --machine_rank $NODE --main_process_ip $MAIN --main_process_port 29500 \
        hf_examples/sft_llama.py --model meta-llama/Llama-3.1-8B --output-dir /shared/sft
With several nodes the output dir must be on a shared filesystem (every rank writes its part of the
checkpoints and of the export there). Offline smoke test: tiny random Llama, synthetic data, 2 CPU processes:
    torchrun --nproc-per-node 2 hf_examples/sft_llama.py --tiny --steps 3 --output-dir /tmp/sft
"""

import argparse
import json
import os
import sys
from pathlib import Path

from pp_offload.data import DataConfig, embedded_assets, embedded_dir, format_examples, load_examples
from pp_offload.data.embedded import embedded_documents
from pp_offload.recipe import ModelConfig, OutputConfig, PipelineConfig, RecipeConfig, TrainConfig
from pp_offload.recipe.train import run

TEMPLATE = "### Instruction:\n{prompt}\n\n### Response:\n"
TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
              "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True}

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--model", default="meta-llama/Llama-3.2-1B", help="hub id or local directory")
p.add_argument("--dataset", default="yahma/alpaca-cleaned", help="hub dataset or local .jsonl/.json/.csv")
p.add_argument("--prompt-column", default="instruction")
p.add_argument("--response-column", default="output")
p.add_argument("--input-column", default="input", help="optional context appended to the prompt if present")
p.add_argument("--output-dir", default="runs/sft")
p.add_argument("--steps", type=int, default=300)
p.add_argument("--schedule", default="ScheduleVHalf")
p.add_argument("--dp", type=int, default=1,
               help="data-parallel replicas (FSDP2); pipeline ranks: processes / dp")
p.add_argument("--tiny", action="store_true", help="offline smoke test: tiny random Llama, synthetic data")
args = p.parse_args()
out, rank = Path(args.output_dir), os.environ.get("RANK", "0")
out.mkdir(parents=True, exist_ok=True)

if args.tiny:  # synthetic instructions about Python's help topics (shipped with the standard library)
    args.dataset, args.prompt_column, args.response_column = str(out / "tiny.jsonl"), "instruction", "output"
    rows = [{"instruction": f"Explain the Python help topic {topic!r}.", "output": text[:400]}
            for topic, text in embedded_documents()[::5][:300]]
    (out / f".tiny.{rank}.tmp").write_text("".join(json.dumps(row) + "\n" for row in rows))
    os.replace(out / f".tiny.{rank}.tmp", args.dataset)  # every rank writes the same file; renames are atomic

data = DataConfig(path=args.dataset, prompt_column=args.prompt_column, response_column=args.response_column,
                  prompt_template=TEMPLATE, seq_len=1024)
raw = load_examples(data, cache_dir=out / "cache")
if args.input_column in raw.column_names:
    # Alpaca's optional context follows the instruction after a blank line, only where there is one: a format
    # template has no conditionals, so it is folded into the prompt column here (the template does the rest).
    def with_input(ex: dict) -> dict:
        context = ex[args.input_column]
        return {args.prompt_column: (ex[args.prompt_column] or "") + (f"\n\n{context}" if context else "")}

    raw = raw.map(with_input, remove_columns=[args.input_column])
    raw.to_json(out / f".sft_prompts.{rank}.tmp", lines=True)
    os.replace(out / f".sft_prompts.{rank}.tmp", out / "sft_prompts.jsonl")  # every rank: same file, atomic
    data.path = str(out / "sft_prompts.jsonl")
if rank == "0":  # for inspection: the prompt (masked, template applied) and response texts the run tokenizes
    format_examples(raw, data).to_json(out / ".sft_data.tmp", lines=True)
    os.replace(out / ".sft_data.tmp", out / "sft_data.jsonl")

config = RecipeConfig(
    model=ModelConfig(path=args.model),
    data=data,
    pipeline=PipelineConfig(schedule=args.schedule, dp=args.dp, microbatches=16, offload="selective"),
    train=TrainConfig(steps=args.steps, global_batch_size=64, lr=2e-5, warmup_steps=min(20, args.steps),
                      weight_decay=0.0, precision="bf16"),
    output=OutputConfig(dir=str(out), save_every=100, log_every=10),
)
if args.tiny:  # config-built tiny Llama with the embedded tokenizer, fp32 on CPU processes
    tokenizer = embedded_assets(embedded_dir(out / "cache")).tokenizer_dir
    config.model = ModelConfig(config=TINY_LLAMA, tokenizer=str(tokenizer))
    config.data.seq_len, config.pipeline.microbatches, config.train.global_batch_size = 64, 4, 8
    config.train.lr, config.train.precision, config.train.device = 3e-3, "fp32", "cpu"
    config.output.log_every = 1

result = run(config, cache_dir=out / "cache", progress=sys.stderr.isatty())
if rank == "0" and result.losses:  # none when a relaunch finds the run finished
    print(f"sft: loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}; model in {result.export_dir}")
