"""``rvllm bench serve``: load an OpenAI-compatible server and measure what clients see.

Requests arrive as a Poisson process at ``--request-rate`` (all at once by default), at
most ``--max-concurrency`` in flight, each streamed so TTFT is the arrival of the first
token. Reports vLLM's metric names: request and output-token throughput and the
mean/median/p90/p95/p99 of TTFT, TPOT, ITL and E2EL. Works against rvllm, vLLM and
llama.cpp's ``llama-server`` alike. ``--structured-outputs json`` (or json_object, choice,
regex) makes every request a constrained one, to see what a grammar costs a server.
``--dataset quote`` asks to repeat or lightly reformat a passage of rvllm's own source or
docs given in the prompt, the input-quoting work where prompt-lookup speculation pays.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rvllm.bench import http_client
from rvllm.bench.report import format_table, machine_info, write_json
from rvllm.bench.stats import RequestTiming, serve_metrics

FIXED_PROMPT = ("The history of computing is a story of machines that learned to follow "
                "instructions faster than the people who wrote them. ")

# ``--structured-outputs``: the constraint every request carries, if any.
STRUCTURED_OUTPUT_KINDS = ("none", "json", "json_object", "choice", "regex")
BENCH_CHOICES = ["positive", "negative", "neutral", "mixed"]
BENCH_REGEX = r"[A-Z][a-z]{2,12} [A-Z][a-z]{2,12}, [0-9]{1,3}, [a-z]{3,12}@[a-z]{3,10}\.(com|org)"

# ``--dataset quote``: what each prompt asks of its passage (most of the passage's tokens
# stay as they are in the answer).
QUOTE_INSTRUCTIONS = (
    "Repeat the following text exactly, with no commentary.",
    "Copy the following passage word for word.",
    "Rewrite the following text unchanged, except fix any typos you find.",
    "Reformat the following text as a Markdown block quote: start every line with '> '.",
    "Put the following text in a fenced code block, unchanged.",
    "Reproduce the following text, adding a line number at the start of each line.",
)
QUOTE_CHARS_PER_TOKEN = 3.5  # a passage's length estimate, code and English prose alike


def bench_json_schema(name_field: str = "name") -> dict[str, Any]:
    """A typical JSON schema of a record: seven typed fields, one of them an object of
    three, closed objects with every field required (as OpenAI's strict mode wants).
    ``name_field`` renames the first field, for schemas of the same shape that differ."""
    address = {"type": "object",
               "properties": {"city": {"type": "string", "maxLength": 32},
                              "country": {"type": "string", "maxLength": 32},
                              "postal_code": {"type": "string", "maxLength": 10}},
               "required": ["city", "country", "postal_code"],
               "additionalProperties": False}
    properties = {
        name_field: {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"type": "string", "enum": ["engineer", "designer", "manager", "analyst",
                                            "other"]},
        "active": {"type": "boolean"},
        "rating": {"type": "number"},
        "address": address,
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16},
                 "maxItems": 3},
    }
    return {"title": "Record", "type": "object", "properties": properties,
            "required": list(properties), "additionalProperties": False}


@dataclass(slots=True)
class BenchRequest:
    """One request of the workload: a text prompt or token ids, and its output length."""

    prompt: str | list[int]
    prompt_len: int  # tokens when known exactly (token ids), else an estimate
    output_len: int


def add_serve_bench_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000",
                        help="server root (the /v1 routes are below it)")
    parser.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    parser.add_argument("--model", default=None,
                        help="model name to send (default: the first of /v1/models)")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="most requests in flight (default: no limit)")
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="requests per second, Poisson arrivals (default inf: all at once)")
    parser.add_argument("--dataset", default="random",
                        help="random, fixed, quote (repeat or reformat a passage of rvllm's "
                             "own source or docs given in the prompt), or a .jsonl file of "
                             "{\"prompt\": ..., \"output_len\": ...} lines")
    parser.add_argument("--quote-len", type=int, default=300,
                        help="--dataset quote: a passage's length in tokens, about (whole "
                             "lines, each passage 2/3 to 4/3 of it; default 300)")
    parser.add_argument("--random-input-len", type=int, default=128)
    parser.add_argument("--random-output-len", type=int, default=128)
    parser.add_argument("--random-range-ratio", type=float, default=0.0,
                        help="lengths drawn uniformly in [len*(1-r), len*(1+r)]")
    parser.add_argument("--random-output-range-ratio", type=float, default=None,
                        help="the output lengths' own range ratio (default: "
                             "--random-range-ratio), e.g. inputs 32-512 with outputs 32-256")
    parser.add_argument("--random-vocab-size", type=int, default=32000,
                        help="random prompt token ids are drawn below this")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="ask the server to generate the full output length")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, metavar="PATH", help="write the results here")
    parser.add_argument("--label", default=None, help="engine name recorded in the JSON")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds one request may take before it counts as failed")
    parser.add_argument("--structured-outputs", choices=STRUCTURED_OUTPUT_KINDS,
                        default="none",
                        help="constrain every request: json (a typical nested schema, as "
                             "response_format json_schema on chat and structured_outputs on "
                             "completions), json_object, choice or regex (default none)")


def _lengths(base: int, ratio: float, count: int, rng: random.Random) -> list[int]:
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {ratio}.")
    lo, hi = max(1, int(base * (1 - ratio))), max(1, int(base * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(count)]


def build_dataset(ns: argparse.Namespace) -> list[BenchRequest]:
    """The workload ``--dataset`` names, reproducible from ``--seed``.

    ``random`` gives token-id prompts (exact lengths; the completions endpoint takes
    them), or random words for chat. ``fixed`` repeats one English passage. ``quote``
    gives text prompts that ask to repeat or reformat a passage (``quote_prompts``).
    """
    if ns.num_prompts < 1:
        raise ValueError(f"--num-prompts must be at least 1, got {ns.num_prompts}.")
    rng = random.Random(ns.seed)
    count = ns.num_prompts
    if ns.dataset not in ("random", "fixed", "quote"):
        return _jsonl_dataset(Path(ns.dataset), count, ns.random_output_len)
    in_lens = _lengths(ns.random_input_len, ns.random_range_ratio, count, rng)
    out_ratio = getattr(ns, "random_output_range_ratio", None)
    out_lens = _lengths(ns.random_output_len,
                        ns.random_range_ratio if out_ratio is None else out_ratio, count, rng)
    if ns.dataset == "quote":
        prompts = quote_prompts(count, getattr(ns, "quote_len", 300), rng)
        return [BenchRequest(p, int(len(p) / QUOTE_CHARS_PER_TOKEN), n_out)
                for p, n_out in zip(prompts, out_lens)]
    requests = []
    for i, (n_in, n_out) in enumerate(zip(in_lens, out_lens)):
        if ns.dataset == "fixed":
            words = (FIXED_PROMPT * (n_in // 10 + 1)).split()[:n_in]
            requests.append(BenchRequest(" ".join(words), n_in, n_out))
        elif ns.endpoint == "chat":
            words = [f"w{rng.randrange(100000)}" for _ in range(n_in)]
            requests.append(BenchRequest(f"{i} " + " ".join(words), n_in, n_out))
        else:
            low = min(1000, ns.random_vocab_size - 1)
            ids = [rng.randrange(low, ns.random_vocab_size) for _ in range(n_in)]
            requests.append(BenchRequest(ids, n_in, n_out))
    return requests


def quote_sources() -> list[Path]:
    """The texts quote prompts draw passages from: the rvllm package's own ``.py`` files
    and, in a source checkout, the ``docs/*.md`` beside it; sorted, so a seed picks the
    same passages from the same tree."""
    package = Path(__file__).resolve().parent.parent
    files = sorted(package.rglob("*.py")) + sorted((package.parent / "docs").glob("*.md"))
    return [f for f in files if "__pycache__" not in f.parts]


def quote_passage(lines: list[str], start: int, target_chars: int) -> str:
    """Whole lines from ``start`` (moved back to the start of its block, after a blank
    line) until the passage reaches ``target_chars``; trailing blank lines dropped."""
    while start > 0 and lines[start - 1].strip():
        start -= 1
    while start < len(lines) - 1 and not lines[start].strip():
        start += 1
    end, size = start, 0
    while end < len(lines) and size < target_chars:
        size += len(lines[end]) + 1
        end += 1
    return "\n".join(lines[start:end]).rstrip()


def quote_prompts(count: int, quote_len: int, rng: random.Random,
                  sources: list[Path] | None = None) -> list[str]:
    """``count`` input-quoting prompts: an instruction to repeat or lightly reformat
    (``QUOTE_INSTRUCTIONS``) and a passage of about ``quote_len`` tokens (2/3 to 4/3 of
    it) from ``sources`` (``quote_sources()``): code (in a fenced block) or, as often
    when there is any, Markdown prose. Deterministic from ``rng``'s state."""
    if quote_len < 16:
        raise ValueError(f"--quote-len must be at least 16, got {quote_len}.")
    groups: dict[bool, list[tuple[Path, list[str]]]] = {}
    for path in sources if sources is not None else quote_sources():
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError):
            continue
        # Long enough for a passage with room to pick where it starts.
        if sum(len(line) + 1 for line in lines) >= 2 * quote_len * QUOTE_CHARS_PER_TOKEN:
            groups.setdefault(path.suffix == ".py", []).append((path, lines))
    if not groups:
        raise ValueError("--dataset quote found no source text long enough to quote.")
    kinds = sorted(groups)
    prompts = []
    for _ in range(count):
        texts = groups[kinds[rng.randrange(len(kinds))]]
        path, lines = texts[rng.randrange(len(texts))]
        target = rng.randint(2 * quote_len // 3, 4 * quote_len // 3)
        chars = int(target * QUOTE_CHARS_PER_TOKEN)
        # A start that leaves at least a passage's worth of text after it.
        tail, last = 0, len(lines)
        while last > 0 and tail < chars:
            last -= 1
            tail += len(lines[last]) + 1
        passage = quote_passage(lines, rng.randrange(last + 1), chars)
        instruction = QUOTE_INSTRUCTIONS[rng.randrange(len(QUOTE_INSTRUCTIONS))]
        if path.suffix == ".py":
            passage = f"```python\n{passage}\n```"
        prompts.append(f"{instruction}\n\n{passage}")
    return prompts


def _jsonl_dataset(path: Path, count: int, default_out: int) -> list[BenchRequest]:
    if not path.is_file():
        raise FileNotFoundError(f"--dataset {path}: no such file (or use random / fixed).")
    rows = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompt = row["prompt"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(f"{path}:{lineno}: each line must be a JSON object with "
                             "a 'prompt'.") from None
        out_len = int(row.get("output_len", default_out))
        plen = len(prompt) if isinstance(prompt, list) else len(str(prompt).split())
        rows.append(BenchRequest(prompt, plen, out_len))
    if not rows:
        raise ValueError(f"{path} holds no prompts.")
    return [rows[i % len(rows)] for i in range(count)]


def arrival_delays(count: int, rate: float, rng: random.Random) -> list[float]:
    """Gaps before each request: 0 for an infinite rate, else Exponential(rate) draws,
    which makes the arrivals a Poisson process."""
    if rate <= 0:
        raise ValueError(f"--request-rate must be positive, got {rate}.")
    if math.isinf(rate):
        return [0.0] * count
    return [rng.expovariate(rate) for _ in range(count)]


def request_payload(ns: argparse.Namespace, model: str, req: BenchRequest) -> dict[str, Any]:
    payload: dict[str, Any] = {"model": model, "max_tokens": req.output_len,
                               "temperature": 0.0, "stream": True,
                               "stream_options": {"include_usage": True}}
    if ns.ignore_eos:
        payload["ignore_eos"] = True
    if ns.endpoint == "chat":
        payload["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        payload["prompt"] = req.prompt
    payload.update(structured_output_fields(getattr(ns, "structured_outputs", "none"),
                                            ns.endpoint))
    return payload


def structured_output_fields(kind: str, endpoint: str) -> dict[str, Any]:
    """The request fields of a ``--structured-outputs`` kind: OpenAI's ``response_format``
    for JSON on chat, vLLM's ``structured_outputs`` object otherwise."""
    if kind == "none":
        return {}
    if kind == "json":
        schema = bench_json_schema()
        if endpoint == "chat":
            return {"response_format": {"type": "json_schema",
                                        "json_schema": {"name": "record", "schema": schema}}}
        return {"structured_outputs": {"json": schema}}
    if kind == "json_object":
        if endpoint == "chat":
            return {"response_format": {"type": "json_object"}}
        return {"structured_outputs": {"json_object": True}}
    if kind == "choice":
        return {"structured_outputs": {"choice": list(BENCH_CHOICES)}}
    if kind == "regex":
        return {"structured_outputs": {"regex": BENCH_REGEX}}
    raise ValueError(f"--structured-outputs must be one of {', '.join(STRUCTURED_OUTPUT_KINDS)}"
                     f", got {kind!r}.")


def parse_stream_event(data: str, endpoint: str) -> tuple[bool, int | None]:
    """(whether this event carried output text, the completion_tokens of its usage)."""
    if data == "[DONE]":
        return False, None
    event = json.loads(data)
    usage = event.get("usage") or {}
    completion_tokens = usage.get("completion_tokens")
    has_text = False
    for choice in event.get("choices") or []:
        text = (choice.get("delta") or {}).get("content") if endpoint == "chat" \
            else choice.get("text")
        has_text = has_text or bool(text)
    return has_text, completion_tokens


async def send_request(url: str, payload: dict[str, Any], endpoint: str,
                       prompt_len: int, timeout: float) -> RequestTiming:
    """Stream one request and time every output chunk."""
    timing = RequestTiming(start=time.perf_counter(), prompt_len=prompt_len)
    usage_tokens = None

    async def consume() -> None:
        nonlocal usage_tokens
        async for data in http_client.sse_events(http_client.stream_post(url, payload)):
            has_text, tokens = parse_stream_event(data, endpoint)
            if has_text:
                timing.chunk_times.append(time.perf_counter())
                timing.chunk_tokens.append(1)
            if tokens is not None:
                usage_tokens = tokens

    try:
        await asyncio.wait_for(consume(), timeout)
        timing.end = time.perf_counter()
        timing.output_tokens = usage_tokens if usage_tokens is not None \
            else len(timing.chunk_times)
        timing.success = bool(timing.chunk_times)
        if not timing.success:
            timing.error = "the stream carried no output"
    except (TimeoutError, OSError, ValueError, http_client.HTTPError) as e:
        timing.end = time.perf_counter()
        timing.error = f"{type(e).__name__}: {e}"
    return timing


async def first_model(base_url: str) -> str:
    status, body = await http_client.get(base_url.rstrip("/") + "/v1/models")
    if status != 200:
        raise RuntimeError(f"GET /v1/models answered {status}; pass --model.")
    return json.loads(body)["data"][0]["id"]


async def run_load(ns: argparse.Namespace, requests: list[BenchRequest],
                   model: str) -> tuple[list[RequestTiming], float]:
    """Send the workload on its Poisson schedule; (timings in order, wall seconds)."""
    route = "/v1/chat/completions" if ns.endpoint == "chat" else "/v1/completions"
    url = ns.base_url.rstrip("/") + route
    delays = arrival_delays(len(requests), ns.request_rate, random.Random(ns.seed + 1))
    limit = asyncio.Semaphore(ns.max_concurrency or len(requests))

    async def limited(req: BenchRequest) -> RequestTiming:
        async with limit:
            return await send_request(url, request_payload(ns, model, req), ns.endpoint,
                                      req.prompt_len, ns.timeout)

    start = time.perf_counter()
    tasks = []
    for delay, req in zip(delays, requests):
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(limited(req)))
    timings = await asyncio.gather(*tasks)
    return list(timings), time.perf_counter() - start


def run_serve_bench(ns: argparse.Namespace) -> dict[str, Any]:
    requests = build_dataset(ns)

    async def go() -> tuple[str, list[RequestTiming], float]:
        model = ns.model or await first_model(ns.base_url)
        timings, duration = await run_load(ns, requests, model)
        return model, timings, duration

    model, timings, duration = asyncio.run(go())
    errors = sorted({t.error for t in timings if t.error})
    return {
        "benchmark": "serve",
        "engine": ns.label,
        "base_url": ns.base_url,
        "model": model,
        "config": workload_config(ns),
        "machine": machine_info(),
        "metrics": serve_metrics(timings, duration),
        "errors": errors[:10],
    }


def workload_config(ns: argparse.Namespace) -> dict[str, Any]:
    """The workload flags, as recorded in the serve and race JSON."""
    return {"endpoint": ns.endpoint, "dataset": ns.dataset, "num_prompts": ns.num_prompts,
            "max_concurrency": ns.max_concurrency, "request_rate": str(ns.request_rate),
            "random_input_len": ns.random_input_len,
            "random_output_len": ns.random_output_len,
            "random_range_ratio": ns.random_range_ratio,
            "random_output_range_ratio": getattr(ns, "random_output_range_ratio", None),
            "ignore_eos": ns.ignore_eos, "seed": ns.seed,
            "quote_len": getattr(ns, "quote_len", None) if ns.dataset == "quote" else None,
            "structured_outputs": getattr(ns, "structured_outputs", "none")}


def print_serve_result(result: dict[str, Any]) -> None:
    m = result["metrics"]
    print(f"{'Successful requests:':<40}{m['completed']:>10}")
    print(f"{'Failed requests:':<40}{m['failed']:>10}")
    print(f"{'Benchmark duration (s):':<40}{m['duration']:>10.2f}")
    print(f"{'Total input tokens:':<40}{m['total_input_tokens']:>10}")
    print(f"{'Total generated tokens:':<40}{m['total_output_tokens']:>10}")
    print(f"{'Request throughput (req/s):':<40}{m['request_throughput']:>10.2f}")
    print(f"{'Output token throughput (tok/s):':<40}{m['output_throughput']:>10.2f}")
    print(f"{'Total token throughput (tok/s):':<40}{m['total_token_throughput']:>10.2f}")
    rows = []
    for key, name in [("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL")]:
        rows.append({"metric": f"{name} (ms)", **{s: m[f"{s}_{key}_ms"] for s in
                                                  ("mean", "median", "p90", "p95", "p99")}})
    print(format_table(rows, [("metric", "metric"), ("mean", "mean"), ("median", "median"),
                              ("p90", "p90"), ("p95", "p95"), ("p99", "p99")]))
    for err in result.get("errors") or []:
        print(f"error: {err}", file=sys.stderr)


def main(ns: argparse.Namespace) -> int:
    result = run_serve_bench(ns)
    print_serve_result(result)
    if ns.json:
        write_json(ns.json, result)
        print(f"wrote {ns.json}")
    return 0 if result["metrics"]["completed"] else 1
