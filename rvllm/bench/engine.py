"""``rvllm benchmark``: the direct engine, no HTTP. For each batch size N, N prompts of
``--input-len`` random tokens generate ``--output-len`` tokens each (EOS ignored, greedy).

Prefill and decode are timed apart by driving ``LLMEngine.step()`` directly: the prefill
phase runs until every request has its first token, the decode phase from there to the
last token. With chunked prefill a step late in the prefill phase may also decode for
requests already past their prompt; those tokens count as prefill-phase output.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from typing import Any

from rvllm.bench.report import format_table, machine_info, write_json
from rvllm.bench.stats import PhaseTimes, median_row

TABLE_COLUMNS = [
    ("n", "N"), ("prefill_ms", "prefill ms"), ("prefill_tok_s", "prefill tok/s"),
    ("decode_ms", "decode ms"), ("decode_tok_s", "decode tok/s"),
    ("total_ms", "wall ms"), ("output_tok_s", "output tok/s"),
]


def parse_batch_sizes(text: str) -> list[int]:
    """``"1,4,8"`` -> [1, 4, 8]; every size must be a positive integer."""
    sizes = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            n = int(part)
        except ValueError:
            raise ValueError(f"--n must be comma-separated integers, got {part!r}.") from None
        if n < 1:
            raise ValueError(f"--n sizes must be at least 1, got {n}.")
        sizes.append(n)
    if not sizes:
        raise ValueError("--n names no batch size.")
    return sizes


def random_prompts(num: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """``num`` distinct prompts of ``input_len`` random token ids, reproducible from ``seed``.

    Distinct random prompts keep the prefix cache out of the measurement. Ids 0..9 are left
    out: small ids are where tokenizers keep their special tokens.
    """
    rng = random.Random(seed)
    low = min(10, vocab_size - 1)
    return [[rng.randrange(low, vocab_size) for _ in range(input_len)] for _ in range(num)]


def add_benchmark_args(parser: argparse.ArgumentParser) -> None:
    from rvllm.cli_args import add_engine_args

    g = parser.add_argument_group("benchmark")
    g.add_argument("--n", default="1,4,8,16,32,64", help="batch sizes, comma-separated")
    g.add_argument("--input-len", type=int, default=128, help="prompt tokens per sequence")
    g.add_argument("--output-len", type=int, default=256,
                   help="generated tokens per sequence (EOS ignored)")
    g.add_argument("--num-iters", type=int, default=1, help="measured runs per N (median kept)")
    g.add_argument("--num-iters-warmup", type=int, default=1,
                   help="unmeasured runs (of at most 16 output tokens) before each N's "
                        "measured runs")
    g.add_argument("--json", default=None, metavar="PATH", help="write the results here")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--label", default="rvllm",
                   help="engine name in the results (e.g. rvllm-int8 for a variant)")
    add_engine_args(parser)


def time_batch(engine: Any, prompts: list[list[int]], output_len: int) -> PhaseTimes:
    """Run ``prompts`` to completion on an idle engine, timing prefill and decode apart."""
    from rvllm.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    if engine.has_unfinished_requests():
        raise RuntimeError("the engine must be idle before a timed batch.")
    start = time.perf_counter()
    for ids in prompts:
        engine.add_request(None, ids, params)
    started: set[str] = set()
    produced = 0
    prefill_end = None
    prefill_tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            produced += sum(out.new_token_counts)
            started.add(out.request_id)
        if prefill_end is None and len(started) == len(prompts):
            prefill_end = time.perf_counter()
            prefill_tokens = produced
    end = time.perf_counter()
    assert prefill_end is not None
    return PhaseTimes(
        num_seqs=len(prompts),
        prompt_tokens=sum(len(p) for p in prompts),
        output_tokens=produced,
        prefill_s=prefill_end - start,
        decode_s=end - prefill_end,
        prefill_output_tokens=prefill_tokens,
    )


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm import tqdm

    from rvllm.cli_args import engine_args_from_namespace
    from rvllm.engine.llm_engine import LLMEngine
    from rvllm.startup import resume_collector

    sizes = parse_batch_sizes(args.n)
    if args.input_len < 1 or args.output_len < 1 or args.num_iters < 1:
        raise ValueError("--input-len, --output-len and --num-iters must be at least 1.")
    engine_args = engine_args_from_namespace(args)
    engine_args.show_progress = False
    t0 = time.perf_counter()
    engine = LLMEngine(engine_args)
    startup_s = time.perf_counter() - t0
    resume_collector()
    vocab = engine.model_config.vocab_size
    seed = args.seed or 0
    rows = []
    bar = tqdm(total=len(sizes) * args.num_iters, desc="benchmark", unit="run",
               disable=args.no_progress, file=sys.stderr)
    for n in sizes:
        # Unmeasured first: a batch shape's first steps may compile kernels (Triton
        # specialises on sizes) or pick cuBLAS algorithms, at any N, not just the first.
        for i in range(args.num_iters_warmup):
            time_batch(engine, random_prompts(n, args.input_len, vocab, seed - 1 - i),
                       min(args.output_len, 16))
        runs = []
        for it in range(args.num_iters):
            prompts = random_prompts(n, args.input_len, vocab, seed + 1000 * n + it)
            runs.append(time_batch(engine, prompts, args.output_len).as_row())
            bar.set_postfix(n=n, tok_s=f"{runs[-1]['output_tok_s']:.1f}")
            bar.update(1)
        row = median_row(runs)
        row["n"] = n
        rows.append(row)
    bar.close()
    return {
        "benchmark": "engine",
        "engine": args.label,
        "model": engine.model_config.path,
        "dtype": str(engine.model_config.dtype).removeprefix("torch."),
        "quantization": engine.quantization,
        "packed_activations": engine.settings()["packed_activations"],
        "config": {"input_len": args.input_len, "output_len": args.output_len,
                   "num_iters": args.num_iters, "batch_sizes": sizes, "ignore_eos": True,
                   "temperature": 0.0,
                   "num_scheduler_steps": engine.scheduler_config.num_scheduler_steps},
        "startup_s": startup_s,
        "startup_phases_s": {k: round(v, 3) for k, v in engine.startup_phases.items()},
        "kernel_backend": engine.kernel_backend,
        "cuda_graphs": engine.runner.decode_graphs is not None,
        "num_kv_blocks": engine.block_manager.num_blocks,
        "machine": machine_info(),
        "rows": rows,
    }


def print_result(result: dict[str, Any]) -> None:
    cfg = result["config"]
    weights = f", {result['quantization']} weights" if result.get("quantization") else ""
    if result.get("packed_activations") not in (None, "int16"):
        weights += f" by {result['packed_activations']} activations"
    print(f"{result['engine']} on {result['model']} ({result.get('dtype', '?')}{weights}), "
          f"input {cfg['input_len']} / output {cfg['output_len']} tokens, "
          f"median of {cfg['num_iters']}")
    print(format_table(result["rows"], TABLE_COLUMNS))


def main(args: argparse.Namespace) -> int:
    import logging

    # The engine's start-up lines (kernel path, graphs, cache size) go to stderr.
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    result = run_benchmark(args)
    print_result(result)
    if args.json:
        write_json(args.json, result)
        print(f"wrote {args.json}")
    return 0
