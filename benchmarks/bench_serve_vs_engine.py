"""Output-token throughput of the same workload through the direct engine and over HTTP.

Both sides keep ``--concurrency`` requests in flight (closed loop: a finished
request is replaced at once). Both are loaded once and run in turns, so that load
from elsewhere on the machine hits both alike; the median of the per-round ratios
is the result. The HTTP client is a few lines of raw asyncio on keep-alive
connections, so that on a small machine it takes as little CPU from the server as
it can.

    python benchmarks/bench_serve_vs_engine.py --concurrency 32 --num-requests 128 \
        --max-tokens 64 --rounds 5 [engine flags, e.g. --model DIR --max-num-seqs 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections import deque

from rvllm.cli_args import add_engine_args, engine_args_from_namespace
from rvllm.engine.llm_engine import LLMEngine
from rvllm.sampling_params import SamplingParams

PARAGRAPH = ("The engine keeps every running request in one batch, one forward pass per step, "
             "and hands each new token back to its client as soon as it is sampled. ")


def make_prompts(n: int, repeats: int) -> list[str]:
    # The unique part comes first, so no two prompts share a cached prefix block.
    return [f"Request {i}. " + PARAGRAPH * repeats for i in range(n)]


class DirectEngine:
    """The engine in this process, driven on a worker thread as the server drives it:
    torch's intra-op threads run far slower under the main thread when the CPU is
    contended, which would make the two sides differ by more than HTTP."""

    def __init__(self, engine_argv: list[str], max_tokens: int) -> None:
        parser = argparse.ArgumentParser()
        add_engine_args(parser)
        args = engine_args_from_namespace(parser.parse_args(engine_argv))
        args.show_progress = False
        self.engine = LLMEngine(args)
        self.params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)

    def run(self, prompts: list[str], concurrency: int) -> tuple[int, float]:
        result: list[tuple[int, float]] = []

        def drive() -> None:
            start = time.perf_counter()
            tokens = _drive(self.engine, prompts, concurrency, self.params)
            result.append((tokens, time.perf_counter() - start))

        worker = threading.Thread(target=drive)
        worker.start()
        worker.join()
        return result[0]


def _drive(engine: LLMEngine, prompts: list[str], concurrency: int,
           params: SamplingParams) -> int:
    pending = deque(prompts)
    in_flight = tokens = 0
    while pending or engine.has_unfinished_requests():
        while pending and in_flight < concurrency:
            engine.add_request(None, pending.popleft(), params)
            in_flight += 1
        for out in engine.step():
            if out.finished:
                in_flight -= 1
                tokens += len(out.outputs[0].token_ids)
    return tokens


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(engine_argv: list[str], port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "rvllm.server.app", "--port", str(port),
           "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning", *engine_argv]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {' '.join(cmd)}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise TimeoutError("server did not come up")


class Connection:
    """One keep-alive HTTP/1.1 connection, as client libraries pool them."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def stream_one(self, prompt: str, max_tokens: int) -> int:
        """One streamed completion; returns its completion tokens."""
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        assert self.reader is not None
        body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                           "ignore_eos": True, "stream": True,
                           "stream_options": {"include_usage": True}}).encode()
        self.writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\n"
                          b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                          % len(body) + body)
        data = b""
        # The stream is chunked; it ends with [DONE] and then the empty last chunk.
        while not (b"data: [DONE]" in data and data.endswith(b"\r\n0\r\n\r\n")):
            more = await self.reader.read(65536)
            if not more:
                raise RuntimeError(f"connection closed: {data[:300]!r}")
            data += more
        # The usage chunk is the last event before [DONE]; chunk framing never splits one.
        usage_at = data.rfind(b'"usage":{')
        if not data.startswith(b"HTTP/1.1 200") or usage_at < 0:
            raise RuntimeError(f"bad response: {data[:300]!r}")
        usage = json.loads(data[usage_at + 8: data.index(b"}", usage_at) + 1])
        return usage["completion_tokens"]

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def _http_load(port: int, prompts: list[str], concurrency: int, max_tokens: int) -> int:
    queue = deque(prompts)
    total = 0

    async def worker() -> None:
        nonlocal total
        conn = Connection(port)
        try:
            while queue:
                tokens = await conn.stream_one(queue.popleft(), max_tokens)
                total += tokens  # not `total += await ...`: that reads total before awaiting
        finally:
            conn.close()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return total


def run_http(port: int, prompts: list[str], concurrency: int,
             max_tokens: int) -> tuple[int, float]:
    start = time.perf_counter()
    tokens = asyncio.run(_http_load(port, prompts, concurrency, max_tokens))
    return tokens, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-repeats", type=int, default=2,
                        help="copies of a ~30-token paragraph in each prompt")
    parser.add_argument("--rounds", type=int, default=5,
                        help="engine/HTTP pairs, alternated so machine noise hits both")
    ns, engine_argv = parser.parse_known_args()
    prompts = make_prompts(ns.num_requests, ns.prompt_repeats)
    direct = DirectEngine(engine_argv, ns.max_tokens)
    port = free_port()
    server = start_server(engine_argv, port)  # idle while the direct side runs
    try:
        warm = prompts[:ns.concurrency]
        direct.run(warm, ns.concurrency)
        run_http(port, warm, ns.concurrency, ns.max_tokens)
        ratios = []
        for i in range(ns.rounds):
            e_tokens, e_s = direct.run(prompts, ns.concurrency)
            h_tokens, h_s = run_http(port, prompts, ns.concurrency, ns.max_tokens)
            e, h = e_tokens / e_s, h_tokens / h_s
            ratios.append(h / e)
            print(f"round {i + 1}: engine {e:.1f} tok/s, http {h:.1f} tok/s, "
                  f"http/engine {h / e:.3f}", flush=True)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(30)
    print(json.dumps({"concurrency": ns.concurrency, "num_requests": ns.num_requests,
                      "max_tokens": ns.max_tokens, "engine_argv": engine_argv,
                      "cpu_count": os.cpu_count(),
                      "http_over_engine_median": round(statistics.median(ratios), 3),
                      "http_over_engine_all": [round(r, 3) for r in ratios]}))


if __name__ == "__main__":
    main()
