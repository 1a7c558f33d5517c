"""Time decode steps of two or more engine configurations side by side, in one process.

Each variant's engine prefills the same ``--rows`` prompts of ``--context`` random tokens;
then the engines take decode steps in turn (A, B, A, B, ...), so a drift in the machine's
speed reaches every variant alike. Prints each variant's median step and the ratios.

    python scripts/bench_decode_step_ab.py --model MODEL --quantization int8 \\
        --variant kv_cache_dtype=auto --variant kv_cache_dtype=bfloat16
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from rvllm import LLM, SamplingParams


def parse_variant(text: str) -> dict[str, object]:
    """``key=value,key=value`` engine keyword arguments; ints stay ints."""
    kwargs: dict[str, object] = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        kwargs[key] = int(value) if value.isdigit() else value
    return kwargs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--variant", action="append", required=True,
                        help="engine keyword arguments, e.g. kv_cache_dtype=bfloat16")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--context", type=int, default=400)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()

    engines = {}
    for text in args.variant:
        llm = LLM(args.model, quantization=args.quantization, max_num_seqs=args.rows,
                  max_model_len=args.context + args.steps + 64, **parse_variant(text))
        engine, rng = llm.engine, random.Random(0)
        for _ in range(args.rows):
            prompt = [rng.randrange(100, 30000) for _ in range(args.context)]
            engine.add_request(None, {"prompt_token_ids": prompt},
                               SamplingParams(max_tokens=args.steps + 16, ignore_eos=True,
                                              temperature=0))
        while any(s.num_computed_tokens < args.context
                  for r in engine.requests.values() for s in r.seqs):
            engine.step()
        engines[text] = engine
    times: dict[str, list[float]] = {text: [] for text in engines}
    for _ in range(args.steps):
        for text, engine in engines.items():
            start = time.perf_counter()
            engine.step()
            times[text].append(time.perf_counter() - start)
    medians = {text: statistics.median(t[5:]) for text, t in times.items()}
    first = args.variant[0]
    for text, median in medians.items():
        print(f"{text}: median decode step {median * 1e3:.1f} ms "
              f"({medians[first] / median:.2f}x {first})")


if __name__ == "__main__":
    main()
