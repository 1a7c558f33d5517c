"""Many clients at once, clients that hang up, and signals: the server keeps its promises.

None of these tests depends on how fast the machine is: a request that must still be
generating when its client leaves asks for thousands of tokens, which the test ends
itself; what the server has done is read from its own report (``/metrics``), not
guessed from a sleep; the wall-clock bounds are hang watchdogs."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import httpx
import pytest
from server_helpers import ServerProcess, scrape, sse_events, wait_for

PROMPTS = [f"Request number {i} says" for i in range(16)]
# For a request the test ends itself: thousands of steps on the 4096-position model,
# seconds even at a fraction of a millisecond a step, against the few milliseconds the
# test takes to hang up once the server has reported the request running.
UNENDING = 4000
# A hang watchdog: 10x and more what any wait below takes.
WATCHDOG_S = 120.0


@pytest.fixture(scope="module")
def server(long_llama_dir):
    srv = ServerProcess(long_llama_dir, "--num-gpu-blocks", "256", "--max-num-seqs", "64")
    yield srv
    srv.stop()


async def stream_text(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> str:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = [line async for line in r.aiter_lines()]
    return "".join(e["choices"][0]["text"] for e in sse_events(iter(lines)))


def test_64_concurrent_streams_match_their_solo_text(server):
    async def run() -> tuple[list[str], list[str]]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(timeout=WATCHDOG_S, limits=limits) as client:
            solo = [await stream_text(client, server.url, p, 16) for p in PROMPTS]
            together = await asyncio.gather(*(stream_text(client, server.url, PROMPTS[i % 16], 16)
                                              for i in range(64)))
        return solo, list(together)

    solo, together = asyncio.run(run())
    assert all(solo)
    assert together == [solo[i % 16] for i in range(64)]
    metrics = scrape(server.url)
    assert metrics["vllm:num_requests_running"] == 0
    assert metrics["vllm:kv_cache_usage_perc"] == 0.0


def idle(server) -> bool:
    m = scrape(server.url)
    return m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0.0


def running(server) -> float:
    return scrape(server.url)["vllm:num_requests_running"]


def aborts(server) -> float:
    """Requests aborted so far. The server counts an abort just after the engine has freed
    the request's blocks: a test waits for this count, not for the blocks, to see it."""
    return scrape(server.url).get("vllm:request_success_total{finished_reason=abort}", 0.0)


def test_client_that_disconnects_mid_stream_is_aborted_and_its_blocks_freed(server):
    aborted_before = aborts(server)
    body = {"prompt": "Hang up on me", "max_tokens": UNENDING, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body,
                      timeout=WATCHDOG_S) as r:
        lines = r.iter_lines()
        events = [json.loads(next(ln for ln in lines if ln.startswith("data: "))[6:])
                  for _ in range(3)]
        assert all(e["choices"][0]["finish_reason"] is None for e in events)
        assert running(server) == 1
    # The connection is closed here, thousands of tokens before the request's end.
    assert wait_for(lambda: aborts(server) == aborted_before + 1, WATCHDOG_S)
    assert wait_for(lambda: idle(server), WATCHDOG_S)


def test_client_that_times_out_on_a_whole_response_is_aborted(server):
    """The client's timeout expires while the server is generating: the test makes it
    expire once ``/metrics`` reports the request running (a fixed 0.3 s could expire
    before a slow machine had started it, or after a fast one had finished it)."""
    aborted_before = aborts(server)
    body = {"prompt": "Too slow", "max_tokens": UNENDING, "ignore_eos": True}

    async def expire_once_running(timeout: asyncio.Timeout) -> None:
        assert await asyncio.to_thread(wait_for, lambda: running(server) == 1, WATCHDOG_S)
        timeout.reschedule(asyncio.get_running_loop().time())

    async def client_that_times_out() -> None:
        async with httpx.AsyncClient(timeout=WATCHDOG_S) as client:
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(None) as timeout:
                    watcher = asyncio.create_task(expire_once_running(timeout))
                    await client.post(f"{server.url}/v1/completions", json=body)
            await watcher

    asyncio.run(client_that_times_out())
    assert wait_for(lambda: aborts(server) == aborted_before + 1, WATCHDOG_S)
    assert wait_for(lambda: idle(server), WATCHDOG_S)


def test_many_clients_hanging_up_at_once_leave_nothing_behind(server):
    aborted_before = aborts(server)

    async def hang_up(client: httpx.AsyncClient, i: int) -> None:
        body = {"prompt": PROMPTS[i % 16], "max_tokens": UNENDING, "stream": True,
                "ignore_eos": True}
        async with client.stream("POST", f"{server.url}/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    break

    async def run() -> None:
        async with httpx.AsyncClient(timeout=WATCHDOG_S,
                                     limits=httpx.Limits(max_connections=32)) as c:
            await asyncio.gather(*(hang_up(c, i) for i in range(32)))

    asyncio.run(run())
    # None could have finished: every one is aborted, and nothing is left running.
    assert wait_for(lambda: aborts(server) == aborted_before + 32, WATCHDOG_S)
    assert wait_for(lambda: idle(server), WATCHDOG_S)
    assert httpx.get(f"{server.url}/health").status_code == 200


# The grace a signal gives requests in flight: a hang watchdog, 10x and more what the
# request takes. "Quickly" is the server exiting as soon as that request is done, not
# when the grace runs out.
SHUTDOWN_GRACE_S = 60.0


def refuses_connections(server) -> bool:
    try:
        httpx.get(f"{server.url}/health", timeout=WATCHDOG_S)
    except (httpx.ConnectError, httpx.RemoteProtocolError):
        # Refused, or (a connection that raced the listener's closing) dropped unanswered.
        return True
    return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_finishes_in_flight_request_and_exits_quickly(long_llama_dir, sig):
    """The request in flight is one the engine has taken but not yet started: it waits
    (one sequence at a time) behind a request that cannot finish on its own, so it is in
    flight when the signal comes however fast the machine. The blocker's client leaves
    once the server is shutting down, and the request waiting behind it must still be
    served in full before the server exits."""
    srv = ServerProcess(long_llama_dir, "--num-gpu-blocks", "256", "--max-num-seqs", "1",
                        "--shutdown-timeout", str(SHUTDOWN_GRACE_S))
    blocker = {"prompt": "Hold the engine", "max_tokens": UNENDING, "stream": True,
               "ignore_eos": True}
    body = {"prompt": "Finish me", "max_tokens": 20, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    lines: list[str] = []
    accepted = threading.Event()

    def client() -> None:
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body,
                          timeout=WATCHDOG_S) as r:
            accepted.set()  # the response starts once the engine has taken the request
            lines.extend(r.iter_lines())

    t = threading.Thread(target=client)
    try:
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=blocker,
                          timeout=WATCHDOG_S) as r:
            blocker_lines = r.iter_lines()  # held: dropping it would close the connection
            next(line for line in blocker_lines if line.startswith("data: "))
            assert running(srv) == 1
            t.start()
            assert accepted.wait(WATCHDOG_S)
            assert scrape(srv.url)["vllm:num_requests_waiting"] == 1
            srv.proc.send_signal(sig)
            assert wait_for(lambda: refuses_connections(srv), WATCHDOG_S)
        # The blocker's client has left: it is aborted, and the waiting request runs.
        left = time.monotonic()
        srv.proc.wait(SHUTDOWN_GRACE_S + WATCHDOG_S)
        assert time.monotonic() - left < SHUTDOWN_GRACE_S
        t.join(WATCHDOG_S)
        assert "data: [DONE]" in lines  # the request in flight got its whole answer
        assert list(sse_events(iter(lines)))[-1]["usage"]["completion_tokens"] == 20
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{srv.url}/health", timeout=1)
    finally:
        srv.stop(signal.SIGKILL)  # a no-op unless an assertion above failed
