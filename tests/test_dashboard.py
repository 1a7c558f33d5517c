"""The live dashboard: ``GET /dashboard`` and the JSON behind it, ``GET /v1/engine/stats``.

In the app with a stand-in engine: the key, the off switch, the OpenAPI document, the
same numbers as /metrics, data-parallel replicas and their sum. On a real server: the
stats agree with /metrics under load, and the page, driven in headless Chromium over
the DevTools protocol, follows a burst of streamed requests and loads nothing from
elsewhere. The browser test saves a screenshot, ``dashboard.png``, in its pytest
temporary directory (``--basetemp`` puts it where CI keeps artifacts).
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
import os
import re
import shutil
import subprocess
import threading
import time
import tomllib
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import API_KEY, HEADERS, MODEL_NAME, ServerProcess, scrape, sse_events

from rvllm.engine.async_engine import EngineSnapshot
from rvllm.engine.data_parallel import DataParallelEngine
from rvllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from rvllm.server import dashboard
from rvllm.server.app import app_options, build_app
from rvllm.server.args import add_serve_args
from rvllm.server.metrics import RecentLatencies

ROOT = Path(__file__).resolve().parent.parent
STATS = "/v1/engine/stats"
# A hang watchdog: 10x and more what any wait below takes.
WATCHDOG_S = 60.0


# ------------------------------------------------------------------ a stand-in engine


def snapshot(**values: Any) -> EngineSnapshot:
    base = dict(num_requests_running=3, num_requests_waiting=2, kv_cache_usage=0.25,
                num_free_blocks=48, num_blocks=64, prompt_tokens=1200, generation_tokens=345,
                prefix_cache_queries=1000, prefix_cache_hits=400, num_preemptions=7,
                structured_output_requests=5, spec_decode_num_drafts=10,
                spec_decode_num_draft_tokens=40, spec_decode_num_accepted_tokens=30,
                spec_decode_accepted_per_pos=(10, 8, 7, 5))
    return EngineSnapshot(**{**base, **values})


class FakeEngine:
    """What the app reads of an engine, with a snapshot the test sets."""

    def __init__(self, snap: EngineSnapshot | None = None) -> None:
        self.snap = snap or snapshot()
        self.step_observers: list[Any] = []
        self.model_path = "/models/tiny"
        self.max_model_len = 256
        self.is_running = True
        self.tokenizer = None

    def snapshot(self) -> EngineSnapshot:
        return self.snap

    def shutdown(self) -> None:
        pass


def client_for(engine: Any, api_key: str | None = API_KEY, **options: Any) -> TestClient:
    return TestClient(build_app(engine, MODEL_NAME, api_key, **options))


def metrics_of(client: TestClient) -> dict[str, float]:
    samples = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())
                              if k != "model_name")
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


def output(request_id: str, prompt_ids: list[int], tokens: int, finished: bool = False,
           prompt: str | None = None) -> RequestOutput:
    return RequestOutput(
        request_id=request_id, prompt=prompt, prompt_token_ids=prompt_ids,
        prompt_logprobs=None,
        outputs=[CompletionOutput(0, "x" * tokens, list(range(tokens)), None, None,
                                  "length" if finished else None)],
        finished=finished, metrics=RequestMetrics(arrival_time=time.time() - 1.0),
        new_token_counts=[1])


# ------------------------------------------------------------------ the app alone


def test_the_page_loads_without_the_key_and_its_data_wants_it():
    client = client_for(FakeEngine())
    page = client.get("/dashboard")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in page.headers["content-security-policy"]
    assert "connect-src 'self'" in page.headers["content-security-policy"]
    for name, kind in [("dashboard.js", "text/javascript"), ("dashboard.css", "text/css")]:
        r = client.get(f"/dashboard/assets/{name}")
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind)
    assert client.get("/dashboard/assets/index.htm").status_code == 404
    assert client.get("/dashboard/assets/..%2F..%2Fapp.py").status_code == 404
    assert client.get(STATS).status_code == 401
    wrong = client.get(STATS, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    assert wrong.json()["error"]["code"] == "invalid_api_key"
    r = client.get(STATS, headers=HEADERS)
    assert r.status_code == 200
    dashboard.EngineStats.model_validate(r.json())


def test_without_an_api_key_the_data_is_open():
    assert client_for(FakeEngine(), api_key=None).get(STATS).status_code == 200


def test_disable_dashboard_turns_page_and_data_off():
    for key in (None, API_KEY):
        client = client_for(FakeEngine(), api_key=key, dashboard=False)
        assert client.get("/dashboard").status_code == 404
        assert client.get("/dashboard/assets/dashboard.js").status_code == 404
        assert client.get(STATS, headers=HEADERS).status_code == 404
        assert client.get("/metrics").status_code == 200


def test_the_flags():
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    default = app_options(parser.parse_args([]))
    assert default["dashboard"] is True and default["dashboard_show_prompts"] is False
    ns = parser.parse_args(["--disable-dashboard", "--dashboard-show-prompts"])
    assert app_options(ns)["dashboard"] is False
    assert app_options(ns)["dashboard_show_prompts"] is True


def test_stats_read_the_counters_behind_metrics():
    engine = FakeEngine()
    client = client_for(engine, api_key=None)
    s = client.get(STATS).json()
    m = metrics_of(client)
    assert s["requests"] == {"running": m["vllm:num_requests_running"],
                             "waiting": m["vllm:num_requests_waiting"],
                             "swapped": m["vllm:num_requests_swapped"]}
    assert s["kv_cache"] == {"usage": m["vllm:kv_cache_usage_perc"],
                             "num_blocks": m["vllm:num_gpu_blocks"],
                             "num_free_blocks": m["vllm:num_free_blocks"]}
    assert s["prefix_cache"]["queries"] == m["vllm:prefix_cache_queries_total"]
    assert s["prefix_cache"]["hits"] == m["vllm:prefix_cache_hits_total"]
    assert s["prefix_cache"]["hit_rate"] == 0.4
    totals = s["totals"]
    assert totals["prompt_tokens"] == m["vllm:prompt_tokens_total"]
    assert totals["generation_tokens"] == m["vllm:generation_tokens_total"]
    assert totals["preemptions"] == m["vllm:num_preemptions_total"]
    assert totals["structured_output_requests"] == m["vllm:structured_output_requests_total"]
    spec = s["spec_decode"]
    assert spec["num_drafts"] == m["vllm:spec_decode_num_drafts_total"]
    assert spec["num_draft_tokens"] == m["vllm:spec_decode_num_draft_tokens_total"]
    assert spec["num_accepted_tokens"] == m["vllm:spec_decode_num_accepted_tokens_total"]
    assert spec["acceptance_rate"] == 0.75 and spec["mean_acceptance_length"] == 4.0
    assert s["config"]["model"] == MODEL_NAME and s["config"]["num_blocks"] == 64
    assert s["replicas"] == []
    # Throughput comes from the counters' increase between readings.
    engine.snap = snapshot(prompt_tokens=1200 + 50, generation_tokens=345 + 100,
                           prefix_cache_queries=1050, prefix_cache_hits=440)
    time.sleep(0.25)
    t = client.get(STATS).json()
    rate = t["throughput"]
    assert rate["window_s"] > 0.2
    assert rate["generation_tokens_per_s"] == pytest.approx(100 / rate["window_s"], rel=0.01)
    assert rate["prompt_tokens_per_s"] == pytest.approx(50 / rate["window_s"], rel=0.01)
    assert t["prefix_cache"]["recent_hit_rate"] == 0.8


def test_no_spec_decode_section_when_it_never_drafted():
    engine = FakeEngine(snapshot(spec_decode_num_drafts=0, spec_decode_num_draft_tokens=0,
                                 spec_decode_num_accepted_tokens=0))
    assert client_for(engine, api_key=None).get(STATS).json()["spec_decode"] is None


def test_data_parallel_shows_each_replica_and_their_sum():
    a = FakeEngine(snapshot(num_requests_running=1, num_free_blocks=60, generation_tokens=100))
    b = FakeEngine(snapshot(num_requests_running=4, num_free_blocks=16, generation_tokens=900))
    client = client_for(DataParallelEngine([a, b]), api_key=None)  # type: ignore[list-item]
    s = client.get(STATS).json()
    m = metrics_of(client)
    assert [r["index"] for r in s["replicas"]] == [0, 1]
    assert [r["requests"]["running"] for r in s["replicas"]] == [1, 4]
    assert [r["totals"]["generation_tokens"] for r in s["replicas"]] == [100, 900]
    assert [r["kv_cache"]["num_free_blocks"] for r in s["replicas"]] == [60, 16]
    # The top level is the sum, as /metrics gives it.
    assert s["requests"]["running"] == 5 == m["vllm:num_requests_running"]
    assert s["totals"]["generation_tokens"] == 1000 == m["vllm:generation_tokens_total"]
    assert s["kv_cache"]["num_blocks"] == 128 == m["vllm:num_gpu_blocks"]
    assert s["kv_cache"]["usage"] == pytest.approx(1 - 76 / 128)
    assert s["kv_cache"]["usage"] == pytest.approx(m["vllm:kv_cache_usage_perc"])
    assert s["config"]["data_parallel_size"] == 2


def test_the_openapi_document_describes_the_stats():
    doc = build_app(FakeEngine(), MODEL_NAME, API_KEY).openapi()  # type: ignore[arg-type]
    assert not any(path.startswith("/dashboard") for path in doc["paths"])
    operation = doc["paths"][STATS]["get"]
    ok = operation["responses"]["200"]["content"]["application/json"]["schema"]
    assert ok == {"$ref": "#/components/schemas/EngineStats"}
    error = operation["responses"]["401"]["content"]["application/json"]["schema"]
    assert error == {"$ref": "#/components/schemas/ErrorResponse"}
    assert operation["security"] == [{"bearerAuth": []}]
    for schema in doc["components"]["schemas"].values():
        jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator({"$ref": ok["$ref"],
                                                 "components": doc["components"]})
    body = client_for(FakeEngine()).get(STATS, headers=HEADERS).json()
    validator.validate(body)


def test_live_requests_follow_adds_outputs_and_ends():
    live = dashboard.LiveRequests(keep_prompts=False)
    live.added("a-0", [1, 2, 3])
    live.added("b-0", "some text")
    live.added("c-0", {"prompt_token_ids": [5, 6]})
    rows = {r.id: r for r in live.rows(True, None)}
    assert [rows[i].state for i in ("a-0", "b-0", "c-0")] == ["waiting"] * 3
    assert [rows[i].prompt_tokens for i in ("a-0", "b-0", "c-0")] == [3, None, 2]
    live.observe_step([output("b-0", [7, 8, 9, 10], 3, prompt="some text")], [])
    rows = {r.id: r for r in live.rows(True, None)}
    assert (rows["b-0"].state, rows["b-0"].prompt_tokens, rows["b-0"].output_tokens) == (
        "running", 4, 3)
    assert all(r.prompt is None for r in rows.values())  # not without the flag
    live.observe_step([output("b-0", [7, 8, 9, 10], 5, finished=True)], ["a-0"])
    assert [r.id for r in live.rows(True, None)] == ["c-0"]
    live.dropped("c-0")
    assert live.rows(True, None) == []
    # Outputs of a request added elsewhere list it too; an end never heard of is
    # dropped once the engine counts no request.
    live.observe_step([output("d-0", [1], 1)], [])
    assert [r.id for r in live.rows(True, None)] == ["d-0"]
    time.sleep(0.01)
    dashboard.STALE_S, stale = 0.0, dashboard.STALE_S
    try:
        assert live.rows(False, None) == []
    finally:
        dashboard.STALE_S = stale


def test_prompts_only_with_the_flag():
    live = dashboard.LiveRequests(keep_prompts=True)
    live.added("a-0", "tell me a story " * 50)
    live.added("b-0", [4, 5])
    rows = {r.id: r for r in live.rows(True, lambda ids: " ".join(map(str, ids)))}
    assert rows["a-0"].prompt == ("tell me a story " * 50)[:dashboard.PROMPT_CHARS]
    assert rows["b-0"].prompt == "4 5"


def test_percentiles_over_a_sliding_window():
    p = dashboard._percentiles([float(v) for v in range(1, 101)])
    assert (p.count, p.p50, p.p90, p.p99) == (100, 50.0, 90.0, 99.0)
    assert dashboard._percentiles([]).p50 is None
    assert dashboard._percentiles([0.5]).p99 == 0.5
    recent = RecentLatencies()
    recent.add("ttft", 0.3)
    recent.add("ttft", 0.1)
    recent.add("e2e", 2.0)
    assert recent.window(60.0) == {"ttft": [0.1, 0.3], "tpot": [], "e2e": [2.0]}
    time.sleep(0.05)
    assert recent.window(0.01) == {"ttft": [], "tpot": [], "e2e": []}


def test_assets_are_small_shipped_and_load_nothing_from_elsewhere():
    files = sorted(dashboard.ASSETS.iterdir())
    assert {f.name for f in files} == {"index.html", *dashboard.ASSET_TYPES}
    assert sum(f.stat().st_size for f in files) < 64 * 1024
    for f in files:
        text = f.read_text(encoding="utf-8")
        assert not re.search(r"https?:|wss?:|ftp:", text, re.I), f.name
        assert not re.search(r"//[\w-]+\.[a-z]", text, re.I), f.name  # //host.example
        for url in re.findall(r"""(?:src|href)\s*=\s*["']([^"']*)["']""", text):
            assert url == "data:," or re.fullmatch(r"dashboard/assets/[\w.]+", url), url
        assert "@import" not in text and "url(" not in text, f.name
    js = (dashboard.ASSETS / "dashboard.js").read_text(encoding="utf-8")
    assert re.findall(r"fetch\((\w+)", js) == ["STATS_URL"]
    assert 'const STATS_URL = "v1/engine/stats"' in js
    assert "innerHTML" not in js  # request ids and prompts are written as text only
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"]
    assert "dashboard_assets/*" in package_data["rvllm.server"]


# ------------------------------------------------------------------ a real server


@pytest.fixture(scope="module")
def server(long_llama_dir):
    srv = ServerProcess(long_llama_dir, "--served-model-name", MODEL_NAME, "--api-key", API_KEY,
                        "--dashboard-show-prompts", "--num-gpu-blocks", "2048")
    yield srv
    srv.stop()


class Burst:
    """``n`` streamed completions at once, each on a thread; ``ids`` fill in as their
    first events come. ``stop`` hangs up on them (the server aborts them)."""

    def __init__(self, url: str, n: int, max_tokens: int, label: str) -> None:
        self.ids: list[str | None] = [None] * n
        self.errors: list[BaseException] = []
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(url, i, max_tokens, label),
                                         daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, url: str, i: int, max_tokens: int, label: str) -> None:
        body = {"model": MODEL_NAME, "prompt": f"{label} {i}", "max_tokens": max_tokens,
                "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=HEADERS,
                              timeout=WATCHDOG_S) as r:
                assert r.status_code == 200
                for event in sse_events(r.iter_lines()):
                    self.ids[i] = self.ids[i] or event["id"]
                    if self.stopping.is_set():
                        return
        except BaseException as e:  # noqa: BLE001 - raised again by join
            self.errors.append(e)

    def stop(self) -> None:
        self.stopping.set()
        self.join()

    def join(self) -> None:
        for t in self.threads:
            t.join(WATCHDOG_S)
        assert not any(t.is_alive() for t in self.threads), "a request hung"
        if self.errors:
            raise self.errors[0]


def stats(server: ServerProcess) -> dict[str, Any]:
    r = httpx.get(f"{server.url}{STATS}", headers=HEADERS, timeout=10)
    assert r.status_code == 200
    return r.json()


def until(predicate, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + WATCHDOG_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


COUNTERS = {"prompt_tokens": "vllm:prompt_tokens_total",
            "generation_tokens": "vllm:generation_tokens_total",
            "preemptions": "vllm:num_preemptions_total",
            "structured_output_requests": "vllm:structured_output_requests_total"}


def test_stats_agree_with_metrics_under_load(server):
    assert httpx.get(f"{server.url}{STATS}").status_code == 401
    burst = Burst(server.url, 4, 300, "agree")
    until(lambda: stats(server)["requests"]["running"] > 0, "the burst to run")
    for _ in range(5):  # while it runs (or a little after)
        before, s, after = scrape(server.url), stats(server), scrape(server.url)
        for name, metric in COUNTERS.items():
            assert before[metric] <= s["totals"][name] <= after[metric], name
        for name in ("queries", "hits"):
            metric = f"vllm:prefix_cache_{name}_total"
            assert before[metric] <= s["prefix_cache"][name] <= after[metric], name
        assert s["kv_cache"]["num_blocks"] == before["vllm:num_gpu_blocks"] == 2048
    burst.join()
    until(lambda: stats(server)["requests"] == {"running": 0, "waiting": 0, "swapped": 0},
          "idle")
    m, s = scrape(server.url), stats(server)
    assert s["requests"]["running"] == m["vllm:num_requests_running"] == 0
    assert s["requests"]["waiting"] == m["vllm:num_requests_waiting"] == 0
    assert s["kv_cache"]["usage"] == m["vllm:kv_cache_usage_perc"]
    assert s["kv_cache"]["num_free_blocks"] == m["vllm:num_free_blocks"]
    for name, metric in COUNTERS.items():
        assert s["totals"][name] == m[metric], name
    for reason, count in s["totals"]["finished_requests"].items():
        assert count == m[f"vllm:request_success_total{{finished_reason={reason}}}"]
    assert s["totals"]["finished_requests"]["length"] >= 4
    assert s["latency"]["ttft"]["count"] >= 4 and s["latency"]["e2e"]["count"] >= 4
    assert s["latency"]["tpot"]["p50"] > 0
    assert s["live_requests"] == []
    # What the engine process resolved, not the flags' "auto".
    config = s["config"]
    assert config["architecture"] == "LlamaForCausalLM" and config["dtype"] == "float32"
    assert config["kernel_backend"] == "numba" and config["device"] == "cpu"
    assert config["kv_cache_dtype"] == "float32" and config["threads"] >= 1
    assert config["packed_activations"] is None  # no weight runs packed


# ------------------------------------------------------------------ in a browser

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--window-size=1280,1700",
                  "--remote-debugging-port=0", "--remote-debugging-address=127.0.0.1"]


class Browser:
    """Headless Chromium driven over the DevTools protocol (one page, one websocket)."""

    def __init__(self, binary: str, profile: Path, log: Path) -> None:
        import websocket

        self.log = open(log, "w")
        self.proc = subprocess.Popen([binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
                                      "about:blank"], stdout=self.log, stderr=subprocess.STDOUT)
        self.events: list[dict[str, Any]] = []
        self._id = 0
        port_file = profile / "DevToolsActivePort"
        until(lambda: self.proc.poll() is not None or (
            port_file.exists() and port_file.read_text().count("\n") >= 1),
            "Chromium's DevTools port")
        assert self.proc.poll() is None, f"Chromium exited; its log: {log}"
        port = int(port_file.read_text().split()[0])
        targets = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json()
        page = next(t for t in targets if t["type"] == "page")
        self.ws = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=30,
                                              suppress_origin=True)

    def send(self, method: str, **params: Any) -> dict[str, Any]:
        self._id += 1
        self.ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv())
            if message.get("id") == self._id:
                assert "error" not in message, message["error"]
                return message.get("result", {})
            self.events.append(message)

    def evaluate(self, expression: str) -> Any:
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True,
                           awaitPromise=True)
        assert "exceptionDetails" not in result, result["exceptionDetails"]
        return result["result"].get("value")

    def wait(self, expression: str, what: str) -> Any:
        """Polls ``expression`` until it is truthy; returns its value."""
        value = None

        def check() -> bool:
            nonlocal value
            value = self.evaluate(expression)
            return bool(value)

        until(check, what)
        return value

    def close(self) -> None:
        try:
            self.ws.close()
        finally:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.log.close()


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    reason = ("Chromium is not installed: `scripts/setup.sh test` installs it (Debian's "
              "chromium package, with apt-get as root)")
    if os.environ.get("CI"):
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture
def browser(tmp_path: Path):
    binary = chromium()
    pytest.importorskip("websocket", reason="the DevTools client needs websocket-client")
    b = Browser(binary, tmp_path / "chromium-profile", tmp_path / "chromium.log")
    yield b
    b.close()


# The page's numbers, as shown.
PAGE = """(() => {
  const text = (id) => document.getElementById(id).textContent;
  const rows = [...document.querySelectorAll('#requests tr')];
  return {status: text('status'), running: text('running'), waiting: text('waiting'),
          generation_tps: text('generation-tps'), kv: text('kv-usage'),
          ids: rows.map((tr) => tr.dataset.id),
          states: rows.map((tr) => tr.children[1].textContent),
          prompts: rows.map((tr) => tr.lastChild.textContent),
          updates: window.rvllmDashboard.updates};
})()"""


def wait_for_page(b: Browser, condition: str, what: str) -> dict[str, Any]:
    """The page's numbers once the JavaScript ``condition`` on them (``p``) holds."""
    return b.wait(f"(() => {{ const p = {PAGE}; return ({condition}) && p; }})()", what)


def shown_number(text: str) -> float:
    return 0.0 if text == "-" else float(text.replace(",", ""))


def test_dashboard_follows_a_burst_in_a_browser(browser, server, tmp_path):
    b = browser
    b.send("Network.enable")
    b.send("Page.enable")
    b.send("Page.navigate", url=f"{server.url}/dashboard")
    # The page loads without a key, then asks for one: the data needs it.
    b.wait("document.readyState === 'complete' && "
           "document.getElementById('status').dataset.state === 'locked'", "the key form")
    assert b.evaluate("document.getElementById('key-form').hidden") is False
    b.evaluate(f"document.getElementById('api-key').value = {json.dumps(API_KEY)};"
               "document.getElementById('use-key').click(); true")
    page = wait_for_page(b, "p.updates > 0", "the first update")
    assert page["status"] == "live"
    assert page["running"] == "0" and page["ids"] == []
    assert b.evaluate("localStorage.getItem('rvllm-dashboard-api-key')") == API_KEY
    config = b.evaluate("document.getElementById('config-architecture').textContent + ' ' + "
                        "document.getElementById('config-num_blocks').textContent")
    assert config == "LlamaForCausalLM 2048"
    assert b.evaluate("document.getElementById('model').textContent") == MODEL_NAME

    # Requests longer than the test needs (it hangs up on them once the page has shown
    # them), whatever the machine's speed; room for all in the KV cache, no preemption.
    n = 6
    burst = Burst(server.url, n, 3000, "dashboard burst")
    until(lambda: all(burst.ids) or burst.errors, "the burst's first events")
    engine_ids = {f"{i}-0" for i in burst.ids}  # the response id and the prompt's index

    def busy(p: dict[str, Any]) -> bool:
        return (shown_number(p["running"]) >= n and shown_number(p["generation_tps"]) > 0
                and engine_ids <= set(p["ids"]))

    seen = b.evaluate(PAGE)
    deadline = time.monotonic() + WATCHDOG_S
    while not busy(seen):
        assert time.monotonic() < deadline, f"the page never showed the burst: {seen}"
        time.sleep(0.1)
        seen = b.evaluate(PAGE)
    assert set(seen["ids"]) == engine_ids  # only the burst's requests are live
    assert set(seen["states"]) == {"running"}
    assert {p.rsplit(" ", 1)[0] for p in seen["prompts"]} == {"dashboard burst"}  # shown
    assert shown_number(seen["kv"].rstrip(" %")) > 0
    shot = b.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)
    (tmp_path / "dashboard.png").write_bytes(base64.b64decode(shot["data"]))
    print(f"screenshot: {tmp_path / 'dashboard.png'}")

    burst.stop()
    wait_for_page(b, "p.running === '0' && p.waiting === '0' && p.ids.length === 0",
                  "the counts back to zero")
    assert "abort" in b.evaluate("document.getElementById('finished-detail').textContent")
    assert b.evaluate("document.getElementById('ttft-count').textContent") != "0"

    # Nothing but the server itself was asked for anything.
    resources = b.evaluate("performance.getEntriesByType('resource').map((e) => e.name)")
    requested = [e["params"]["request"]["url"] for e in b.events
                 if e.get("method") == "Network.requestWillBeSent"]
    assert any(url.endswith(STATS) for url in resources + requested)
    for url in resources + requested:
        assert url.startswith(f"{server.url}/") or url.startswith("data:"), url


def test_the_stats_line_reports_each_interval_and_stays_quiet_when_idle(
        caplog, monkeypatch) -> None:  # noqa: ANN001 - pytest fixtures
    """vLLM's periodic line (``server/stats_log.py``): throughput over the interval, the
    queues, the KV cache's use and the interval's prefix-cache hit rate; nothing while
    idle; and the app logs it on its own under ``log_stats_interval_s``."""
    from rvllm.server.stats_log import StatsLogger, log_stats_interval

    stats = StatsLogger()
    assert stats.line(0.0, snapshot()) is None  # the first snapshot only sets the start
    line = stats.line(2.0, snapshot(prompt_tokens=1300, generation_tokens=445,
                                    prefix_cache_queries=1100, prefix_cache_hits=425))
    assert line == ("Avg prompt throughput: 50.0 tokens/s, Avg generation throughput: "
                    "50.0 tokens/s, Running: 3 reqs, Waiting: 2 reqs, KV cache usage: 25.0%, "
                    "Prefix cache hit rate: 25.0%")
    idle = snapshot(prompt_tokens=1300, generation_tokens=445, prefix_cache_queries=1100,
                    prefix_cache_hits=425, num_requests_running=0, num_requests_waiting=0)
    assert stats.line(4.0, idle) is None
    monkeypatch.delenv("RVLLM_LOG_STATS_INTERVAL", raising=False)
    assert log_stats_interval(True) is None and log_stats_interval(False) == 10.0
    monkeypatch.setenv("RVLLM_LOG_STATS_INTERVAL", "0.5")
    assert log_stats_interval(False) == 0.5
    monkeypatch.setenv("RVLLM_LOG_STATS_INTERVAL", "soon")
    with pytest.raises(ValueError, match="RVLLM_LOG_STATS_INTERVAL"):
        log_stats_interval(False)

    engine = FakeEngine()
    with caplog.at_level(logging.INFO, logger="rvllm"), \
            client_for(engine, log_stats_interval_s=0.05) as client:
        engine.snap = snapshot(generation_tokens=400)
        deadline = time.monotonic() + WATCHDOG_S
        while "Avg generation throughput" not in caplog.text and time.monotonic() < deadline:
            client.get("/health")
            time.sleep(0.02)
    assert "Running: 3 reqs, Waiting: 2 reqs" in caplog.text
