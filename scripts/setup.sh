#!/usr/bin/env bash
# Create .venv (once) and install pp-offload with its Hugging Face extras and test tools into it.
# torch is pinned explicitly first: with the CPU wheel on local disk pip takes it from there, while an
# unpinned range would pull a multi-GB CUDA build. On a CUDA machine install your torch (>= 2.11) first.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip >/dev/null
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    .venv/bin/python -m pip install --quiet "torch==${PP_OFFLOAD_TORCH:-2.13.0}"
fi
.venv/bin/python -m pip install --quiet -e ".[hf,dev]"
