"""A real rvllm server in a subprocess on a free port, and small HTTP helpers for its tests."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

API_KEY = "test-key"
MODEL_NAME = "tiny-llama"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``timeout`` (to healthy) and ``stop``'s ``timeout`` are hang watchdogs: a start takes
    seconds, an exit well under one (or the ``--shutdown-timeout`` a test gives)."""

    def __init__(self, model: Path | None, *extra: str, timeout: float = 120.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "rvllm.server.app", "--port", str(self.port),
               "--disable-uvicorn-access-log", *extra]
        if model is not None:
            cmd += ["--model", str(model)]
        self.log = open(os.devnull if os.environ.get("RVLLM_TEST_QUIET") else
                        Path(os.environ.get("TMPDIR", "/tmp")) / f"rvllm-server-{self.port}.log",
                        "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        self._wait_healthy(timeout)

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; log: "
                                   f"{self.log.name}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"server not healthy within {timeout}s; log: {self.log.name}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> float:
        """Send ``sig`` and wait for the exit; returns the seconds it took."""
        start = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return time.monotonic() - start


def sse_events(lines: Iterator[str]) -> Iterator[dict]:
    """The JSON payloads of a Server-Sent Events stream, up to ``[DONE]``."""
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            return
        yield json.loads(data)
    raise AssertionError("the stream ended without data: [DONE]")


def scrape(url: str) -> dict[str, float]:
    """/metrics as {"name{label=value,...}": value}, via prometheus_client's parser."""
    text = httpx.get(f"{url}/metrics").text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())
                              if k != "model_name")
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.05) -> bool:
    """Polls until ``predicate()`` holds. ``timeout`` is a hang watchdog: give one 10x and
    more what the wait takes on a busy machine, never a bound that a test's meaning rests on."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
