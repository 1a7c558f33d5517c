"""The peers' side of the direct-engine benchmark, in the same shape as ``rvllm benchmark``.

Each peer runs in its own environment (``scripts/bench_peers.sh`` sets them up), so this
module imports nothing of rvllm but the benchmark helpers, and each peer's package only
inside its own runner:

    python -m rvllm.bench.peers transformers --model HF_DIR ...
    python -m rvllm.bench.peers llama-cpp --model FILE.gguf ...
    python -m rvllm.bench.peers vllm --model HF_DIR ...

Workload as ``rvllm benchmark``: the same random token-id prompts (same seeds), greedy,
EOS ignored. transformers and vLLM offer no step API, so their prefill is timed as a run
of one output token and decode as the rest of the full run; llama.cpp is driven through
its batch API (one ``llama_decode`` per step, all sequences in one batch), like its
``batched`` example, with a greedy argmax over the returned logits.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from rvllm.bench.engine import parse_batch_sizes, print_result, random_prompts
from rvllm.bench.report import machine_info, write_json
from rvllm.bench.stats import PhaseTimes, median_row

# (prompts, output_len) -> (prefill seconds, decode seconds, output tokens)
RunFn = Callable[[list[list[int]], int], tuple[float, float, int]]


def _split_timing(generate: Callable[[list[list[int]], int], int]) -> RunFn:
    """Prefill = a 1-token run; decode = full run minus that (for engines with no steps)."""
    def run(prompts: list[list[int]], output_len: int) -> tuple[float, float, int]:
        t = time.perf_counter()
        generate(prompts, 1)
        prefill = time.perf_counter() - t
        t = time.perf_counter()
        produced = generate(prompts, output_len)
        return prefill, max(time.perf_counter() - t - prefill, 0.0), produced
    return run


def transformers_runner(model: str, dtype: str) -> tuple[RunFn, int, str]:
    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype).eval()
    hf.generation_config.eos_token_id = None

    def generate(prompts: list[list[int]], max_new: int) -> int:
        ids = torch.tensor(prompts)
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                              min_new_tokens=max_new, do_sample=False, pad_token_id=0)
        return (out.shape[1] - ids.shape[1]) * ids.shape[0]

    version = __import__("transformers").__version__
    return _split_timing(generate), hf.config.vocab_size, f"transformers {version}"


def vllm_runner(model: str, dtype: str) -> tuple[RunFn, int, str]:
    import vllm
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype=dtype, seed=0, max_model_len=2048)

    def generate(prompts: list[list[int]], max_new: int) -> int:
        params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    vocab = llm.llm_engine.model_config.get_vocab_size()
    return _split_timing(generate), vocab, f"vLLM {vllm.__version__} (CPU)"


def llama_cpp_runner(model: str, threads: int) -> tuple[RunFn, int, str]:
    import ctypes

    import llama_cpp
    import numpy as np

    llama_cpp.llama_backend_init()
    mparams = llama_cpp.llama_model_default_params()
    lm = llama_cpp.llama_model_load_from_file(model.encode(), mparams)
    if not lm:
        raise RuntimeError(f"llama.cpp could not load {model}.")
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(lm))

    def run(prompts: list[list[int]], output_len: int) -> tuple[float, float, int]:
        n = len(prompts)
        prompt_tokens = sum(len(p) for p in prompts)
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = ((prompt_tokens + n * output_len) // 256 + 1) * 256
        cparams.n_batch = max(prompt_tokens, n)
        cparams.n_seq_max = n
        cparams.kv_unified = True
        cparams.n_threads = cparams.n_threads_batch = threads
        ctx = llama_cpp.llama_init_from_model(lm, cparams)
        batch = llama_cpp.llama_batch_init(max(prompt_tokens, n), 0, 1)
        try:
            def decode(items: list[tuple[int, int, int, bool]]) -> np.ndarray:
                for i, (tok, pos, seq, want) in enumerate(items):
                    batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
                    batch.seq_id[i][0], batch.logits[i] = seq, want
                batch.n_tokens = len(items)
                if llama_cpp.llama_decode(ctx, batch) != 0:
                    raise RuntimeError("llama_decode failed.")
                rows = sum(1 for it in items if it[3])
                logits = ctypes.cast(llama_cpp.llama_get_logits(ctx),
                                     ctypes.POINTER(ctypes.c_float))
                return np.ctypeslib.as_array(logits, shape=(rows, n_vocab)).argmax(axis=1)

            t = time.perf_counter()
            items = [(tok, pos, s, pos == len(p) - 1)
                     for s, p in enumerate(prompts) for pos, tok in enumerate(p)]
            next_ids = decode(items)
            prefill = time.perf_counter() - t
            produced = n
            t = time.perf_counter()
            for step in range(1, output_len):
                next_ids = decode([(int(next_ids[s]), len(p) + step - 1, s, True)
                                   for s, p in enumerate(prompts)])
                produced += n
            return prefill, time.perf_counter() - t, produced
        finally:
            llama_cpp.llama_batch_free(batch)
            llama_cpp.llama_free(ctx)

    return run, n_vocab, f"llama-cpp-python {llama_cpp.__version__}"


def bench(run: RunFn, vocab: int, sizes: list[int], input_len: int, output_len: int,
          num_iters: int, seed: int) -> list[dict[str, float]]:
    """Same schedule and prompts as ``rvllm benchmark``: one warm-up, then each N."""
    run(random_prompts(min(sizes), input_len, vocab, seed - 1), min(output_len, 16))
    rows = []
    for n in sizes:
        runs = []
        for it in range(num_iters):
            prompts = random_prompts(n, input_len, vocab, seed + 1000 * n + it)
            prefill, decode, produced = run(prompts, output_len)
            times = PhaseTimes(n, n * input_len, produced, prefill, decode, n)
            runs.append(times.as_row())
            print(f"  {n=} {runs[-1]['output_tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
        row = median_row(runs)
        row["n"] = n
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rvllm.bench.peers",
                                     description="direct-engine benchmark of a peer engine")
    parser.add_argument("peer", choices=["transformers", "llama-cpp", "vllm"])
    parser.add_argument("--model", required=True, help="HF directory (GGUF for llama-cpp)")
    parser.add_argument("--n", default="1,4,8,16,32,64")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--num-iters", type=int, default=1)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--label", default=None, help="engine name in the JSON")
    parser.add_argument("--json", default=None, metavar="PATH")
    args = parser.parse_args(argv)
    sizes = parse_batch_sizes(args.n)
    t = time.perf_counter()
    if args.peer == "transformers":
        run, vocab, version = transformers_runner(args.model, args.dtype)
    elif args.peer == "vllm":
        run, vocab, version = vllm_runner(args.model, args.dtype)
    else:
        run, vocab, version = llama_cpp_runner(args.model, args.threads)
    startup = time.perf_counter() - t
    rows = bench(run, vocab, sizes, args.input_len, args.output_len, args.num_iters, args.seed)
    result: dict[str, Any] = {
        "benchmark": "engine", "engine": args.label or args.peer, "version": version,
        "model": args.model, "dtype": args.dtype if args.peer != "llama-cpp" else "gguf",
        "config": {"input_len": args.input_len, "output_len": args.output_len,
                   "num_iters": args.num_iters, "batch_sizes": sizes, "ignore_eos": True,
                   "temperature": 0.0},
        "startup_s": startup, "machine": machine_info(), "rows": rows,
    }
    print_result(result)
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
