#!/usr/bin/env bash
# Everything the project checks on a CUDA machine, in parts that each fit a 10-minute command.
#
#   bash bench/gpu_session.sh PART [OUT]     # PART: quick, quick-last, env, store, replay, replay-long,
#                                            #       recipe, suite
#
# `quick` is the one-call session (at most 8 minutes on an H100; bench/results/gpu/README.md, "How the next
# GPU session runs"): environment, CUDA store tests, one step per configuration under torch's sync debug
# mode "error", then the seq-4096 replay in order of importance, then its compiled rows; each part under its
# own time limit, every finished configuration on disk at once. `quick-last`: the replay on the last pipeline rank (4 minutes).
# GPU_SESSION_CPU=1 rehearses the same path on the CPU (tiny model, two configurations run, all of them
# checked; CUDA-only parts recorded as "skipped: no CUDA"): tests/test_gpu_session.py runs it in CI, and
# GPU_SESSION_DRY=1 (without the CPU switch): the CUDA command lines, the bench's only checked.
#
# Runs with the machine's own python (its torch, transformers, accelerate, peft); packages it lacks
# (datasets and its dill/multiprocess) come as wheels from .whl/ when that folder exists. Logs and
# results go to OUT (default bench/results/gpu); bench/results/gpu/README.md holds the tables.
set -uo pipefail
cd "$(dirname "$0")/.."
PART="${1:?part: quick, quick-last, env, store, replay, replay-long, recipe, suite}"
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

# --- quick: the one-call session ------------------------------------------------------------------------
# The configurations, most important first: a time limit cuts the tail, never the head.
# The sync check: the plain step, whole-chunk offload (the first GPU run's serialized copies) and layer-hook
# offload of sub-layer units under split backward. Every replay row also lists its step's synchronizing
# calls in warn mode (`host_syncs`).
SYNC_CONFIGS=(ScheduleVHalf/none/none ScheduleVHalf/full/none ScheduleVZB/budget:sublayer/mlp)
QUICK_CONFIGS=(
    ScheduleVHalf/none/none ScheduleVHalf/full/none
    ScheduleVHalf/budget:auto:0.1/none ScheduleVHalf/budget:sublayer/mlp
    ScheduleVZB/none/none ScheduleVZB/budget:sublayer/mlp
    ScheduleVHalf/none/selective ScheduleVHalf/none/selective+once
    ScheduleVHalf/none/full ScheduleVHalf/none/full+once
    Interleaved1F1B/none/none ScheduleZBVZeroBubble/none/none ScheduleDualPipeV/none/none
    Interleaved1F1B/budget:auto:0.1/none ScheduleZBVZeroBubble/budget:auto:0.1/none
    ScheduleDualPipeV/budget:auto:0.1/none
)
# Compiled (each decoder layer compiled in place, `--compile`; issue 30): its own part after the eager replay,
# under its own share of the time (the first row pays the cold compile), most important first: V-Half, the
# schedule torch users compile with (Interleaved1F1B), V-ZB; without offload, then with `budget`. Each is set
# beside the eager row of the same configuration (the replay's JSON, `--calibration`: same costs).
COMPILED_CONFIGS=(
    ScheduleVHalf/none/none Interleaved1F1B/none/none ScheduleVZB/none/none
    ScheduleVHalf/budget:auto:0.1/none Interleaved1F1B/budget:auto:0.1/none ScheduleVZB/budget:auto:0.1/none
)
COMPILED_S="${COMPILED_S:-150}"  # the compiled part's share of QUICK_S (more if the eager replay ends early)
# The last rank: in loop placement it holds the LM head and loss; in V placement the middle stages (rank 0
# holds the LM head there, so `quick` already runs it).
LAST_CONFIGS=(
    Interleaved1F1B/none/none Interleaved1F1B/budget:auto:0.1/none
    ScheduleVHalf/none/none ScheduleVHalf/full/none
)
QUICK_S="${QUICK_S:-450}"  # the whole part, seconds: an 8-minute call with room for the transfers
if [ "${GPU_SESSION_CPU:-0}" = 1 ]; then  # the CPU rehearsal (tests/test_gpu_session.py)
    CUDA=0
    SHAPE=(--tiny --device cpu --dtype fp32 --seq 16 --microbatches 4 --pp 2 --steps 1)
    LAST_RANK=1
    FEW=(--limit "${GPU_SESSION_CPU_CONFIGS:-2}")  # every configuration is still parsed and checked
    # one compiled row, traced by dynamo and AOT autograd without inductor's code generation (seconds, not
    # a minute of C++ compiling on a CPU): the bench's compile path, not inductor's kernels
    COMPILE=(--compile-backend aot_eager --limit 1)
else
    CUDA=1
    SHAPE=(--seq 4096 --microbatches 8 --pp 4 --steps 3)
    LAST_RANK=3
    FEW=()
    COMPILE=()
fi
if [ -z "${PP_OFFLOAD_COMMIT:-}" ]; then  # as bench_gpu_replay.git_commit: a device may get no .git
    PP_OFFLOAD_COMMIT="$(git rev-parse HEAD 2>/dev/null || echo "unknown (no git; set PP_OFFLOAD_COMMIT)")"
    [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] && PP_OFFLOAD_COMMIT+="+dirty"
fi
export PP_OFFLOAD_COMMIT
NOISE="Warning\|masks\[kind\]\|return forward\|_warn_once"

step_part() {  # step_part NAME LIMIT_S COMMAND...: one part under its own time limit, its status recorded
    local name="$1" limit="$2" start=$SECONDS rc status command
    shift 2
    command="$*"
    command="${command//[$'\t\n']/ }"
    echo "== [$(date -u +%H:%M:%S)] $name (limit $limit s): $command" | tee -a "$LOG"
    if [ "${GPU_SESSION_DRY:-0}" = 1 ] && [[ "$command" != *bench_gpu_replay.py* ]]; then
        rc=0 status=dry-run  # the dry run (tests/test_gpu_session.py) runs only the bench's --check-only
    else
        [ "${GPU_SESSION_DRY:-0}" = 1 ] && set -- "$@" --check-only
        timeout -k 10 "$limit" "$@" 2>&1 | grep --line-buffered -v "$NOISE" | tee -a "$LOG"
        rc=${PIPESTATUS[0]}
        case "$rc" in 0) status=ok ;; 124 | 137) status=timeout ;; *) status=failed ;; esac
    fi
    echo "== $name: $status (rc $rc, $((SECONDS - start)) s)" | tee -a "$LOG"
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$((SECONDS - start))" "$limit" "$command" >>"$PARTS"
}

skip_part() {  # skip_part NAME REASON
    echo "== $1: $2" | tee -a "$LOG"
    printf '%s\t%s\t\t0\t0\t\n' "$1" "$2" >>"$PARTS"
}

summary() {  # summary NAME: the parts' statuses, the environment and each result's outcome in OUT/NAME.json
    "$PY" - "$PARTS" "$OUT" "$1" "$CUDA" <<'EOF'
import json, sys, time
from pathlib import Path

parts_path, out, name, cuda = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"
parts = []
for line in parts_path.read_text().splitlines():
    part, status, rc, seconds, limit, command = line.split("\t")
    parts.append({"part": part, "status": status, "rc": int(rc) if rc else None, "seconds": int(seconds),
                  "limit_s": int(limit), "command": command})
env_path = out / f"{name}_env.json"
env = json.loads(env_path.read_text()) if env_path.exists() else {}
results = {}
for path in (out / f"{name}_sync.json", out / f"{name}_replay.json", out / f"{name}_compiled.json"):
    if not path.exists():
        continue
    data = json.loads(path.read_text())
    count = {"done": 0, "failed": 0, "skipped": 0, "unfinished": 0, "sync_calls_found": 0}
    for r in data["records"]:
        check = r.get("sync_check", {}).get("status")
        key = ("failed" if "error" in r or check == "error" else "skipped" if "skipped" in r
               else "unfinished" if "started" in r else "done")
        count[key] += 1
        count["sync_calls_found"] += check == "failed"  # a finding, not a failure of the run
    results[path.name] = count
    checks = {"/".join(r["config"].values()): r["sync_check"] for r in data["records"] if "sync_check" in r}
    if checks:
        results[path.name]["sync_check"] = checks
    env.setdefault("git_commit", data["meta"].get("git_commit"))
meta = {"git_commit": env.get("git_commit"), "torch": env.get("torch"), "device": env.get("device"),
        "cpu_rehearsal": not cuda, "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
summary = {"meta": meta, "env": env, "parts": parts, "results": results}
(out / f"{name}.json").write_text(json.dumps(summary, indent=1))
print(f"{name}: " + ", ".join(f"{p['part']} {p['status']} ({p['seconds']} s)" for p in parts))
for file, count in results.items():
    print(f"  {file}: " + ", ".join(f"{k} {v}" for k, v in count.items() if k != "sync_check"))
    for config, check in count.get("sync_check", {}).items():
        print(f"    sync check {config}: {check['status']} {check.get('error', '')[:160]} {check.get('where', '')}")
bad = [p["part"] for p in parts if p["status"] in ("failed", "timeout")]
sys.exit(1 if bad or any(c["failed"] or c["unfinished"] for c in results.values()) else 0)
EOF
}

ENV_PY='
import importlib, json, os, platform, sys
import torch
cuda = torch.cuda.is_available()
env = {"git_commit": os.environ.get("PP_OFFLOAD_COMMIT"), "python": platform.python_version(),
       "torch": torch.__version__, "cuda": torch.version.cuda,
       "device": torch.cuda.get_device_name(0) if cuda else "cpu (no CUDA)"}
for name in ("transformers", "accelerate", "peft", "datasets", "safetensors", "matplotlib", "tqdm", "yaml"):
    try:
        env[name] = importlib.import_module(name).__version__
    except Exception as e:
        env[name] = f"MISSING {type(e).__name__}: {e}"
for key, value in env.items():
    print(key, value)
with open(sys.argv[1], "w") as f:
    json.dump(env, f, indent=1)
'

quick() {  # quick PART: `quick` (rank 0, everything) or `quick-last` (the replay on the last rank alone)
    local part="$1" name="${1/-/_}" left configs rank rc
    T0=$SECONDS
    TMPD="$(mktemp -d)"
    PARTS="$TMPD/parts.tsv"
    LOG="$OUT/$name.log"
    : >"$PARTS"
    : >"$LOG"
    [ "$part" = quick-last ] && QUICK_S=$((QUICK_S < 240 ? QUICK_S : 240))
    echo "== $part: commit $PP_OFFLOAD_COMMIT, $([ $CUDA = 1 ] && echo CUDA || echo 'CPU rehearsal'), $QUICK_S s" \
        | tee -a "$LOG"
    if [ "$part" = quick ]; then
        if [ $CUDA = 1 ]; then
            step_part nvidia-smi 20 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
        else
            skip_part nvidia-smi "skipped: no CUDA"
        fi
        step_part env 45 "$PY" - "$OUT/${name}_env.json" <<<"$ENV_PY"
        if [ $CUDA = 1 ]; then
            step_part store 75 "$PY" -m pytest -q -p no:cacheprovider tests/test_store.py tests/test_queue_offload.py -k cuda -ra
        else
            skip_part store "skipped: no CUDA"
        fi
        step_part sync-check 90 "$PY" bench/bench_gpu_replay.py "${SHAPE[@]}" --sync-check --budget-s 70 \
            ${FEW[@]+"${FEW[@]}"} --out "$OUT" --name "${name}_sync" --configs "${SYNC_CONFIGS[@]}"
        configs=("${QUICK_CONFIGS[@]}")
        rank=0
    else
        configs=("${LAST_CONFIGS[@]}")
        rank=$LAST_RANK
    fi
    left=$((QUICK_S - (SECONDS - T0) - 15))  # 15 s for the summary
    [ "$part" = quick ] && left=$((left - COMPILED_S))
    if [ "$left" -lt 60 ]; then
        skip_part replay "skipped: $left s left"
    else
        step_part replay "$left" "$PY" bench/bench_gpu_replay.py "${SHAPE[@]}" --rank "$rank" \
            --budget-s $((left - 25)) ${FEW[@]+"${FEW[@]}"} --out "$OUT" --name "${name}_replay" --configs "${configs[@]}"
    fi
    if [ "$part" = quick ]; then
        left=$((QUICK_S - (SECONDS - T0) - 15))
        if [ "$left" -lt 60 ]; then
            skip_part replay-compiled "skipped: $left s left"
        else
            step_part replay-compiled "$left" "$PY" bench/bench_gpu_replay.py "${SHAPE[@]}" --rank "$rank" \
                --compile ${COMPILE[@]+"${COMPILE[@]}"} --calibration "$OUT/${name}_replay.json" \
                --budget-s $((left - 25)) --out "$OUT" --name "${name}_compiled" --configs "${COMPILED_CONFIGS[@]}"
        fi
    fi
    summary "$name" 2>&1 | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
    rm -rf "$TMPD"
    echo "== $part done in $((SECONDS - T0)) s, rc $rc: $OUT/$name.json" | tee -a "$LOG"
    return "$rc"
}

case "$PART" in
quick | quick-last)
    quick "$PART"
    exit $?
    ;;
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
    "$PY" -m pytest -q -p no:cacheprovider tests/test_store.py tests/test_queue_offload.py -k cuda -ra 2>&1 \
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
