"""The server over data-parallel replicas and over tensor-parallel workers."""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import signal
from pathlib import Path

import httpx
from server_helpers import ServerProcess, scrape, wait_for
from test_engine import make_prompts

from rvllm import LLM, SamplingParams

# For a request that must still be generating when the test kills a process under it, and
# that the test ends itself: thousands of steps on the 4096-position model (its prompt
# here is 3 tokens), seconds even at a fraction of a millisecond a step, against the few
# milliseconds from its first token to the kill.
UNENDING = 4000
# A hang watchdog: 10x and more what any wait below takes.
WATCHDOG_S = 120.0


def _complete(url: str, prompt: list[int], max_tokens: int = 12) -> str:
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "logprobs": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=WATCHDOG_S)
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
        body = {"model": "m", "prompt": [5, 6, 7], "max_tokens": UNENDING, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body,
                          timeout=WATCHDOG_S) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            for pid in workers:
                os.kill(pid, signal.SIGKILL)
            rest = "\n".join(lines)
        assert "error" in rest
        server.proc.wait(timeout=WATCHDOG_S)
    finally:
        server.stop()


def test_killed_data_parallel_replica_fails_its_stream_and_comes_back(long_llama_dir: Path,
                                                                     tmp_path: Path) -> None:
    # The replica restarts from this copy; while the test has it moved away, a restart
    # fails (and is retried), so the test, not the restart's speed, decides how long the
    # server runs on one replica.
    model, moved = tmp_path / "model", tmp_path / "moved"
    shutil.copytree(long_llama_dir, model)
    server = ServerProcess(model, "--data-parallel-size", "2", "--served-model-name", "m")
    try:
        replicas = _spawned_descendants(server.proc.pid, children_only=True)
        assert len(replicas) == 2, replicas
        blocks = scrape(server.url)["vllm:num_gpu_blocks"]
        body = {"model": "m", "prompt": [5, 6, 7], "max_tokens": UNENDING, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body,
                          timeout=WATCHDOG_S) as r0, \
                httpx.stream("POST", f"{server.url}/v1/completions", json=body,
                             timeout=WATCHDOG_S) as r1:
            streams = [r0.iter_lines(), r1.iter_lines()]
            for lines in streams:  # one on each replica, both generating
                next(line for line in lines if line.startswith("data: "))
            model.rename(moved)
            os.kill(replicas[0], signal.SIGKILL)
            # Read both, a line at a time, until the dead replica's stream has ended: the
            # other cannot end on its own.
            seen: list[list[str]] = [[], []]
            while "data: [DONE]" not in seen[0] + seen[1]:
                for i in (0, 1):
                    seen[i].append(next(streams[i]))
            dead = 0 if "data: [DONE]" in seen[0] else 1
            assert any("error" in line for line in seen[dead])
            # The survivor runs on, with no error: another token after the other's end.
            survivor = 1 - dead
            seen[survivor].append(next(line for line in streams[survivor]
                                       if line.startswith("data: ")))
            assert not any("error" in line for line in seen[survivor])
            assert json.loads(seen[survivor][-1][6:])["choices"][0]["finish_reason"] is None
            # A dead replica has no KV cache.
            assert wait_for(lambda: scrape(server.url)["vllm:num_gpu_blocks"] == blocks / 2,
                            WATCHDOG_S)
            # The other replica serves while the dead one cannot come back.
            assert httpx.get(f"{server.url}/health").status_code == 200
            expected = _complete(server.url, [5, 6, 7])
            moved.rename(model)
        # The survivor's client has left (its request is aborted). The pool is whole again
        # once the replica is back.
        assert wait_for(lambda: scrape(server.url)["vllm:num_gpu_blocks"] == blocks, WATCHDOG_S)
        assert replicas[0] not in _spawned_descendants(server.proc.pid, children_only=True)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            assert list(pool.map(lambda _: _complete(server.url, [5, 6, 7]), range(2))) \
                == [expected, expected]
        assert server.proc.poll() is None
    finally:
        server.stop()
