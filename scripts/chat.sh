#!/usr/bin/env bash
# Set up, then chat in the terminal with the built-in default model (SmolLM2-135M-Instruct).
# Extra arguments go to `rvllm chat` (e.g. --model DIR, --temperature 0.7).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec "${RVLLM_VENV:-.venv}/bin/rvllm" chat "$@"
