#!/usr/bin/env bash
# The test suite: set up, lint, run every test. Fails if no test ran (pytest exits 5).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check pp_offload tests bench recipes hf_examples
exec .venv/bin/python -m pytest -q "$@"
