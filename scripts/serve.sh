#!/usr/bin/env bash
# Set up, then serve the built-in default model (SmolLM2-135M-Instruct) on port 8000.
# Extra arguments go to `rvllm serve` (e.g. --port 9000, --model DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec "${RVLLM_VENV:-.venv}/bin/rvllm" serve "$@"
