"""``rvllm bench soak``: hours of mixed, partly hostile traffic against a running server
on this machine, and an account of every request.

Workers send, for ``--duration`` seconds, a mix of: completions and chat, streamed and
whole, some with ``n`` > 1; streams the client abandons after a few events; requests it
hangs up on before any answer; bad inputs (wrong types, unknown fields, a constraint
that does not compile); and prompts far past the context. Every request the client did
not abandon must end in exactly one complete answer (a finish reason, and ``[DONE]`` for
a stream) or one clear error (a 4xx/503 JSON error, or an error event closing a
stream); anything else (a 500, a dropped connection, a stream cut off) counts as lost.

At the end, once the server is idle, the engine's resident memory (``/metrics``) is
compared with its level after a warm-up (which also touches the whole KV cache, whose
memory becomes resident as blocks are first used), and the KV blocks must all be free
again.
Loopback only: ``--base-url`` must name this machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

if TYPE_CHECKING:  # httpx loads when the command runs, so `rvllm --help` stays fast
    import httpx

_LOOPBACK = {"127.0.0.1", "localhost", "::1"}
_MEMORY = "rvllm:engine_resident_memory_bytes"
_KINDS = ("completion", "completion_stream", "chat", "chat_stream", "n_many", "abandon",
          "hang_up", "bad_type", "unknown_field", "bad_grammar", "too_long")


def add_soak_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000",
                        help="the server (on this machine)")
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of traffic")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens a request asks for")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--memory-tolerance", type=float, default=0.05,
                        help="the largest growth of the engine's memory that passes")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the results here")


@dataclass
class SoakResult:
    sent: Counter = field(default_factory=Counter)
    answered: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)  # clear errors, by status
    abandoned: int = 0
    lost: list[str] = field(default_factory=list)


async def _metrics(client: httpx.AsyncClient) -> dict[str, float]:
    text = (await client.get("/metrics")).text
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name.split("{")[0]] = float(value)
    return values


async def _wait_idle(client: httpx.AsyncClient, timeout: float = 120.0) -> dict[str, float]:
    """/metrics once nothing runs or waits (and the blocks are free), or at the timeout."""
    deadline = time.monotonic() + timeout
    while True:
        m = await _metrics(client)
        idle = (m.get("vllm:num_requests_running", 0) == 0
                and m.get("vllm:num_requests_waiting", 0) == 0
                and m.get("vllm:num_free_blocks") == m.get("vllm:num_gpu_blocks"))
        if idle or time.monotonic() > deadline:
            return m
        await asyncio.sleep(0.2)


def _body(kind: str, model: str, rng: random.Random, max_tokens: int) -> tuple[str, Any]:
    words = " ".join(rng.choice(("alpha", "beta", "gamma", "delta", "tea", "rain"))
                     for _ in range(rng.randint(3, 40)))
    if kind in ("completion", "completion_stream", "n_many", "abandon", "hang_up"):
        body: dict[str, Any] = {"model": model, "prompt": words, "max_tokens": max_tokens,
                                "temperature": rng.choice((0.0, 0.8))}
        if kind == "n_many":
            body["n"] = rng.randint(2, 4)
        if kind in ("completion_stream", "abandon"):
            body["stream"] = True
        return "/v1/completions", body
    if kind in ("chat", "chat_stream"):
        return "/v1/chat/completions", {
            "model": model, "messages": [{"role": "user", "content": words}],
            "max_tokens": max_tokens, "stream": kind == "chat_stream"}
    if kind == "bad_type":
        return "/v1/completions", {"model": model, "prompt": words, "max_tokens": "many"}
    if kind == "unknown_field":
        return "/v1/completions", {"model": model, "prompt": words, "temprature": 1}
    if kind == "bad_grammar":
        return "/v1/completions", {"model": model, "prompt": words,
                                   "guided_regex": "([a-z" + "(" * rng.randint(1, 5)}
    return "/v1/completions", {"model": model, "prompt": "word " * 400_000}  # too_long


async def _settled(client: httpx.AsyncClient, timeout: float = 90.0) -> dict[str, float]:
    """/metrics once idle and the engine's memory has stopped moving (its start-up work,
    such as weight packing, goes on in idle time): within 0.5% over 3 s, or at the
    timeout."""
    deadline = time.monotonic() + timeout
    last = await _wait_idle(client)
    while time.monotonic() < deadline:
        await asyncio.sleep(3.0)
        now = await _wait_idle(client)
        before, after = last.get(_MEMORY, 0.0), now.get(_MEMORY, 0.0)
        if before and abs(after / before - 1.0) < 0.005:
            return now
        last = now
    return last


async def _fill_cache(client: httpx.AsyncClient, model: str, rng: random.Random,
                      max_rounds: int = 40) -> None:
    """Long distinct prompts until the engine's memory stops growing: the KV cache's
    memory is reserved at start-up but becomes resident as its blocks are first used,
    which is not growth the soak should count."""
    max_len = (await client.get("/v1/models")).json()["data"][0].get("max_model_len", 2048)
    last = (await _metrics(client)).get(_MEMORY, 0.0)
    for _ in range(max_rounds):
        # Numbers of up to four digits: at most a few tokens each, so each prompt fits.
        prompts = [" ".join(str(rng.randint(0, 9999)) for _ in range(max_len // 8))
                   for _ in range(16)]
        await asyncio.gather(*(client.post("/v1/completions", json={
            "model": model, "prompt": p, "max_tokens": 1}) for p in prompts))
        now = (await _wait_idle(client)).get(_MEMORY, 0.0)
        if not last or now < last * 1.005:
            return
        last = now


async def _one(client: httpx.AsyncClient, kind: str, path: str, body: Any,
               result: SoakResult, rng: random.Random) -> None:
    import httpx

    result.sent[kind] += 1
    label = f"{kind} {path}"
    try:
        if kind == "hang_up":
            # A client of its own, as a real one that hangs up is: a request cancelled
            # mid-flight can leave its connection held in the pool, and the shared
            # client's other requests then waited for a free one (300 s each).
            async with httpx.AsyncClient(base_url=client.base_url,
                                         timeout=client.timeout) as own:
                task = asyncio.ensure_future(own.post(path, json=body))
                await asyncio.sleep(rng.uniform(0.0, 0.05))
                task.cancel()
                try:
                    await task
                except (asyncio.CancelledError, httpx.TransportError):
                    pass
                else:  # answered before the hang-up
                    result.answered[kind] += 1
                    return
            result.abandoned += 1
            return
        if body.get("stream"):
            await _stream(client, kind, path, body, result, rng)
            return
        r = await client.post(path, json=body)
        if r.status_code == 200 and all(c.get("finish_reason")
                                        for c in r.json()["choices"]):
            result.answered[kind] += 1
        elif 400 <= r.status_code < 500 or r.status_code == 503:
            assert "error" in r.json()
            result.errors[r.status_code] += 1
        else:
            result.lost.append(f"{label}: status {r.status_code}")
    except (httpx.TransportError, AssertionError, json.JSONDecodeError, KeyError) as e:
        result.lost.append(f"{label}: {type(e).__name__}: {e}")


async def _stream(client: httpx.AsyncClient, kind: str, path: str, body: Any,
                  result: SoakResult, rng: random.Random) -> None:
    """One streamed request: answered (a finish reason, then [DONE]), a clear error
    (status or error event), abandoned on purpose, or lost."""
    stop_after = rng.randint(1, 5) if kind == "abandon" else None
    events = 0
    finished = done = False
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            (result.errors.__setitem__(r.status_code, result.errors[r.status_code] + 1)
             if 400 <= r.status_code < 500 or r.status_code == 503
             else result.lost.append(f"{kind}: status {r.status_code}"))
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            payload = json.loads(line[6:])
            if "error" in payload:
                result.errors["stream"] += 1
                return
            finished = finished or any(c.get("finish_reason") for c in payload["choices"])
            events += 1
            if stop_after is not None and events >= stop_after:
                result.abandoned += 1
                return  # leaving the block closes the connection mid-stream
    if done and finished:
        result.answered[kind] += 1
    else:
        result.lost.append(f"{kind}: stream ended without {'[DONE]' if not done else 'a finish'}")


async def run_soak(ns: argparse.Namespace) -> dict[str, Any]:
    import httpx

    host = urlparse(ns.base_url).hostname
    if host not in _LOOPBACK:
        raise ValueError(f"bench soak runs against this machine only, not {host!r}.")
    rng = random.Random(ns.seed)
    limits = httpx.Limits(max_connections=ns.concurrency * 2)
    async with httpx.AsyncClient(base_url=ns.base_url, timeout=300.0, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        warm = SoakResult()
        await asyncio.gather(*(_one(client, k, *_body(k, model, rng, ns.max_tokens), warm, rng)
                               for k in ("completion", "chat_stream", "n_many", "too_long")))
        await _fill_cache(client, model, rng)
        before = await _settled(client)
        result = SoakResult()
        deadline = time.monotonic() + ns.duration

        async def worker(seed: int) -> None:
            wrng = random.Random(seed)
            while time.monotonic() < deadline:
                kind = wrng.choice(_KINDS)
                await _one(client, kind, *_body(kind, model, wrng, ns.max_tokens), result,
                           wrng)

        start = time.monotonic()
        await asyncio.gather(*(worker(ns.seed * 1000 + i) for i in range(ns.concurrency)))
        elapsed = time.monotonic() - start
        after = await _wait_idle(client)
    mem_key = _MEMORY
    growth = (after[mem_key] / before[mem_key] - 1.0) if before.get(mem_key) else None
    report = {
        "duration_s": round(elapsed, 1), "concurrency": ns.concurrency,
        "sent": dict(result.sent), "sent_total": sum(result.sent.values()),
        "answered": sum(result.answered.values()),
        "clear_errors": {str(k): v for k, v in result.errors.items()},
        "abandoned_by_client": result.abandoned, "lost": len(result.lost),
        "lost_examples": result.lost[:10],
        "engine_memory_before_bytes": before.get(mem_key),
        "engine_memory_after_bytes": after.get(mem_key),
        "engine_memory_growth": growth,
        "free_blocks_after": after.get("vllm:num_free_blocks"),
        "blocks": after.get("vllm:num_gpu_blocks"),
    }
    report["passed"] = bool(
        not result.lost and after.get("vllm:num_free_blocks") == after.get("vllm:num_gpu_blocks")
        and (growth is None or growth <= ns.memory_tolerance))
    return report


def main(ns: argparse.Namespace) -> int:
    report = asyncio.run(run_soak(ns))
    print(json.dumps(report, indent=2))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({**report, "command": "rvllm bench soak", "args": vars(ns)}, f, indent=2,
                      default=str)
    return 0 if report["passed"] else 1
