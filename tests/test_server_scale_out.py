"""The server over data-parallel replicas and over tensor-parallel workers."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
from pathlib import Path

import httpx
from conftest import LONG_TOKENS
from server_helpers import ServerProcess, scrape, wait_for
from test_engine import make_prompts

from rvllm import LLM, SamplingParams


def _complete(url: str, prompt: list[int], max_tokens: int = 12) -> str:
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "logprobs": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def test_data_parallel_server_matches_one_engine(llama_dir: Path) -> None:
    prompts = make_prompts()
    llm = LLM(str(llama_dir))
    expected = [o.outputs[0].text for o in llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))]
    server = ServerProcess(llama_dir, "--data-parallel-size", "2", "--served-model-name", "m")
    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            texts = list(pool.map(lambda p: _complete(server.url, p), prompts))
        assert texts == expected
        metrics = httpx.get(f"{server.url}/metrics").text
        assert "vllm:generation_tokens_total" in metrics
    finally:
        server.stop()


def _spawned_descendants(pid: int, children_only: bool = False) -> list[int]:
    """Processes started with multiprocessing's spawn below ``pid`` (its children only,
    with ``children_only``): data-parallel replicas are the server's children; the
    tensor-parallel workers are started by its engine process, a child of the server."""
    parents, cmdlines = {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmdlines[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        parents[int(entry.name)] = int(stat[1])

    def below(p: int) -> bool:
        while p in parents and p != pid:
            p = parents[p]
        return p == pid

    return [p for p, line in cmdlines.items()
            if p != pid and b"spawn_main" in line
            and (parents.get(p) == pid if children_only else below(p))]


def test_dead_tensor_parallel_worker_fails_requests_and_exits(long_llama_dir: Path) -> None:
    server = ServerProcess(long_llama_dir, "--tensor-parallel-size", "2",
                           "--served-model-name", "m")
    try:
        workers = _spawned_descendants(server.proc.pid)
        assert workers, "no tensor-parallel worker found"
        body = {"model": "m", "prompt": [5, 6, 7], "max_tokens": LONG_TOKENS, "ignore_eos": True,
                "stream": True}
        start = time.monotonic()
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body,
                          timeout=30) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            for pid in workers:
                os.kill(pid, signal.SIGKILL)
            rest = "\n".join(lines)
        assert "error" in rest
        server.proc.wait(timeout=30)
        assert time.monotonic() - start < 30
    finally:
        server.stop()


def test_killed_data_parallel_replica_fails_its_stream_and_comes_back(long_llama_dir: Path
                                                                     ) -> None:
    server = ServerProcess(long_llama_dir, "--data-parallel-size", "2",
                           "--served-model-name", "m")
    try:
        replicas = _spawned_descendants(server.proc.pid, children_only=True)
        assert len(replicas) == 2, replicas
        blocks = scrape(server.url)["vllm:num_gpu_blocks"]
        body = {"model": "m", "prompt": [5, 6, 7], "max_tokens": LONG_TOKENS, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body,
                          timeout=30) as r0, \
                httpx.stream("POST", f"{server.url}/v1/completions", json=body,
                             timeout=30) as r1:
            streams = [r0.iter_lines(), r1.iter_lines()]
            for lines in streams:  # one on each replica, both generating
                next(line for line in lines if line.startswith("data: "))
            os.kill(replicas[0], signal.SIGKILL)
            # A dead replica has no KV cache (checked at once: the survivor's stream runs
            # on for longer than the restart takes).
            assert wait_for(lambda: scrape(server.url)["vllm:num_gpu_blocks"] == blocks / 2,
                            10)
            rests = ["\n".join(lines) for lines in streams]
        assert sum("error" in rest for rest in rests) == 1
        assert all(rest.rstrip().endswith("data: [DONE]") for rest in rests)
        # The other replica serves while the dead one restarts.
        assert httpx.get(f"{server.url}/health").status_code == 200
        expected = _complete(server.url, [5, 6, 7])
        # The pool is whole again once the replica is back.
        assert wait_for(lambda: scrape(server.url)["vllm:num_gpu_blocks"] == blocks, 60)
        assert replicas[0] not in _spawned_descendants(server.proc.pid, children_only=True)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            assert list(pool.map(lambda _: _complete(server.url, [5, 6, 7]), range(2))) \
                == [expected, expected]
        assert server.proc.poll() is None
    finally:
        server.stop()
