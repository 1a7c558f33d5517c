"""Prometheus metrics under vLLM's names, so existing vLLM dashboards work.

Gauges and engine counters are read from the engine when scraped; latency
histograms and finished-request counts are observed on the engine thread as
each step's outputs come out, so the times are the engine's, not HTTP's.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from rvllm.engine.async_engine import AsyncEngine, EngineSnapshot
from rvllm.outputs import RequestOutput

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class _EngineCollector(Collector):
    """Gauges and token counters straight from the engine at scrape time."""

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        s = self.engine.snapshot()
        labels = ["model_name"]
        values = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, value)
            return c

        yield gauge("vllm:num_requests_running", "Requests in the running batch.",
                    s.num_requests_running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.",
                    s.num_requests_waiting)
        yield gauge("vllm:num_requests_swapped", "Requests preempted to CPU swap space.",
                    s.num_requests_swapped)
        yield gauge("vllm:kv_cache_usage_perc",
                    "Fraction of KV-cache blocks in use (1 means 100 percent).",
                    s.kv_cache_usage)
        yield gauge("vllm:num_gpu_blocks", "KV-cache blocks in the pool.", s.num_blocks)
        yield gauge("vllm:num_free_blocks", "KV-cache blocks free to allocate.",
                    s.num_free_blocks)
        yield counter("vllm:prompt_tokens", "Prompt tokens taken in.", s.prompt_tokens)
        yield counter("vllm:generation_tokens", "Tokens generated.", s.generation_tokens)
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      s.prefix_cache_queries)
        yield counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                      s.prefix_cache_hits)
        yield counter("vllm:num_preemptions", "Sequences preempted for lack of KV blocks.",
                      s.num_preemptions)
        if s.max_loras:
            lora = GaugeMetricFamily(
                "vllm:lora_requests_info", "The LoRA adapters of the running and the "
                "waiting requests (as vLLM labels them); the value is the time.",
                labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
            lora.add_metric([str(s.max_loras), ",".join(s.running_lora_adapters),
                             ",".join(s.waiting_lora_adapters)], time.time())
            yield lora
        yield gauge("rvllm:engine_resident_memory_bytes",
                    "Resident memory of the engine process (summed over replicas).",
                    s.engine_resident_memory_bytes)
        yield counter("vllm:structured_output_requests",
                      "Requests with a structured-output constraint (response_format, "
                      "structured_outputs, guided_*, or a forced tool call).",
                      s.structured_output_requests)
        yield self._compile_histogram(s, labels, values)
        yield counter("vllm:spec_decode_num_drafts",
                      "Speculative steps: a sequence's drafts verified once.",
                      s.spec_decode_num_drafts)
        yield counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.",
                      s.spec_decode_num_draft_tokens)
        yield counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                      s.spec_decode_num_accepted_tokens)
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, by their position in the draft.",
                                      labels=[*labels, "position"])
        for pos, count in enumerate(s.spec_decode_accepted_per_pos):
            per_pos.add_metric([*values, str(pos)], count)
        yield per_pos

    @staticmethod
    def _compile_histogram(s: EngineSnapshot, labels: list[str], values: list[str]
                           ) -> HistogramMetricFamily:
        from rvllm.structured_output.manager import COMPILE_BUCKETS

        counts = list(s.grammar_compile_buckets) or [0] * (len(COMPILE_BUCKETS) + 1)
        cumulative, total = [], 0
        for bound, count in zip([*map(str, COMPILE_BUCKETS), "+Inf"], counts):
            total += count
            cumulative.append((bound, total))
        h = HistogramMetricFamily("vllm:structured_output_compile_seconds",
                                  "Time to compile a structured-output grammar (cache hits "
                                  "are not compiled).", labels=labels)
        h.add_metric(values, cumulative, sum_value=s.grammar_compile_seconds)
        return h


class RecentLatencies:
    """The latest TTFT, TPOT (time per output token after the first, per finished
    request) and end-to-end latency samples with the time each was taken: percentiles
    over a sliding window for the dashboard, from the same observations the histograms
    take."""

    NAMES = ("ttft", "tpot", "e2e")
    MAX_SAMPLES = 4096  # per latency; older samples are dropped first

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._samples: dict[str, deque[tuple[float, float]]] = {
            name: deque(maxlen=self.MAX_SAMPLES) for name in self.NAMES}

    def add(self, name: str, seconds: float) -> None:
        with self._lock:
            self._samples[name].append((time.monotonic(), seconds))

    def window(self, seconds: float) -> dict[str, list[float]]:
        """Each latency's samples of the last ``seconds``, sorted."""
        since = time.monotonic() - seconds
        with self._lock:
            return {name: sorted(v for t, v in samples if t >= since)
                    for name, samples in self._samples.items()}


class ServerMetrics:
    """The registry behind ``GET /metrics``, fed by the engine's step observer."""

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model_name))
        r = self.registry
        label = ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds",
                              "Time from arrival to the first generated token.", label,
                              buckets=_TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds",
                             "Time between two steps that gave a request tokens.", label,
                             buckets=_ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds",
                             "Time from arrival to the finished output.", label,
                             buckets=_REQUEST_BUCKETS, registry=r).labels(model_name)
        self.queue = Histogram("vllm:request_queue_time_seconds",
                               "Time from arrival to first being scheduled.", label,
                               buckets=_REQUEST_BUCKETS, registry=r).labels(model_name)
        self._success = Counter("vllm:request_success", "Requests finished, by reason.",
                                ["model_name", "finished_reason"], registry=r)
        self._model_name = model_name
        self.recent = RecentLatencies()
        self._lock = threading.Lock()
        # request id -> time of its last token (None before the first): the ITL baseline.
        self._last_token: dict[str, float | None] = {}
        engine.step_observers.append(self.observe_step)

    def observe_step(self, outputs: list[RequestOutput], aborted: list[str]) -> None:
        with self._lock:
            for out in outputs:
                self._observe(out)
            for request_id in aborted:
                self._last_token.pop(request_id, None)
                self._success.labels(self._model_name, "abort").inc()

    def _observe(self, out: RequestOutput) -> None:
        m = out.metrics
        if out.request_id not in self._last_token:
            self._last_token[out.request_id] = None
            if m.first_scheduled_time is not None:
                self.queue.observe(m.first_scheduled_time - m.arrival_time)
        last = self._last_token[out.request_id]
        if any(out.new_token_counts) and m.last_token_time is not None:
            if last is None:
                assert m.first_token_time is not None
                self.ttft.observe(m.first_token_time - m.arrival_time)
                self.recent.add("ttft", m.first_token_time - m.arrival_time)
            else:
                self.itl.observe(m.last_token_time - last)
            self._last_token[out.request_id] = m.last_token_time
        if out.finished:
            del self._last_token[out.request_id]
            if m.finished_time is not None:
                self.e2e.observe(m.finished_time - m.arrival_time)
                self.recent.add("e2e", m.finished_time - m.arrival_time)
            tokens = max((len(c.token_ids) for c in out.outputs), default=0)
            if tokens > 1 and m.first_token_time is not None and m.last_token_time is not None:
                self.recent.add("tpot", (m.last_token_time - m.first_token_time) / (tokens - 1))
            reason = out.outputs[0].finish_reason if out.outputs else None
            self._success.labels(self._model_name, reason or "stop").inc()

    def finished_requests(self) -> dict[str, int]:
        """``vllm:request_success_total`` by finish reason."""
        return {s.labels["finished_reason"]: int(s.value)
                for family in self._success.collect() for s in family.samples
                if s.name.endswith("_total")}

    def render(self) -> bytes:
        return generate_latest(self.registry)
