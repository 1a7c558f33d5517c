#!/usr/bin/env bash
# The prepared GPU check, for a CUDA machine with only PyTorch, Triton and
# transformers installed. Steps, each under its own time limit and all within 8 minutes:
#   1. the kernel and CUDA-graph tests, natively (no TRITON_INTERPRET; pytest if present,
#      else scripts/run_tests.py's stand-in)
#   2. each Triton kernel timed against its plain-torch reference at Qwen2.5-7B shapes
#   3. the engine benchmark (7B-shaped dummy weights, bf16, N=1/8/32/128, graphs on/off),
#      when `rvllm benchmark` supports it; otherwise "skipped: ..."
#   4. decode with and without --async-scheduling on the same model, N=1/32/128
#   5. decode at N=1/4 with and without --fused-decode-gemv, graphs on, in turns
#   6. prefill tok/s at 512- and 2,048-token prompts against the bf16 matmul peak, and
#      the paged prefill attention against SDPA at those lengths
#   7. the quantized paths: their layers' GEMVs and attention (bench_gpu_quant.py), then the
#      engine at N=1 in bf16, int4 and fp8 weights, and at N=128 over a bf16 and an fp8
#      KV cache (its JSON has the cache's blocks)
#   8. the peer: transformers generate on the same model
# GPU_CHECK_STEPS=a,b runs only those steps (kernel_tests, kernel_bench, engine_bench,
# async_bench, fused_gemv_bench, prefill_bench, quant_bench, hf_peer).
# Results: JSON per step plus gpu_check.json (step statuses) in $OUT, else benchmarks/results.
# A failing step is recorded and the next one still runs; the exit status is 1 if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
out_dir="${OUT:-benchmarks/results}"
mkdir -p "$out_dir"
py="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
budget_s="${GPU_CHECK_BUDGET_S:-470}"  # 8 minutes, less a margin for the summary
steps="$out_dir/gpu_check_steps.tsv"
: >"$steps"
failed=0

# run_step NAME LIMIT_S COMMAND...: run under min(LIMIT_S, time left); record the outcome.
run_step() {
  local name=$1 limit=$2; shift 2
  local left=$((budget_s - SECONDS))
  if ((left < 30)); then
    echo "skipped: $name (out of time)"; printf '%s\tskipped\t0\tout of time\n' "$name" >>"$steps"
    return
  fi
  ((limit > left)) && limit=$left
  echo "=== $name (limit ${limit}s) ==="
  local start=$SECONDS rc=0
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$out_dir/$name.log" || rc=$?
  local status=ok
  ((rc == 124 || rc == 137)) && status=timeout
  ((rc != 0 && rc != 124 && rc != 137)) && status=failed
  [[ $status != ok ]] && failed=1
  printf '%s\t%s\t%s\trc=%s\n' "$name" "$status" $((SECONDS - start)) "$rc" >>"$steps"
}

skip_step() {
  echo "skipped: $1 ($2)"; printf '%s\tskipped\t0\t%s\n' "$1" "$2" >>"$steps"
}

# wanted NAME: whether GPU_CHECK_STEPS (default: every step) names it.
wanted() {
  [[ -z "${GPU_CHECK_STEPS:-}" || ",$GPU_CHECK_STEPS," == *",$1,"* ]]
}

"$py" -c "import torch, triton; assert torch.cuda.is_available(), 'no CUDA device'; \
print(torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" \
  || { echo "gpu_check needs PyTorch with CUDA and Triton"; exit 1; }

wanted kernel_tests && run_step kernel_tests 180 "$py" scripts/run_tests.py \
  tests/test_kernels.py tests/test_cuda_graphs.py tests/test_triton_path.py tests/test_memory.py \
  --json "$out_dir/kernel_tests.json"
wanted kernel_bench && run_step kernel_bench 150 "$py" benchmarks/bench_kernels.py \
  --out "$out_dir/kernel_bench.json"

model_dir="$out_dir/qwen2.5-7b-shape"
"$py" benchmarks/bench_hf_peer.py --save-config "$model_dir"
export py model_dir out_dir  # for the steps that run as bash functions
if ! wanted engine_bench; then
  :
elif "$py" -m rvllm.cli benchmark --help 2>/dev/null | grep -q -- "--load-format"; then
  # Flags follow the issue (dummy weights, no tokenizer, graphs on/off); adjust here
  # if `rvllm benchmark` names them differently.
  engine_bench() {
    for eager in "" "--enforce-eager"; do
      # shellcheck disable=SC2086  # $eager is one flag or nothing
      # --max-num-seqs 128 (the largest N) and --max-model-len 2048 keep the captured
      # sizes and the split-KV grid to what the runs use.
      "$py" -m rvllm.cli benchmark --model "$model_dir" --load-format dummy \
        --skip-tokenizer-init --dtype bfloat16 --n 1,8,32,128 --output-len 256 \
        --max-num-seqs 128 --max-model-len 2048 --no-progress \
        $eager --json "$out_dir/engine_bench${eager:+_eager}.json" || return 1
    done
  }
  export -f engine_bench
  run_step engine_bench 240 bash -c engine_bench
else
  skip_step engine_bench "rvllm benchmark with --load-format dummy is not available yet"
fi

# One engine, the overlap switched off and on in turns (benchmarks/bench_async_scheduling.py).
wanted async_bench && run_step async_bench 180 "$py" benchmarks/bench_async_scheduling.py \
  --shape qwen2.5-7b --device cuda --dtype bfloat16 --ns 1,32,128 --max-tokens 128 \
  --engine-kwargs '{"max_model_len": 2048}' --json "$out_dir/async_bench.json"

# The fused decode GEMVs against the separate kernels, each engine run twice in turns.
fused_gemv_bench() {
  for round in 1 2; do
    for fused in "" "--fused-decode-gemv"; do
      # shellcheck disable=SC2086  # $fused is one flag or nothing
      "$py" -m rvllm.cli benchmark --model "$model_dir" --load-format dummy \
        --skip-tokenizer-init --dtype bfloat16 --n 1,4 --output-len 256 \
        --max-num-seqs 4 --max-model-len 2048 --no-progress $fused \
        --json "$out_dir/fused_gemv_bench${fused:+_fused}_$round.json" || return 1
    done
  done
}
if wanted fused_gemv_bench; then
  export -f fused_gemv_bench
  run_step fused_gemv_bench 200 bash -c fused_gemv_bench
fi

wanted prefill_bench && run_step prefill_bench 150 "$py" benchmarks/bench_prefill.py \
  --shape qwen2.5-7b --device cuda --dtype bfloat16 --lens 512,2048 \
  --json "$out_dir/prefill_bench.json"

quant_bench() {
  "$py" benchmarks/bench_gpu_quant.py --out "$out_dir/gpu_quant.json" || return 1
  local common=(-m rvllm.cli benchmark --model "$model_dir" --load-format dummy
                --skip-tokenizer-init --dtype bfloat16 --max-model-len 2048 --no-progress)
  for q in none int4 fp8; do
    "$py" "${common[@]}" --quantization "$q" --n 1 --output-len 256 --max-num-seqs 4 \
      --json "$out_dir/quant_bench_n1_$q.json" || return 1
  done
  for kv in auto fp8; do
    "$py" "${common[@]}" --kv-cache-dtype "$kv" --n 128 --output-len 128 \
      --max-num-seqs 128 --json "$out_dir/quant_bench_n128_kv_$kv.json" || return 1
  done
}
if wanted quant_bench; then
  export -f quant_bench
  run_step quant_bench 240 bash -c quant_bench
fi

if ! wanted hf_peer; then
  :
elif [[ "${GPU_CHECK_PEER:-1}" == 1 ]]; then
  run_step hf_peer 120 "$py" benchmarks/bench_hf_peer.py --out "$out_dir/hf_peer.json"
else
  skip_step hf_peer "GPU_CHECK_PEER=0"
fi

"$py" - "$steps" "$out_dir/gpu_check.json" <<'PY'
import json, sys
rows = [line.rstrip("\n").split("\t") for line in open(sys.argv[1]) if line.strip()]
steps = [{"step": n, "status": s, "seconds": int(t), "detail": d} for n, s, t, d in rows]
json.dump({"steps": steps}, open(sys.argv[2], "w"), indent=1)
for s in steps:
    print(f"{s['step']:>14}: {s['status']} ({s['seconds']} s) {s['detail']}")
PY
echo "total ${SECONDS}s; results in $out_dir"
exit "$failed"
