#!/usr/bin/env bash
# The main job: set up .venv, then fine-tune a tiny Llama on 2 CPU pipeline ranks with the V-Half schedule
# (embedded English corpus and a locally trained tokenizer: no downloads). Results in runs/finetune/:
# metrics.csv, summary.json, checkpoints/, and export/ (loads with AutoModelForCausalLM.from_pretrained).
# Extra arguments go to the recipe, e.g.: bash scripts/demo.sh --set pipeline.schedule=ScheduleVMin
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec .venv/bin/torchrun --standalone --nproc-per-node 2 recipes/finetune.py \
    --config recipes/configs/tiny_llama.yaml "$@"
