"""What the server refuses before the engine does any work: oversized bodies (413),
prompts that cannot fit (400 without tokenizing them), and requests past the waiting
queue's bound (503 with Retry-After); and a client that stops reading its stream does
not hold up anyone else."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import httpx
import pytest
from server_helpers import ServerProcess, scrape, wait_for

UNENDING = 4000
WATCHDOG_S = 120.0


@pytest.fixture(scope="module")
def server(long_llama_dir):
    srv = ServerProcess(long_llama_dir, "--num-gpu-blocks", "256", "--max-num-seqs", "1",
                        "--max-waiting-requests", "1", "--max-request-body-bytes", "2000000",
                        "--allowed-origins", '["https://app.example"]')
    yield srv
    srv.stop()


def test_an_oversized_body_is_refused_before_it_is_read(server):
    r = httpx.post(f"{server.url}/v1/completions", content=b"x" * 60_000_000,
                   headers={"content-type": "application/json"}, timeout=WATCHDOG_S)
    assert r.status_code == 413
    error = r.json()["error"]
    assert error["code"] == "request_too_large" and "2000000" in error["message"]
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_a_prompt_far_past_the_context_is_refused_untokenized(server):
    words = " ".join(["word"] * 300_000)  # 1.5 MB: under the body limit, far past the context
    for path, body in (("/v1/completions", {"prompt": words}),
                       ("/v1/chat/completions", {"messages": [{"role": "user",
                                                               "content": words}]})):
        r = httpx.post(server.url + path, json=body, timeout=WATCHDOG_S)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "context_length_exceeded", error
        assert len(error["message"]) < 300


def test_past_the_waiting_bound_requests_get_503_with_retry_after(server):
    blocker = {"prompt": "Hold the engine", "max_tokens": UNENDING, "stream": True,
               "ignore_eos": True}
    waiting = {"prompt": "Wait behind it", "max_tokens": 2, "ignore_eos": True}
    done: list[int] = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json=blocker,
                      timeout=WATCHDOG_S) as held:
        lines = held.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        t = threading.Thread(target=lambda: done.append(httpx.post(
            f"{server.url}/v1/completions", json=waiting, timeout=WATCHDOG_S).status_code))
        t.start()
        assert wait_for(lambda: scrape(server.url)["vllm:num_requests_waiting"] == 1,
                        WATCHDOG_S)
        r = httpx.post(f"{server.url}/v1/completions", json=waiting, timeout=WATCHDOG_S)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "server_overloaded"
    t.join(WATCHDOG_S)  # the blocker's client left: it was aborted, the waiting one ran
    assert done == [200]


def test_a_client_that_never_reads_its_stream_holds_up_no_one(server):
    """A raw socket asks for a long stream and never reads a byte of it: its events fill
    the socket's buffers while the engine serves another request to the end."""
    body = json.dumps({"prompt": "Nobody reads this", "max_tokens": 1500, "stream": True,
                       "ignore_eos": True}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        assert wait_for(lambda: scrape(server.url)["vllm:num_requests_running"] == 1,
                        WATCHDOG_S)
        # One sequence at a time: the other request runs once the unread one is done,
        # which needs the engine to go on producing for it whatever the socket does.
        r = httpx.post(f"{server.url}/v1/completions", timeout=WATCHDOG_S, json={
            "prompt": "Am I served?", "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        sock.close()
    assert wait_for(lambda: scrape(server.url)["vllm:num_requests_running"] == 0, WATCHDOG_S)


def _descendants(pid: int) -> list[int]:
    """Every live process below ``pid``: the engine process, and its tensor-parallel
    workers or data-parallel replicas."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            parents.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for its parent's wait."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


GRACE_S = 2.0


def _refused(url: str) -> bool:
    """Whether a new request is turned away: no connection, or a 503."""
    try:
        return httpx.get(f"{url}/v1/models", timeout=1.0).status_code == 503
    except httpx.TransportError:
        return True


@pytest.mark.parametrize("streams,layout", [
    (32, ()),
    (8, ("--data-parallel-size", "2")),
    (8, ("--tensor-parallel-size", "2")),
], ids=["32-streams", "data-parallel", "tensor-parallel"])
def test_sigterm_past_the_grace_ends_every_stream_with_an_error_event(
        long_llama_dir, streams, layout):
    """Streams that cannot finish within --shutdown-timeout end with an error event and
    [DONE], none cut off mid-stream; new requests are turned away at once; the server
    exits (the signal re-raised) within the grace plus 2 s, and no engine process,
    replica or worker outlives it."""
    srv = ServerProcess(long_llama_dir, "--num-gpu-blocks", "1024",
                        "--shutdown-timeout", str(GRACE_S), *layout)
    body = {"prompt": "Go on and on", "max_tokens": UNENDING, "stream": True,
            "ignore_eos": True}
    lines_of: dict[int, list[str]] = {i: [] for i in range(streams)}
    started = threading.Barrier(streams + 1, timeout=WATCHDOG_S)

    def client(i: int) -> None:
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body,
                          timeout=WATCHDOG_S) as r:
            lines = r.iter_lines()
            lines_of[i].append(next(line for line in lines if line.startswith("data: ")))
            started.wait()
            lines_of[i].extend(line for line in lines if line)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(streams)]
    try:
        for t in threads:
            t.start()
        started.wait()
        below = _descendants(srv.proc.pid)
        assert below, "the engine runs in a process of its own"
        srv.proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        assert wait_for(lambda: _refused(srv.url), GRACE_S), "new requests still taken"
        # uvicorn re-raises the signal once it has drained: killed by SIGTERM, or 0.
        assert srv.proc.wait(WATCHDOG_S) in (0, -signal.SIGTERM)
        assert time.monotonic() - sent < GRACE_S + 2.0
        for t in threads:
            t.join(WATCHDOG_S)
        for lines in lines_of.values():
            assert lines[-1] == "data: [DONE]"
            assert json.loads(lines[-2].removeprefix("data: "))["error"]["code"] == 503
        assert wait_for(lambda: not any(_alive(p) for p in below), 5.0), \
            [p for p in below if _alive(p)]
    finally:
        srv.stop(signal.SIGKILL)  # a no-op unless an assertion above failed


def test_a_short_soak_loses_no_request_and_frees_every_block(server):
    """``rvllm bench soak`` for a few seconds: mixed, cancelled, hung-up and bad requests,
    each answered once or refused clearly, and the KV cache empty again after."""
    import argparse
    import asyncio

    from rvllm.bench.soak import add_soak_args, run_soak

    parser = argparse.ArgumentParser()
    add_soak_args(parser)
    ns = parser.parse_args(["--base-url", server.url, "--duration", "6", "--concurrency", "4",
                            "--max-tokens", "8"])
    report = asyncio.run(run_soak(ns))
    assert report["lost"] == 0, report["lost_examples"]
    assert report["answered"] > 0 and report["clear_errors"]
    assert report["free_blocks_after"] == report["blocks"]


def test_cors_follows_the_allowed_origins_flag(server):
    def preflight(origin: str) -> httpx.Response:
        return httpx.options(f"{server.url}/v1/completions", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST"})

    assert preflight("https://app.example").headers["access-control-allow-origin"] == \
        "https://app.example"
    assert "access-control-allow-origin" not in preflight("https://evil.example").headers
