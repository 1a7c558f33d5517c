#!/bin/bash
# One server at a time: start, wait for /health, one short warm-up request, the quote bench, stop.
# Run twice, back to back: as is, then with SUFFIX=-run2.
cd /work/main && source .venv/bin/activate && mkdir -p /tmp/specserve2
OUTDIR=benchmarks/results/2026-12-06-spec2
SPEC='{"method":"ngram","num_speculative_tokens":4,"prompt_lookup_min":2,"prompt_lookup_max":4}'
run_one() {  # port label [server flags...]
  local port=$1 label=$2; shift 2
  python -m rvllm.server.app --port $port --max-model-len 4096 "$@" > /tmp/specserve2/server-$label.log 2>&1 &
  local pid=$!
  for i in $(seq 1 240); do curl -sf http://127.0.0.1:$port/health >/dev/null && break; sleep 0.5; done
  echo "server $label pid $pid ready at $(date +%T), load $(cut -d' ' -f1 /proc/loadavg)"
  rvllm bench serve --base-url http://127.0.0.1:$port --endpoint chat --dataset quote --num-prompts 1 \
    --random-output-len 32 --seed 99 > /tmp/specserve2/warm-$label.log 2>&1
  echo "load before $label: $(cut -d' ' -f1 /proc/loadavg)"
  rvllm bench serve --base-url http://127.0.0.1:$port --endpoint chat --dataset quote --num-prompts 8 \
    --max-concurrency 1 --random-output-len 256 --label rvllm-$label \
    --json $OUTDIR/serve-quote-$label${SUFFIX}.json
  curl -s http://127.0.0.1:$port/metrics | grep -E "^vllm:spec_decode" > /tmp/specserve2/metrics-$label.txt
  kill -INT $pid; wait $pid; echo "server $label stopped rc=$?"
}
run_one 8132 ngram --speculative-config "$SPEC"
run_one 8133 none
