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


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    return found


def test_sigterm_past_the_grace_ends_every_stream_with_an_error_event(long_llama_dir):
    """Streams that cannot finish within --shutdown-timeout end with an error event and
    [DONE], none cut off mid-stream; the server and its engine process exit."""
    srv = ServerProcess(long_llama_dir, "--num-gpu-blocks", "512", "--shutdown-timeout", "2")
    body = {"prompt": "Go on and on", "max_tokens": UNENDING, "stream": True,
            "ignore_eos": True}
    streams: dict[int, list[str]] = {i: [] for i in range(8)}
    started = threading.Barrier(9, timeout=WATCHDOG_S)

    def client(i: int) -> None:
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body,
                          timeout=WATCHDOG_S) as r:
            lines = r.iter_lines()
            streams[i].append(next(line for line in lines if line.startswith("data: ")))
            started.wait()
            streams[i].extend(line for line in lines if line)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    try:
        for t in threads:
            t.start()
        started.wait()
        children = _children(srv.proc.pid)
        assert children, "the engine runs in a process of its own"
        srv.proc.send_signal(signal.SIGTERM)
        srv.proc.wait(WATCHDOG_S)
        for t in threads:
            t.join(WATCHDOG_S)
        for lines in streams.values():
            assert lines[-1] == "data: [DONE]"
            assert json.loads(lines[-2].removeprefix("data: "))["error"]["code"] == 503
        assert wait_for(lambda: not any(os.path.exists(f"/proc/{c}") for c in children),
                        WATCHDOG_S)
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
