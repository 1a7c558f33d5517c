#!/usr/bin/env python3
"""Decode tok/s with and without asynchronous scheduling (``--async-scheduling``), on one
engine, alternated, with a check that the outputs are identical.

    python benchmarks/bench_async_scheduling.py                       # CPU, the default model
    python benchmarks/bench_async_scheduling.py --shape qwen2.5-7b --device cuda \\
        --dtype bfloat16 --ns 1,32,128                                # a GPU, < 5 minutes
    python benchmarks/bench_async_scheduling.py --shape qwen2.5-7b --layers 1 \
        --ns 1,2 --max-tokens 4 --repeats 1                           # a check on the CPU

``--shape qwen2.5-7b`` runs random weights (``load_format="dummy"``) in Qwen2.5-7B's
shape (hidden 3584, 28 layers, 28 heads, 4 KV heads, intermediate 18944, vocab 152064),
written as a config in a temporary directory; ``--model`` any checkpoint. Each round
sends N prompts of ``--prompt-len`` token ids at once for ``--max-tokens`` new tokens
each (EOS ignored, greedy), first without and then with the overlap (the same engine:
its step worker switched off and on), ``--repeats`` rounds; the median of each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model_shapes import add_model_args, model_and_kwargs  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(p)
    p.add_argument("--ns", default="1,32", help="comma-separated concurrencies")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    return p.parse_args()


def main() -> None:
    a = parse_args()
    import torch

    from rvllm import LLM, SamplingParams
    from rvllm.bench.report import machine_info, write_json

    model, kwargs = model_and_kwargs(a)
    ns = [int(n) for n in a.ns.split(",")]
    llm = LLM(model, max_num_seqs=max(ns), async_scheduling=True, **kwargs)
    engine = llm.engine
    worker = engine.step_worker
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    rows = []
    for n in ns:
        prompts = [torch.randint(3, vocab, (a.prompt_len,), generator=gen).tolist()
                   for _ in range(n)]
        rates: dict[str, list[float]] = {"sync": [], "async": []}
        outputs: dict[str, list] = {}
        for r in range(a.repeats + 1):  # the first round warms up, untimed
            for mode in ("sync", "async"):
                engine.finish_steps()
                engine.step_worker = worker if mode == "async" else None
                start = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                seconds = time.perf_counter() - start
                outputs[mode] = [o.outputs[0].token_ids for o in outs]
                if r > 0:
                    rates[mode].append(n * a.max_tokens / seconds)
        sync, overlapped = (statistics.median(rates[m]) for m in ("sync", "async"))
        rows.append(dict(n=n, sync_tok_s=round(sync, 1), async_tok_s=round(overlapped, 1),
                         ratio=round(overlapped / sync, 3), runs=rates,
                         identical=outputs["sync"] == outputs["async"]))
        print(json.dumps(rows[-1]), flush=True)
    worker.shutdown()
    result = dict(machine=machine_info(), device=str(engine.device), model=model,
                  shape=a.shape, settings=engine.settings(), prompt_len=a.prompt_len,
                  max_tokens=a.max_tokens, results=rows)
    if torch.cuda.is_available() and engine.device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name()
    if a.json is not None:
        write_json(a.json, result)


if __name__ == "__main__":
    main()
