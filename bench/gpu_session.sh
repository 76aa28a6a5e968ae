#!/usr/bin/env bash
# Everything the project checks on a CUDA machine, in parts that each fit a 10-minute command.
#
#   bash bench/gpu_session.sh PART [OUT]     # PART: env, store, replay, replay-long, recipe, suite
#
# Runs with the machine's own python (its torch, transformers, accelerate, peft); packages it lacks
# (datasets and its dill/multiprocess) come as wheels from .whl/ when that folder exists. Logs and
# results go to OUT (default bench/results/gpu); bench/results/gpu/README.md holds the tables.
set -uo pipefail
cd "$(dirname "$0")/.."
PART="${1:?part: env, store, replay, replay-long, recipe, suite}"
OUT="${2:-bench/results/gpu}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl >/dev/null 2>&1 || echo "wheel install failed"
    export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 PP_OFFLOAD_ORDER_CACHE=off
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1

case "$PART" in
env)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$OUT/env.log"
    "$PY" - <<'EOF' 2>&1 | tee -a "$OUT/env.log"
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
for name in ("transformers", "accelerate", "peft", "datasets", "safetensors", "matplotlib", "tqdm", "yaml"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as e:
        print(name, "MISSING", type(e).__name__, e)
EOF
    ;;
store)
    "$PY" -m pytest -q -p no:cacheprovider tests/test_store.py -k cuda -ra 2>&1 \
        | tee "$OUT/store_tests.log"
    ;;
replay)
    "$PY" bench/bench_gpu_replay.py --seq 4096 --microbatches 8 --name replay_seq4096 --out "$OUT" 2>&1 \
        | grep -v "Warning\|masks\[kind\]\|return forward" | tee "$OUT/replay_seq4096.log"
    ;;
replay-long)
    "$PY" bench/bench_gpu_replay.py --seq 16384 --microbatches 8 --name replay_seq16384 --out "$OUT" \
        --configs ScheduleVHalf/none/none ScheduleVHalf/budget:auto:0.1/selective ScheduleVHalf/none/selective \
        ScheduleVZB/none/none ScheduleVZB/budget:auto:0.1/selective 2>&1 \
        | grep -v "Warning\|masks\[kind\]\|return forward" | tee "$OUT/replay_seq16384.log"
    ;;
recipe)
    base=(--config recipes/configs/tiny_llama.yaml --set train.steps=12 --set train.eval_every=6
          --set output.export=false --no-progress)
    echo "== one process, CUDA, bf16" | tee "$OUT/recipe.log"
    timeout 240 "$PY" recipes/finetune.py "${base[@]}" --set train.device=cuda --set train.precision=bf16 \
        --output-dir /tmp/r_one >>"$OUT/recipe.log" 2>&1; tail -5 "$OUT/recipe.log"
    echo "== two processes on the one GPU, CUDA, fp32, V-Half" | tee -a "$OUT/recipe.log"
    timeout 240 "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 recipes/finetune.py "${base[@]}" \
        --set train.device=cuda --output-dir /tmp/r_two >>"$OUT/recipe.log" 2>&1; tail -5 "$OUT/recipe.log"
    echo "== two processes, CPU, fp32, V-Half (reference losses)" | tee -a "$OUT/recipe.log"
    OMP_NUM_THREADS=2 timeout 240 "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 \
        recipes/finetune.py "${base[@]}" --set train.device=cpu --output-dir /tmp/r_cpu >>"$OUT/recipe.log" 2>&1
    tail -5 "$OUT/recipe.log"
    for d in /tmp/r_one /tmp/r_two /tmp/r_cpu; do
        [ -f "$d/metrics.csv" ] && { echo "== $d/metrics.csv"; cat "$d/metrics.csv"; } >>"$OUT/recipe.log"
    done
    ;;
suite)
    timeout 560 "$PY" -m pytest -q -p no:cacheprovider -n 8 tests 2>&1 | tail -40 | tee "$OUT/suite.log"
    ;;
*)
    echo "unknown part $PART" >&2
    exit 2
    ;;
esac
