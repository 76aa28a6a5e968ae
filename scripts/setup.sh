#!/usr/bin/env bash
# Create .venv (once) and install pp-offload with its Hugging Face extras and test tools into it.
# torch is pinned explicitly first: with the CPU wheel on local disk pip takes it from there, while an
# unpinned range would pull a multi-GB CUDA build. On a CUDA machine install your torch (>= 2.11) first.
# pip's output goes to .venv/setup.log and is shown only when a step fails; once the venv is set up (a
# stamp records pyproject.toml and this script) the script prints nothing and returns at once.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
TORCH="${PP_OFFLOAD_TORCH:-2.13.0}"
STAMP=.venv/.pp-offload-setup
LOG=.venv/setup.log
want="$(cat pyproject.toml scripts/setup.sh | cksum) torch=$TORCH"
if [ -x .venv/bin/python ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
    exit 0
fi

if [ -x .venv/bin/python ]; then
    echo "setup: updating .venv (new pyproject.toml or setup script; under a minute; pip's log: $LOG)"
else
    echo "setup: creating .venv with torch $TORCH and pp-offload[hf,dev] (first run: about 2-3 min;" \
        "pip's log: $LOG)"
    "$PYTHON" -m venv .venv
fi
: >"$LOG"

step() {  # run a command with its output in the log; on failure show the log's end and stop
    if ! "$@" >>"$LOG" 2>&1; then
        echo "setup: failed: $*" >&2
        tail -n 40 "$LOG" >&2
        echo "setup: full log in $LOG" >&2
        exit 1
    fi
}

step .venv/bin/python -m pip install --upgrade pip
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    step .venv/bin/python -m pip install "torch==$TORCH"
fi
step .venv/bin/python -m pip install -e ".[hf,dev]"
echo "$want" >"$STAMP"
