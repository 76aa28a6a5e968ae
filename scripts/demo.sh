#!/usr/bin/env bash
# The main job: set up, then train a small model on 2 CPU pipeline ranks with every V schedule and
# torch's, compare losses with a single-process run, and print memory/bubble/step-time per schedule.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pp_offload demo "$@"
