#!/usr/bin/env python3
"""What an open dashboard costs the server: ``rvllm bench serve`` throughput with its
data read once a second, and with the page open in a headless Chromium, against neither,
alternated on one server.

Starts ``rvllm serve`` (the default model unless ``--model``) on a free port, then
``--rounds`` times: a run with nothing else, a run with a client reading
``/v1/engine/stats`` once a second (what the page does, without a browser), and a run
with Debian's Chromium showing ``/dashboard`` (started before the run, stopped after
it; its CPU use is measured), each the same ``rvllm bench serve`` command. Reports each
run's output tok/s and request throughput, and the medians' ratios.

    python benchmarks/bench_dashboard.py [--model PATH] [--rounds 3] [--num-prompts 64]
        [--max-concurrency 8] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

OUT = Path(__file__).resolve().parent / "results" / "2026-12-06-dashboard" / "dashboard.json"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise TimeoutError("the server did not become healthy")


def open_page(url: str, profile: Path) -> subprocess.Popen:
    """Chromium showing the dashboard, headless, until it is stopped."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        raise SystemExit("needs Debian's chromium (apt-get install chromium)")
    return subprocess.Popen([browser, *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
                             "--remote-debugging-port=0", f"{url}/dashboard"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def tree_cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of ``pid`` and every live process below it."""
    stats, parents = {}, {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parents.setdefault(int(fields[1]), []).append(int(entry.name))
            stats[int(entry.name)] = (int(fields[11]) + int(fields[12]))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        total += stats.get(p, 0)
        todo += parents.get(p, [])
    return total / os.sysconf("SC_CLK_TCK")


class Poller:
    """Reads /v1/engine/stats once a second, as the page does, without a browser."""

    def __init__(self, url: str) -> None:
        self.url, self.stop = url, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=10) as client:
            while not self.stop.wait(1.0):
                client.get(f"{self.url}/v1/engine/stats").raise_for_status()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(30)


def bench(url: str, ns: argparse.Namespace, out: Path) -> dict:
    cmd = [sys.executable, "-m", "rvllm.cli", "bench", "serve", "--base-url", url,
           "--num-prompts", str(ns.num_prompts), "--max-concurrency", str(ns.max_concurrency),
           "--random-input-len", "128", "--random-output-len", "128", "--ignore-eos",
           "--json", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    metrics = json.loads(out.read_text())["metrics"]
    if metrics["failed"]:
        raise RuntimeError(f"{metrics['failed']} requests failed")
    return metrics


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the built-in SmolLM2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-concurrency", type=int, default=8)
    parser.add_argument("--json", default=str(OUT), metavar="PATH")
    ns = parser.parse_args()

    from rvllm.bench.report import machine_info, write_json

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server_cmd = [sys.executable, "-m", "rvllm.server.app", "--port", str(port),
                  "--disable-uvicorn-access-log"] + (["--model", ns.model] if ns.model else [])
    server = subprocess.Popen(server_cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    modes = ("none", "poll", "dashboard")
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    browser_cpu: list[float] = []
    try:
        wait_healthy(url, server)
        with tempfile.TemporaryDirectory() as tmp:
            bench(url, ns, Path(tmp) / "warm.json")  # warm-up, not counted
            for r in range(ns.rounds):
                for mode in modes:
                    page = open_page(url, Path(tmp) / f"profile-{r}") if mode == "dashboard" \
                        else None
                    poller = Poller(url) if mode == "poll" else None
                    try:
                        if page is not None:
                            time.sleep(3.0)  # the page loaded and polling
                            cpu = tree_cpu_seconds(page.pid)
                        result = bench(url, ns, Path(tmp) / f"{mode}-{r}.json")
                        if page is not None:
                            browser_cpu.append((tree_cpu_seconds(page.pid) - cpu)
                                               / result["duration"])
                    finally:
                        if poller is not None:
                            poller.close()
                        if page is not None:
                            page.terminate()
                            page.wait(30)
                    runs[mode].append(result)
                    print(f"round {r} {mode:9s}: {result['output_throughput']:.1f} output "
                          f"tok/s, {result['request_throughput']:.2f} req/s"
                          + (f", the browser used {browser_cpu[-1]:.2f} cores"
                             if page is not None else ""), flush=True)
    finally:
        server.terminate()
        server.wait(60)
    medians = {m: statistics.median(x["output_throughput"] for x in v) for m, v in runs.items()}
    ratios = {m: medians[m] / medians["none"] for m in ("poll", "dashboard")}
    print(f"median output tok/s: none {medians['none']:.1f}, stats polled once a second "
          f"{medians['poll']:.1f} ({ratios['poll']:.3f}x), dashboard open in Chromium "
          f"{medians['dashboard']:.1f} ({ratios['dashboard']:.3f}x; the browser used "
          f"{statistics.median(browser_cpu):.2f} cores)")
    write_json(ns.json, {
        "benchmark": "dashboard-overhead", "command": "python " + shlex.join(sys.argv),
        "machine": machine_info(), "server": shlex.join(server_cmd[1:]),
        "config": {"rounds": ns.rounds, "num_prompts": ns.num_prompts,
                   "max_concurrency": ns.max_concurrency, "input_len": 128,
                   "output_len": 128, "order": "alternating: " + ", ".join(modes)},
        "output_tok_s": {m: [x["output_throughput"] for x in v] for m, v in runs.items()},
        "median_output_tok_s": medians, "ratio_vs_none": ratios,
        "browser_cores_used": browser_cpu})
    print(f"wrote {ns.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
