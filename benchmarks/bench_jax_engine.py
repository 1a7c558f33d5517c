#!/usr/bin/env python3
"""Decode tok/s of the whole engine under ``--model-impl jax`` beside the torch backend,
on one model, at several batch sizes.

For each implementation: one ``LLM`` (its start-up time recorded, the JAX backend's
bucket compilation included), a warm-up ``generate``, then per N: N prompts of
``--prompt-len`` random tokens, ``--max-tokens`` new tokens each (ignore_eos, greedy), in
one ``generate``; decode tok/s is generated tokens over its wall time (the prompts'
prefill included, as a user sees it). The two implementations' greedy outputs are
compared token for token at N=1.

    python benchmarks/bench_jax_engine.py [--model /work/peers/random-llama | default]
        [--ns 1 8 32] [--max-tokens 128] [--impls torch,jax,jax-int8] [--json OUT]

``default`` is the built-in SmolLM2 file: the torch backend runs its Q4_1 blocks packed,
the JAX backend dequantized to float32 (``jax-int8``: quantized again to int8).
"""

from __future__ import annotations

import argparse
import gc
import shlex
import sys
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "results" / "2026-12-06-jax" / "jax-engine.json"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="/work/peers/random-llama")
    parser.add_argument("--ns", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--impls", default="torch,jax",
                        help="comma-separated: torch, jax, jax-int8, jax-int4")
    parser.add_argument("--json", default=str(OUT))
    ns = parser.parse_args()

    import torch

    import rvllm
    from rvllm.bench.report import format_table, machine_info, write_json

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 30000, (ns.prompt_len,), generator=g).tolist()
               for _ in range(max(ns.ns))]
    params = rvllm.SamplingParams(temperature=0.0, max_tokens=ns.max_tokens, ignore_eos=True)
    rows, outputs = [], {}
    model = None if ns.model == "default" else ns.model
    for impl in ns.impls.split(","):
        backend, _, quantization = impl.partition("-")
        start = time.perf_counter()
        llm = rvllm.LLM(model, model_impl=backend, max_num_seqs=max(ns.ns),
                        max_num_batched_tokens=512, max_model_len=512,
                        quantization=quantization or None)
        startup = time.perf_counter() - start
        llm.generate(prompts[:2], rvllm.SamplingParams(temperature=0.0, max_tokens=8))
        for n in ns.ns:
            start = time.perf_counter()
            outs = llm.generate(prompts[:n], params)
            seconds = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            if n == 1:
                outputs[impl] = outs[0].outputs[0].token_ids
            rows.append({"impl": impl, "N": n, "tok/s": round(tokens / seconds, 1),
                         "seconds": round(seconds, 2), "start-up s": round(startup, 1)})
            print(rows[-1], flush=True)
        del llm
        gc.collect()
    same = outputs.get("torch") == outputs.get("jax")
    print(format_table(rows, [(k, k) for k in rows[0]]))
    print(f"greedy outputs at N=1 identical: {same}")
    write_json(ns.json, {"benchmark": "jax-engine", "command": "python " + shlex.join(sys.argv),
                         "machine": machine_info(), "model": ns.model,
                         "config": {"prompt_len": ns.prompt_len, "max_tokens": ns.max_tokens,
                                    "max_num_batched_tokens": 512, "dtype": "float32"},
                         "rows": rows, "n1_outputs_identical": same})
    print(f"wrote {ns.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
