"""The engine's side of structured output: grammars compiled off the step loop and
cached, a matcher per sequence, and one step's bitmask.

A request with a constraint is checked when it is added (``validate``: a constraint that
cannot compile is refused there, without the tokenizer), then compiled on a small
thread pool (``compile`` returns a future; the engine holds the request back until it is
done while the others keep stepping). Compiled grammars are cached by the constraint's
canonical text, so a schema sent again starts at once.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from rvllm.sampling_params import StructuredOutputsParams
from rvllm.structured_output.backends import BACKENDS, resolve_backend_name

logger = logging.getLogger("rvllm")

# Upper bounds (seconds) of the compile-time histogram's buckets, Prometheus style.
COMPILE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                   2.5, 5.0, 10.0)
_CACHE_SIZE = 256


class StructuredOutputManager:
    """Compiles constraints for one engine and makes their matchers."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int],
                 backend: str = "auto", disable_any_whitespace: bool = False,
                 disable_additional_properties: bool = False) -> None:
        self.backend_name = resolve_backend_name(backend)
        self._backend_class = BACKENDS[self.backend_name]
        self._tokenizer = tokenizer  # rvllm's Tokenizer: its backend's JSON is what they read
        self._vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self.disable_any_whitespace = disable_any_whitespace
        self.disable_additional_properties = disable_additional_properties
        self._backend: Any = None
        self._backend_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._cache: OrderedDict[str, Future] = OrderedDict()
        # Counters for /metrics: constrained requests, and compile times as a histogram.
        self.num_requests = 0
        self.compile_bucket_counts = [0] * (len(COMPILE_BUCKETS) + 1)
        self.compile_seconds_sum = 0.0
        self.compile_count = 0
        self._stats_lock = threading.Lock()

    def apply_defaults(self, spec: StructuredOutputsParams) -> None:
        """The engine-wide whitespace and additionalProperties defaults, on a request's
        own constraint (a request may turn them on, not off)."""
        spec.disable_any_whitespace |= self.disable_any_whitespace
        spec.disable_additional_properties |= self.disable_additional_properties

    def validate(self, spec: StructuredOutputsParams) -> None:
        """Raise ValueError, naming the field, if ``spec`` cannot compile."""
        if self._tokenizer is None:
            raise ValueError("structured_outputs needs a tokenizer (skip_tokenizer_init is "
                             "set).")
        self._backend_class.validate(spec)

    def compile(self, spec: StructuredOutputsParams) -> Future:
        """A future of ``spec``'s compiled grammar, from the cache or the pool."""
        self.num_requests += 1
        key = spec.key()
        future = self._cache.get(key)
        if future is not None and not (future.done() and future.exception() is not None):
            self._cache.move_to_end(key)
            return future
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="rvllm-grammar")
        future = self._pool.submit(self._compile, spec)
        self._cache[key] = future
        while len(self._cache) > _CACHE_SIZE:
            self._cache.popitem(last=False)
        return future

    def matcher(self, compiled: Any) -> Any:
        return self._get_backend().matcher(compiled)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _get_backend(self) -> Any:
        with self._backend_lock:
            if self._backend is None:
                start = time.perf_counter()
                self._backend = self._backend_class(self._tokenizer.backend.to_str(),
                                                    self._vocab_size, self._eos)
                logger.info("structured outputs: %s ready in %.2fs", self.backend_name,
                            time.perf_counter() - start)
            return self._backend

    def _compile(self, spec: StructuredOutputsParams) -> Any:
        backend = self._get_backend()
        start = time.perf_counter()
        try:
            return backend.compile(spec)
        finally:
            seconds = time.perf_counter() - start
            with self._stats_lock:
                self.compile_bucket_counts[bisect.bisect_left(COMPILE_BUCKETS, seconds)] += 1
                self.compile_seconds_sum += seconds
                self.compile_count += 1
