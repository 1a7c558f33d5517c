"""``rvllm bench perplexity``: perplexity of a fixed text, to put a number on what a
quantized or otherwise faster path costs in accuracy next to float32.

The text is scored in windows of ``--window`` tokens (no overlap; the first token of each
window is context only) through the engine's prompt logprobs, so it measures exactly the
path that serves requests. Perplexity = exp(mean negative log-likelihood per token).
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

from rvllm.bench.report import format_table, write_json

# Our own plain-English passage, long enough for a few hundred tokens of any tokenizer.
TEXT = (
    "A river begins as rain. Water falls on the hills, soaks into the soil, and finds its "
    "way down through cracks in the rock until it meets a layer it cannot pass. There it "
    "gathers and moves sideways, sometimes for years, before it comes out again as a spring. "
    "Many springs make a stream, and many streams make a river. The river carries more than "
    "water: it moves sand, gravel and whole trees, and it cuts its valley a little deeper "
    "every flood. Near the sea the land flattens, the current slows, and the river drops "
    "the mud it has carried, building the wide plains where people have farmed for "
    "thousands of years. Those plains are rich because they are renewed. Each flood spreads "
    "a thin layer of fresh soil over the fields, and the farmers who lived beside the great "
    "rivers learned to read the seasons by the height of the water. They built calendars, "
    "measured land, kept records of harvests and taxes, and in doing so invented much of "
    "the arithmetic and writing we still use. Cities grew where rivers could be crossed or "
    "where two rivers met, because boats were the cheapest way to move heavy goods. A barge "
    "pulled by a few animals could carry as much grain as a hundred carts. Today most "
    "freight moves by road, rail or pipe, yet rivers still matter. They cool power "
    "stations, water crops, carry ships inland, and supply drinking water to billions of "
    "people. Keeping them clean is harder than it sounds. A river collects everything that "
    "washes off the land around it: fertiliser from fields, oil from streets, and waste "
    "from towns. Engineers now treat sewage before it is released, farmers leave strips of "
    "grass along the banks to catch runoff, and in many places fish have returned to "
    "waters that were lifeless fifty years ago. The lesson is simple to state and slow to "
    "learn: a river is the sum of its whole basin, and it can only be as healthy as the "
    "land that feeds it."
)


def add_perplexity_args(parser: argparse.ArgumentParser) -> None:
    from rvllm.cli_args import add_engine_args

    g = parser.add_argument_group("perplexity")
    g.add_argument("--text-file", default=None,
                   help="score this UTF-8 text instead of the built-in passage")
    g.add_argument("--window", type=int, default=256, help="tokens per scored window")
    g.add_argument("--json", default=None, metavar="PATH", help="write the result here")
    add_engine_args(parser)


def perplexity_of(llm: Any, token_ids: list[int], window: int) -> tuple[float, int]:
    """(perplexity, tokens scored) of ``token_ids`` under ``llm``."""
    from rvllm.sampling_params import SamplingParams

    if window < 2:
        raise ValueError("--window must be at least 2 tokens.")
    chunks = [token_ids[i:i + window] for i in range(0, len(token_ids), window)]
    chunks = [c for c in chunks if len(c) >= 2]
    params = SamplingParams(max_tokens=0, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": c} for c in chunks], params)
    nll, count = 0.0, 0
    for chunk, out in zip(chunks, outputs):
        for token, entry in zip(chunk[1:], out.prompt_logprobs[1:]):
            nll -= entry[token].logprob
            count += 1
    return math.exp(nll / count), count


def main(args: argparse.Namespace) -> int:
    from rvllm.cli_args import engine_args_from_namespace
    from rvllm.engine.llm import LLM

    engine_args = engine_args_from_namespace(args)
    engine_args.show_progress = False
    llm = LLM.from_engine_args(engine_args)
    text = TEXT
    if args.text_file:
        with open(args.text_file, encoding="utf-8") as f:
            text = f.read()
    ids = llm.get_tokenizer().encode(text)
    start = time.perf_counter()
    ppl, count = perplexity_of(llm, ids, args.window)
    seconds = time.perf_counter() - start
    engine = llm.engine
    row = {"model": engine.model_config.path, "linear_backend": engine.model.linear_backend,
           "quantization": engine.quantization, "tokens": count,
           "perplexity": round(ppl, 4), "seconds": round(seconds, 2)}
    print(format_table([row], [(k, k) for k in row]))
    if args.json:
        write_json(args.json, {"benchmark": "perplexity", "text": args.text_file or "built-in",
                               "window": args.window, **row})
    return 0
