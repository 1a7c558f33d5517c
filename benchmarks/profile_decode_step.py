"""Where a decode step's time goes on a GPU: the engine's whole step against the replay of
its captured CUDA graph alone (GPU time, CUDA events). The difference is the host's share:
scheduling, input preparation, sampling and output handling, during which the GPU idles.

    python benchmarks/profile_decode_step.py --model DIR --load-format dummy \\
        --skip-tokenizer-init --dtype bfloat16 --max-num-seqs 128 --max-model-len 2048 \\
        --sizes 1,32,128 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rvllm.bench.engine import random_prompts  # noqa: E402
from rvllm.cli_args import add_engine_args, engine_args_from_namespace  # noqa: E402
from rvllm.engine.llm_engine import LLMEngine  # noqa: E402
from rvllm.sampling_params import SamplingParams  # noqa: E402


def kernel_table(engine: LLMEngine, steps: int) -> str:
    """GPU kernels of ``steps`` eager decode steps (graphs set aside), by total time."""
    from torch.profiler import ProfilerActivity, profile

    graphs, engine.runner.decode_graphs = engine.runner.decode_graphs, None
    try:
        engine.step()  # warm: the eager path's first call may compile
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                engine.step()
            torch.cuda.synchronize()
    finally:
        engine.runner.decode_graphs = graphs
    return prof.key_averages().table(sort_by="device_time_total", row_limit=25,
                                     max_name_column_width=70)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="1,32,128")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=100, help="decode steps timed per size")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--kernel-table", action="store_true",
                        help="also list the GPU kernels of eager decode steps at the first "
                             "size (torch.profiler), by total time")
    add_engine_args(parser)
    args = parser.parse_args()
    engine = LLMEngine(engine_args_from_namespace(args))
    graphs = engine.runner.decode_graphs
    on_gpu = engine.device.type == "cuda"

    def sync() -> None:
        if on_gpu:
            torch.cuda.synchronize()
    vocab = engine.model_config.vocab_size
    rows = []
    for n in map(int, args.sizes.split(",")):
        params = SamplingParams(max_tokens=args.steps + 40, ignore_eos=True, temperature=0.0)
        for ids in random_prompts(n, args.input_len, vocab, n):
            engine.add_request(None, ids, params)
        for _ in range(20):  # through prefill, into steady decode
            engine.step()
        sync()
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        sync()
        step_ms = (time.perf_counter() - start) * 1e3 / args.steps
        row = {"n": n, "engine_step_ms": round(step_ms, 3)}
        size = graphs.runner.padded_batch_size(n) if graphs is not None else None
        if size is not None:
            replay = graphs.runner._replays[size][0]
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(args.steps):
                replay()
            end.record()
            torch.cuda.synchronize()
            row["graph_replay_ms"] = round(begin.elapsed_time(end) / args.steps, 3)
            row["host_share"] = round(1 - row["graph_replay_ms"] / step_ms, 3)
        if args.kernel_table and not rows and on_gpu:
            print(kernel_table(engine, steps=10), flush=True)
        while engine.has_unfinished_requests():
            engine.step()
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.json:
        args.json.write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
