#!/usr/bin/env bash
# Set up with the test dependencies, then run the default test suite.
# Extra arguments go to pytest (e.g. -m slow for the long tests).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
exec "${RVLLM_VENV:-.venv}/bin/python" -m pytest "$@"
