"""N=1 decode steps through the runner's compiled CPU decode (``CausalLM.decode_logits``:
token ids to logits and the greedy token in one call) against the general path (tensors,
forward context, ``compute_logits``, the sampler) on the same engine, alternated in one
process (issue 6, session 15).

    python scripts/bench_compiled_decode_ab.py --model MODEL [--quantization int8]
"""

from __future__ import annotations

import argparse
import statistics
import time

from rvllm import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--rounds", type=int, default=24)
    parser.add_argument("--steps", type=int, default=8, help="steps a turn")
    ns = parser.parse_args()
    engine = LLM(ns.model, quantization=ns.quantization).engine
    model = engine.model
    params = SamplingParams(temperature=0, ignore_eos=True,
                            max_tokens=2 * ns.rounds * (ns.steps + 1) + 8)
    engine.add_request(None, {"prompt_token_ids": list(range(10, 42))}, params)
    for _ in range(3):
        engine.step()
    times: dict[str, list[float]] = {"compiled decode": [], "general path": []}
    for _ in range(ns.rounds):
        for name, steps in times.items():
            if name == "general path":
                model.decode_logits = lambda *args, **kwargs: None  # the runner falls back
            else:
                model.__dict__.pop("decode_logits", None)
            engine.step()  # the first step after a switch is not timed
            for _ in range(ns.steps):
                start = time.perf_counter()
                engine.step()
                steps.append(time.perf_counter() - start)
    medians = {name: statistics.median(steps) for name, steps in times.items()}
    for name, median in medians.items():
        print(f"{name}: median {median * 1e3:.3f} ms a step")
    print(f"general / compiled = {medians['general path'] / medians['compiled decode']:.3f}")


if __name__ == "__main__":
    main()
