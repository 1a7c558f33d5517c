"""``rvllm bench race``: launch-to-finished. Start a server from any command line, wait for
``/health``, time the first completion, run a fixed streamed workload, shut the server
down, and report every phase and the tokens per second from launch to the last token.

The same harness races rvllm against a peer: only the command line changes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from typing import Any

from rvllm.bench import http_client
from rvllm.bench.report import format_table, machine_info, write_json
from rvllm.bench.serve import (
    BenchRequest,
    add_serve_bench_args,
    build_dataset,
    first_model,
    request_payload,
    run_load,
    send_request,
    workload_config,
)
from rvllm.bench.stats import serve_metrics, throughput

PHASES = [("ready_s", "launch -> /health ready"), ("first_completion_s", "first completion"),
          ("workload_s", "workload"), ("shutdown_s", "shutdown"),
          ("launch_to_finished_s", "launch -> workload finished")]


def add_race_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server-cmd", required=True,
                        help="the command that starts the server (one shell-quoted string)")
    parser.add_argument("--health-path", default="/health",
                        help="route answering 200 once the server is ready")
    parser.add_argument("--ready-timeout", type=float, default=600.0)
    parser.add_argument("--server-log", default=None, help="file for the server's output")
    add_serve_bench_args(parser)
    parser.set_defaults(num_prompts=16, max_concurrency=None, ignore_eos=True)


async def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float) -> float:
    """Poll ``url`` until it answers 200; the seconds that took. Fails if the server dies."""
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode} "
                               "before it was ready (see --server-log).")
        try:
            status, _ = await http_client.get(url, timeout=2.0)
            if status == 200:
                return time.perf_counter() - start
        except (TimeoutError, OSError, ValueError, IndexError):
            pass
        await asyncio.sleep(0.05)
    raise TimeoutError(f"{url} was not ready after {timeout:.0f}s.")


def stop_server(proc: subprocess.Popen[bytes], grace: float = 30.0) -> float:
    """SIGINT the server's process group, SIGKILL after ``grace`` s; seconds to exit."""
    start = time.perf_counter()
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return time.perf_counter() - start


def run_race(ns: argparse.Namespace) -> dict[str, Any]:
    requests = build_dataset(ns)
    log = open(ns.server_log, "wb") if ns.server_log else subprocess.DEVNULL  # noqa: SIM115
    launch = time.perf_counter()
    proc = subprocess.Popen(shlex.split(ns.server_cmd), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    phases: dict[str, float] = {}
    try:
        metrics, first_tokens = asyncio.run(_race_phases(ns, requests, proc, phases))
        phases["launch_to_finished_s"] = time.perf_counter() - launch
    finally:
        phases["shutdown_s"] = stop_server(proc)
        if log is not subprocess.DEVNULL:
            log.close()
    total_tokens = metrics["total_output_tokens"] + first_tokens
    return {
        "benchmark": "race",
        "engine": ns.label,
        "server_cmd": ns.server_cmd,
        "config": workload_config(ns),
        "machine": machine_info(),
        "phases": phases,
        "launch_to_finished_tok_s": throughput(total_tokens, phases["launch_to_finished_s"]),
        "workload_tok_s": throughput(metrics["total_output_tokens"], phases["workload_s"]),
        "metrics": metrics,
    }


async def _race_phases(ns: argparse.Namespace, requests: list[BenchRequest],
                       proc: subprocess.Popen[bytes], phases: dict[str, float]
                       ) -> tuple[dict[str, float], int]:
    base = ns.base_url.rstrip("/")
    phases["ready_s"] = await wait_ready(base + ns.health_path, proc, ns.ready_timeout)
    model = ns.model or await first_model(base)
    route = "/v1/chat/completions" if ns.endpoint == "chat" else "/v1/completions"
    first = await send_request(base + route, request_payload(ns, model, requests[0]),
                               ns.endpoint, requests[0].prompt_len, ns.timeout)
    if not first.success:
        raise RuntimeError(f"the first completion failed: {first.error}")
    phases["first_completion_s"] = first.latency
    timings, duration = await run_load(ns, requests, model)
    phases["workload_s"] = duration
    return serve_metrics(timings, duration), first.output_tokens


def print_race_result(result: dict[str, Any]) -> None:
    rows = [{"phase": label, "seconds": f"{result['phases'].get(key, math.nan):.2f}"}
            for key, label in PHASES]
    print(f"race: {result['engine'] or result['server_cmd']}")
    print(format_table(rows, [("phase", "phase"), ("seconds", "seconds")]))
    m = result["metrics"]
    print(f"workload: {m['completed']} completed, {m['failed']} failed, "
          f"{m['total_output_tokens']} tokens, {result['workload_tok_s']:.1f} tok/s")
    print(f"launch-to-finished: {result['launch_to_finished_tok_s']:.1f} tok/s")


def main(ns: argparse.Namespace) -> int:
    result = run_race(ns)
    print_race_result(result)
    if ns.json:
        write_json(ns.json, result)
        print(f"wrote {ns.json}")
    if result["metrics"]["failed"]:
        print(json.dumps(result["metrics"]), file=sys.stderr)
    return 0 if result["metrics"]["completed"] else 1
