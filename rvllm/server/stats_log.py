"""The server's periodic stats line, as vLLM logs it (``--disable-log-stats`` turns it
off): every interval (10 s, or ``RVLLM_LOG_STATS_INTERVAL`` seconds), the prompt and
generation throughput since the last line, the requests running and waiting, the KV
cache's use and the prefix cache's hit rate over the interval. An idle server logs
nothing: a line comes when tokens moved or a request is live."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

logger = logging.getLogger("rvllm")

DEFAULT_INTERVAL_S = 10.0


def log_stats_interval(disabled: bool) -> float | None:
    """Seconds between lines; None when ``--disable-log-stats`` is given."""
    if disabled:
        return None
    value = os.environ.get("RVLLM_LOG_STATS_INTERVAL")
    if value is None:
        return DEFAULT_INTERVAL_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = 0.0
    if not seconds > 0.0:
        raise ValueError(f"RVLLM_LOG_STATS_INTERVAL must be a positive number of seconds, "
                         f"got {value!r}.")
    return seconds


class StatsLogger:
    """Turns successive ``EngineSnapshot``s into the lines to log."""

    def __init__(self) -> None:
        self._last: tuple[float, Any] | None = None

    def line(self, now: float, snap: Any) -> str | None:
        """The line for the interval that ends at ``now`` (seconds, monotonic); None for
        the first snapshot, and while nothing moves and no request is live."""
        last, self._last = self._last, (now, snap)
        if last is None:
            return None
        then, before = last
        prompt = snap.prompt_tokens - before.prompt_tokens
        generated = snap.generation_tokens - before.generation_tokens
        live = snap.num_requests_running + snap.num_requests_waiting
        if not (prompt or generated or live):
            return None
        seconds = max(now - then, 1e-9)
        queries = snap.prefix_cache_queries - before.prefix_cache_queries
        hits = snap.prefix_cache_hits - before.prefix_cache_hits
        return (f"Avg prompt throughput: {prompt / seconds:.1f} tokens/s, "
                f"Avg generation throughput: {generated / seconds:.1f} tokens/s, "
                f"Running: {snap.num_requests_running} reqs, "
                f"Waiting: {snap.num_requests_waiting} reqs, "
                f"KV cache usage: {100 * snap.kv_cache_usage:.1f}%, "
                f"Prefix cache hit rate: {100 * hits / queries if queries else 0.0:.1f}%")

    async def run(self, engine: Any, interval_s: float) -> None:
        """Log a line every ``interval_s`` until cancelled."""
        self.line(time.monotonic(), engine.snapshot())
        while True:
            await asyncio.sleep(interval_s)
            text = self.line(time.monotonic(), engine.snapshot())
            if text is not None:
                logger.info(text)
