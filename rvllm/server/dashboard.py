"""The live dashboard: ``GET /dashboard``, one page served from the package (hand-written
HTML, JavaScript and CSS in ``dashboard_assets/``, nothing fetched from elsewhere), and
``GET /v1/engine/stats``, the JSON it polls once a second.

The stats are read from what ``GET /metrics`` reads: the engine's snapshot (gauges and
counters, summed over data-parallel replicas) and ``ServerMetrics`` (finished requests,
latencies), so the two agree. The table of live requests comes from the endpoints'
``add_request`` calls (``track``) and the step outputs.
"""

from __future__ import annotations

import functools
import json
import math
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import FileResponse, HTMLResponse
from pydantic import BaseModel, Field

import rvllm
from rvllm.engine.async_engine import AsyncEngine, EngineSnapshot, RequestStream
from rvllm.engine.data_parallel import DataParallelEngine
from rvllm.engine.process_engine import ProcessEngine
from rvllm.inputs import PromptType
from rvllm.outputs import RequestOutput
from rvllm.pooling_params import PoolingParams
from rvllm.sampling_params import SamplingParams
from rvllm.server.errors import APIError
from rvllm.server.metrics import ServerMetrics
from rvllm.server.openapi import openapi_responses

ASSETS = Path(__file__).parent / "dashboard_assets"
ASSET_TYPES = {"dashboard.js": "text/javascript; charset=utf-8",
               "dashboard.css": "text/css; charset=utf-8"}
# The page may load its own scripts and styles and call its own server, nothing else.
CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; "
                           "connect-src 'self'; img-src 'self' data:; base-uri 'none'; "
                           "form-action 'none'; frame-ancestors 'none'")
LATENCY_WINDOW_S = 60.0  # the latency percentiles' sliding window
RATE_WINDOW_S = 5.0  # tokens per second are averaged over about this long
PROMPT_CHARS = 300  # of a prompt shown with --dashboard-show-prompts
STALE_S = 5.0  # a tracked request the engine no longer counts is dropped after this


# ------------------------------------------------------------------ the JSON's models


class RequestCountStats(BaseModel):
    running: int = Field(description="Requests in the running batch "
                                     "(vllm:num_requests_running)")
    waiting: int = Field(description="Requests waiting to be scheduled, those preempted by "
                                     "recompute included (vllm:num_requests_waiting)")
    swapped: int = Field(description="Requests preempted to CPU swap space "
                                     "(vllm:num_requests_swapped)")


class KVCacheStats(BaseModel):
    usage: float = Field(description="Fraction of KV-cache blocks in use, 0 to 1 "
                                     "(vllm:kv_cache_usage_perc)")
    num_blocks: int = Field(description="KV-cache blocks in the pool (vllm:num_gpu_blocks)")
    num_free_blocks: int = Field(description="Blocks free to allocate (vllm:num_free_blocks)")


class PrefixCacheStats(BaseModel):
    queries: int = Field(description="Prompt tokens looked up (vllm:prefix_cache_queries_total)")
    hits: int = Field(description="Prompt tokens found (vllm:prefix_cache_hits_total)")
    hit_rate: float | None = Field(description="hits / queries since start; null before "
                                               "the first query")
    recent_hit_rate: float | None = Field(description="hits / queries over the throughput "
                                                      "window; null without queries in it")


class ThroughputStats(BaseModel):
    prompt_tokens_per_s: float | None = Field(
        description="Prompt tokens taken in per second; null on the first call")
    generation_tokens_per_s: float | None = Field(
        description="Tokens generated per second; null on the first call")
    window_s: float | None = Field(description="Seconds the rates are averaged over: since "
                                               "the earliest reading of the last 5 s, or "
                                               "since the previous one")


class TotalStats(BaseModel):
    prompt_tokens: int = Field(description="vllm:prompt_tokens_total")
    generation_tokens: int = Field(description="vllm:generation_tokens_total")
    preemptions: int = Field(description="vllm:num_preemptions_total")
    structured_output_requests: int = Field(
        description="vllm:structured_output_requests_total")
    finished_requests: dict[str, int] = Field(
        description="vllm:request_success_total by finished_reason")


class LatencyPercentiles(BaseModel):
    count: int = Field(description="Samples in the window")
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None


class LatencyStats(BaseModel):
    window_s: float = Field(description="The sliding window, in seconds")
    ttft: LatencyPercentiles = Field(description="Time to first token, seconds")
    tpot: LatencyPercentiles = Field(description="Time per output token after the first, "
                                                 "seconds (one sample per finished request)")
    e2e: LatencyPercentiles = Field(description="Arrival to finished output, seconds")


class SpecDecodeStats(BaseModel):
    num_drafts: int = Field(description="vllm:spec_decode_num_drafts_total")
    num_draft_tokens: int = Field(description="vllm:spec_decode_num_draft_tokens_total")
    num_accepted_tokens: int = Field(description="vllm:spec_decode_num_accepted_tokens_total")
    acceptance_rate: float | None = Field(description="accepted / draft tokens")
    mean_acceptance_length: float | None = Field(
        description="Tokens a verifying step yields on average: 1 + accepted / drafts")


class LiveRequestStats(BaseModel):
    id: str = Field(description="The engine's request id: the response's id, a dash and "
                                "the prompt's index")
    state: str = Field(description="waiting (no token out yet: queued or in prefill) or "
                                   "running (tokens have come out; a preempted request "
                                   "stays running here)")
    prompt_tokens: int | None = Field(description="null until known (a text prompt is "
                                                  "tokenized by the engine)")
    output_tokens: int = Field(description="Tokens generated so far, all choices together")
    age_s: float = Field(description="Seconds since the request arrived")
    prompt: str | None = Field(None, description="The prompt's start, only with "
                                                 "--dashboard-show-prompts")


class ReplicaStats(BaseModel):
    index: int
    alive: bool
    pid: int | None
    device: str | None
    threads: int | None
    requests: RequestCountStats
    kv_cache: KVCacheStats
    throughput: ThroughputStats
    totals: dict[str, int] = Field(description="This replica's prompt_tokens, "
                                               "generation_tokens, preemptions, "
                                               "prefix_cache_queries, prefix_cache_hits")


class EngineConfigStats(BaseModel):
    model: str = Field(description="The served model name")
    model_path: str | None
    architecture: str | None
    max_model_len: int | None
    dtype: str | None = Field(description="As the engine resolved it (auto made concrete)")
    kv_cache_dtype: str | None
    quantization: str | None
    packed_activations: str | None = Field(
        None, description="What packed weights multiply (--packed-activations): int16 or "
                          "int8; null when no weight runs packed")
    kernel_backend: str | None
    device: str | None
    block_size: int | None
    num_blocks: int = Field(description="KV-cache blocks, summed over replicas")
    num_cpu_blocks: int | None = Field(description="CPU swap space, in blocks")
    max_num_seqs: int | None
    max_num_batched_tokens: int | None
    enable_prefix_caching: bool | None
    speculative: str | None = Field(description="The speculative method, or null when off")
    tensor_parallel_size: int | None
    data_parallel_size: int
    threads: int | None = Field(description="The engine's torch threads")
    cpu_count: int | None = Field(description="CPUs of this machine")
    show_prompts: bool = Field(description="Whether live requests carry their prompt "
                                           "(--dashboard-show-prompts)")
    rvllm_version: str


class EngineStats(BaseModel):
    """What ``GET /v1/engine/stats`` answers: the dashboard's data."""

    time: float = Field(description="Unix time of this reading")
    requests: RequestCountStats
    kv_cache: KVCacheStats
    prefix_cache: PrefixCacheStats
    throughput: ThroughputStats
    totals: TotalStats
    latency: LatencyStats
    spec_decode: SpecDecodeStats | None = Field(
        description="null unless speculative decoding is configured or has drafted")
    live_requests: list[LiveRequestStats] = Field(description="Oldest first")
    replicas: list[ReplicaStats] = Field(
        description="One entry per data-parallel replica (empty without data parallelism); "
                    "the other fields are their sum")
    config: EngineConfigStats


# ------------------------------------------------------------------ live requests


@dataclass(slots=True)
class _Live:
    arrival: float
    prompt_tokens: int | None
    output_tokens: int = 0
    running: bool = False
    prompt_text: str | None = None
    prompt_ids: list[int] | None = None


class LiveRequests:
    """The requests in the engine, by id: noted when an endpoint adds one (``added``),
    updated from every step's outputs (``observe_step``, an engine step observer),
    dropped when finished or aborted."""

    def __init__(self, keep_prompts: bool) -> None:
        self.keep_prompts = keep_prompts
        self._lock = threading.Lock()
        self._live: dict[str, _Live] = {}

    def added(self, request_id: str, prompt: PromptType) -> None:
        ids = prompt if isinstance(prompt, list) else (
            prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None)
        text = prompt if isinstance(prompt, str) else (
            prompt.get("prompt") if isinstance(prompt, dict) else None)
        live = _Live(time.time(), len(ids) if isinstance(ids, list) else None)
        if self.keep_prompts:
            live.prompt_text = text if isinstance(text, str) else None
            live.prompt_ids = ids if isinstance(ids, list) else None
        with self._lock:
            self._live[request_id] = live

    def dropped(self, request_id: str) -> None:
        with self._lock:
            self._live.pop(request_id, None)

    def observe_step(self, outputs: list[RequestOutput], aborted: list[str]) -> None:
        with self._lock:
            for out in outputs:
                if out.finished:
                    self._live.pop(out.request_id, None)
                    continue
                live = self._live.get(out.request_id)
                if live is None:  # added some other way than through ``track``
                    live = self._live[out.request_id] = _Live(out.metrics.arrival_time, None)
                live.prompt_tokens = len(out.prompt_token_ids)
                live.output_tokens = sum(len(c.token_ids) for c in out.outputs)
                live.running = True
                if self.keep_prompts and live.prompt_text is None:
                    live.prompt_text = out.prompt
                    live.prompt_ids = out.prompt_token_ids
            for request_id in aborted:
                self._live.pop(request_id, None)

    def rows(self, engine_has_requests: bool, decode: Any) -> list[LiveRequestStats]:
        """The table, oldest first. ``engine_has_requests``: whether the engine counts any
        request; when it counts none, entries older than ``STALE_S`` are stale (an end
        this table did not hear of) and dropped. ``decode``: token ids to text, for the
        prompts of requests given as ids."""
        now = time.time()
        with self._lock:
            if not engine_has_requests:
                for request_id in [r for r, live in self._live.items()
                                   if now - live.arrival > STALE_S]:
                    del self._live[request_id]
            items = sorted(self._live.items(), key=lambda item: item[1].arrival)
        rows = []
        for request_id, live in items:
            prompt = None
            if self.keep_prompts:
                prompt = live.prompt_text
                if prompt is None and live.prompt_ids is not None and decode is not None:
                    try:
                        prompt = decode(live.prompt_ids[:PROMPT_CHARS])
                    except Exception:
                        prompt = None
                prompt = None if prompt is None else prompt[:PROMPT_CHARS]
            rows.append(LiveRequestStats(
                id=request_id, state="running" if live.running else "waiting",
                prompt_tokens=live.prompt_tokens, output_tokens=live.output_tokens,
                age_s=round(max(0.0, now - live.arrival), 3), prompt=prompt))
        return rows


class TrackedEngine:
    """The engine as the endpoints see it: the same engine, whose ``add_request`` also
    notes the request in the dashboard's table of live requests."""

    def __init__(self, engine: Any, live: LiveRequests) -> None:
        self._engine = engine
        self._live = live

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def add_request(self, request_id: str, prompt: PromptType,
                          params: SamplingParams | PoolingParams,
                          final_only: bool = False) -> RequestStream:
        self._live.added(request_id, prompt)
        try:
            return await self._engine.add_request(request_id, prompt, params, final_only)
        except BaseException:
            self._live.dropped(request_id)
            raise


# ------------------------------------------------------------------ rates


class _Rates:
    """Counters' rates of change, since the earliest reading of the last
    ``RATE_WINDOW_S``, or since the previous reading when there is none that recent."""

    FIELDS = ("prompt_tokens", "generation_tokens", "prefix_cache_queries",
              "prefix_cache_hits")

    def __init__(self) -> None:
        self._readings: list[tuple[float, tuple[int, ...]]] = []
        self._lock = threading.Lock()

    def update(self, snap: EngineSnapshot) -> tuple[float | None, dict[str, int]]:
        """Add a reading; returns the seconds since the window's first reading (None
        without one) and each counter's increase since then."""
        now = time.monotonic()
        values = tuple(getattr(snap, name) for name in self.FIELDS)
        with self._lock:
            readings = self._readings
            while len(readings) > 1 and now - readings[0][0] > RATE_WINDOW_S:
                readings.pop(0)
            first = readings[0] if readings else None
            if not readings or now - readings[-1][0] >= 0.2:
                readings.append((now, values))
        if first is None or now - first[0] <= 0:
            return None, {}
        # A counter that went down (a replica restarted) counts from zero.
        return now - first[0], {name: max(0, v - v0)
                                for name, v, v0 in zip(self.FIELDS, values, first[1])}


def _throughput(seconds: float | None, deltas: dict[str, int]) -> ThroughputStats:
    if seconds is None:
        return ThroughputStats(prompt_tokens_per_s=None, generation_tokens_per_s=None,
                               window_s=None)
    return ThroughputStats(
        prompt_tokens_per_s=round(deltas["prompt_tokens"] / seconds, 2),
        generation_tokens_per_s=round(deltas["generation_tokens"] / seconds, 2),
        window_s=round(seconds, 3))


def _percentiles(values: list[float]) -> LatencyPercentiles:
    """Nearest-rank percentiles of sorted ``values``."""
    def rank(q: float) -> float | None:
        if not values:
            return None
        # The smallest value with a fraction q of the values at or below it (q * n rounded
        # first, so that 0.9 * 100 is 90, not 90.00000000000001).
        index = max(0, math.ceil(round(q * len(values), 6)) - 1)
        return round(values[index], 6)

    return LatencyPercentiles(count=len(values), p50=rank(0.50), p90=rank(0.90),
                              p99=rank(0.99))


def _ratio(a: int, b: int) -> float | None:
    return round(a / b, 6) if b else None


def _requests(s: EngineSnapshot) -> RequestCountStats:
    return RequestCountStats(running=s.num_requests_running, waiting=s.num_requests_waiting,
                             swapped=s.num_requests_swapped)


def _kv_cache(s: EngineSnapshot) -> KVCacheStats:
    return KVCacheStats(usage=round(s.kv_cache_usage, 6), num_blocks=s.num_blocks,
                        num_free_blocks=s.num_free_blocks)


# ------------------------------------------------------------------ the dashboard


class Dashboard:
    """The page and its data for one app: ``track`` the engine the endpoints use, then
    ``add_routes``."""

    def __init__(self, engine: Any, metrics: ServerMetrics, served_model_name: str,
                 show_prompts: bool = False) -> None:
        self.engine = engine
        self.metrics = metrics
        self.served_model_name = served_model_name
        self.show_prompts = show_prompts
        self.live = LiveRequests(keep_prompts=show_prompts)
        engine.step_observers.append(self.live.observe_step)
        self._rates = _Rates()
        self._replica_rates: dict[int, tuple[Any, _Rates]] = {}

    def track(self) -> TrackedEngine:
        return TrackedEngine(self.engine, self.live)

    def add_routes(self, app: FastAPI) -> None:
        @app.get("/dashboard", include_in_schema=False)
        async def dashboard_page() -> HTMLResponse:
            html = (ASSETS / "index.html").read_text(encoding="utf-8")
            return HTMLResponse(html, headers=_page_headers())

        @app.get("/dashboard/assets/{name}", include_in_schema=False)
        async def dashboard_asset(name: str) -> FileResponse:
            if name not in ASSET_TYPES:
                raise APIError(f"No dashboard asset named {name!r}.", 404)
            return FileResponse(ASSETS / name, media_type=ASSET_TYPES[name],
                                headers=_page_headers())

        @app.get("/v1/engine/stats", response_model=EngineStats,
                 responses=openapi_responses(None, (401,)),
                 summary="Engine statistics (the dashboard's data)")
        async def engine_stats() -> EngineStats:
            """Live engine statistics, from the counters behind /metrics; the dashboard
            at /dashboard polls it once a second."""
            return self.stats()

    def stats(self) -> EngineStats:
        s = self.engine.snapshot()
        seconds, deltas = self._rates.update(s)
        latency = self.metrics.recent.window(LATENCY_WINDOW_S)
        tokenizer = getattr(self.engine, "tokenizer", None)
        decode = None if tokenizer is None else (
            lambda ids: tokenizer.decode(ids, skip_special_tokens=False))
        busy = s.num_requests_running + s.num_requests_waiting > 0
        return EngineStats(
            time=time.time(),
            requests=_requests(s),
            kv_cache=_kv_cache(s),
            prefix_cache=PrefixCacheStats(
                queries=s.prefix_cache_queries, hits=s.prefix_cache_hits,
                hit_rate=_ratio(s.prefix_cache_hits, s.prefix_cache_queries),
                recent_hit_rate=_ratio(deltas.get("prefix_cache_hits", 0),
                                       deltas.get("prefix_cache_queries", 0))),
            throughput=_throughput(seconds, deltas),
            totals=TotalStats(prompt_tokens=s.prompt_tokens,
                              generation_tokens=s.generation_tokens,
                              preemptions=s.num_preemptions,
                              structured_output_requests=s.structured_output_requests,
                              finished_requests=self.metrics.finished_requests()),
            latency=LatencyStats(window_s=LATENCY_WINDOW_S,
                                 **{name: _percentiles(values)
                                    for name, values in latency.items()}),
            spec_decode=self._spec_decode(s),
            live_requests=self.live.rows(busy, decode),
            replicas=self._replicas(),
            config=self._config(s),
        )

    def _spec_decode(self, s: EngineSnapshot) -> SpecDecodeStats | None:
        args = _engine_args(self.engine)
        if s.spec_decode_num_drafts == 0 and getattr(args, "speculative_config", None) is None:
            return None
        return SpecDecodeStats(
            num_drafts=s.spec_decode_num_drafts,
            num_draft_tokens=s.spec_decode_num_draft_tokens,
            num_accepted_tokens=s.spec_decode_num_accepted_tokens,
            acceptance_rate=_ratio(s.spec_decode_num_accepted_tokens,
                                   s.spec_decode_num_draft_tokens),
            mean_acceptance_length=(
                None if not s.spec_decode_num_drafts else
                round(1 + s.spec_decode_num_accepted_tokens / s.spec_decode_num_drafts, 6)))

    def _replicas(self) -> list[ReplicaStats]:
        if not isinstance(self.engine, DataParallelEngine):
            return []
        out = []
        for index, replica in enumerate(list(self.engine.replicas)):
            known = self._replica_rates.get(index)
            if known is None or known[0] is not replica:  # first seen, or restarted
                known = self._replica_rates[index] = (replica, _Rates())
            s = replica.snapshot()
            seconds, deltas = known[1].update(s)
            args = _engine_args(replica)
            out.append(ReplicaStats(
                index=index, alive=replica.is_running,
                pid=getattr(replica, "pid", None),
                device=getattr(args, "device", None),
                threads=getattr(replica, "num_threads", None),
                requests=_requests(s), kv_cache=_kv_cache(s),
                throughput=_throughput(seconds, deltas),
                totals={"prompt_tokens": s.prompt_tokens,
                        "generation_tokens": s.generation_tokens,
                        "preemptions": s.num_preemptions,
                        "prefix_cache_queries": s.prefix_cache_queries,
                        "prefix_cache_hits": s.prefix_cache_hits}))
        return out

    def _config(self, s: EngineSnapshot) -> EngineConfigStats:
        engine = self.engine
        args = _engine_args(engine)
        first = engine.replicas[0] if isinstance(engine, DataParallelEngine) else engine
        llm = first.engine if isinstance(first, AsyncEngine) else None  # in this process
        model_path = getattr(engine, "model_path", None)
        # What the engine resolved (``LLMEngine.settings``): from the engine in this
        # process, or as the engine process reported it when it was ready.
        info = getattr(first, "info", None)
        settings = (llm.settings() if llm is not None
                    else getattr(info, "settings", None) or {})
        return EngineConfigStats(
            model=self.served_model_name,
            model_path=model_path,
            architecture=settings.get("architecture") or _architecture(model_path),
            max_model_len=getattr(engine, "max_model_len", None),
            dtype=settings.get("dtype", getattr(args, "dtype", None)),
            kv_cache_dtype=settings.get("kv_cache_dtype", getattr(args, "kv_cache_dtype", None)),
            quantization=settings.get("quantization", getattr(args, "quantization", None)),
            packed_activations=settings.get("packed_activations"),
            kernel_backend=settings.get("kernel_backend", getattr(args, "kernel_backend", None)),
            device=settings.get("device", getattr(args, "device", None)),
            block_size=getattr(args, "block_size", None),
            num_blocks=s.num_blocks,
            num_cpu_blocks=getattr(args, "num_cpu_blocks", None),
            max_num_seqs=settings.get("max_num_seqs", getattr(args, "max_num_seqs", None)),
            max_num_batched_tokens=settings.get("max_num_batched_tokens",
                                                getattr(args, "max_num_batched_tokens", None)),
            enable_prefix_caching=getattr(args, "enable_prefix_caching", None),
            speculative=settings.get("speculative"),
            tensor_parallel_size=getattr(args, "tensor_parallel_size", None),
            data_parallel_size=(len(engine.replicas)
                                if isinstance(engine, DataParallelEngine) else 1),
            threads=settings.get("threads", getattr(first, "num_threads", None)),
            cpu_count=os.cpu_count(),
            show_prompts=self.show_prompts,
            rvllm_version=rvllm.__version__,
        )


def _page_headers() -> dict[str, str]:
    return {"Content-Security-Policy": CONTENT_SECURITY_POLICY, "Cache-Control": "no-cache",
            "X-Content-Type-Options": "nosniff"}


def _engine_args(engine: Any) -> Any:
    """The EngineArgs an engine was built from (None for an engine that has none)."""
    if isinstance(engine, DataParallelEngine):
        engine = engine.replicas[0]
    if isinstance(engine, ProcessEngine):
        return engine.args
    if isinstance(engine, AsyncEngine):
        return engine.engine.args
    return None


@functools.cache
def _architecture(model_path: str | None) -> str | None:
    """The model's architecture from its directory's config.json (None for a GGUF file)."""
    if not model_path:
        return None
    config = Path(model_path) / "config.json"
    try:
        archs = json.loads(config.read_text(encoding="utf-8")).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return None
    return archs[0] if archs and isinstance(archs[0], str) else None
