"""`rvllm bench serve` and `rvllm bench race`, run as a user runs them, against a real rvllm
server on the tiny Llama: every request answered, the token counts exact, and the race's
server started, timed and stopped."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path
from subprocess import run

import pytest
from server_helpers import ServerProcess

# Hang watchdog for each command, far past the seconds it takes.
WATCHDOG_S = 600
WORKLOAD = ["--random-vocab-size", "512", "--ignore-eos", "--seed", "3"]


def _rvllm(*argv: str) -> None:
    done = run([sys.executable, "-m", "rvllm.cli", *argv], capture_output=True, text=True,
               timeout=WATCHDOG_S)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_bench_serve_gets_every_request_answered_by_rvllm(llama_dir: Path,
                                                          tmp_path: Path) -> None:
    server = ServerProcess(llama_dir, "--num-gpu-blocks", "128")
    try:
        _rvllm("bench", "serve", "--base-url", server.url, "--num-prompts", "6",
               "--max-concurrency", "3", "--random-input-len", "16", "--random-output-len", "8",
               *WORKLOAD, "--json", str(tmp_path / "serve.json"))
    finally:
        server.stop()
    result = json.loads((tmp_path / "serve.json").read_text())
    m = result["metrics"]
    assert (m["completed"], m["failed"]) == (6, 0) and result["errors"] == []
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (6 * 16, 6 * 8)
    assert m["output_throughput"] > 0 and m["median_ttft_ms"] > 0 and m["median_tpot_ms"] > 0


def test_bench_race_starts_times_and_stops_an_rvllm_server(llama_dir: Path,
                                                           tmp_path: Path) -> None:
    port = _free_port()
    server_cmd = (f"{sys.executable} -m rvllm.server.app --model {llama_dir} --port {port} "
                  "--num-gpu-blocks 64 --disable-uvicorn-access-log")
    _rvllm("bench", "race", "--server-cmd", server_cmd, "--base-url", f"http://127.0.0.1:{port}",
           "--num-prompts", "3", "--random-input-len", "8", "--random-output-len", "4",
           *WORKLOAD, "--json", str(tmp_path / "race.json"))
    result = json.loads((tmp_path / "race.json").read_text())
    phases = result["phases"]
    assert set(phases) == {"ready_s", "first_completion_s", "workload_s",
                           "launch_to_finished_s", "shutdown_s"}
    assert all(seconds > 0 for seconds in phases.values())
    assert result["metrics"]["completed"] == 3 and result["metrics"]["failed"] == 0
    assert result["metrics"]["total_output_tokens"] == 3 * 4
    with pytest.raises(ConnectionRefusedError):  # the server is gone
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_bench_serve_drives_the_chat_endpoint_too(long_llama_dir: Path, tmp_path: Path) -> None:
    """Its fixed chat prompt is longer than the tiny Llama's 256 positions: the 4,096-position
    one serves it."""
    server = ServerProcess(long_llama_dir, "--num-gpu-blocks", "300")
    try:
        _rvllm("bench", "serve", "--base-url", server.url, "--endpoint", "chat",
               "--dataset", "fixed", "--num-prompts", "2", "--random-output-len", "5",
               *WORKLOAD, "--json", str(tmp_path / "chat.json"))
    finally:
        server.stop()
    m = json.loads((tmp_path / "chat.json").read_text())["metrics"]
    assert (m["completed"], m["failed"], m["total_output_tokens"]) == (2, 0, 10)
