"""The engine behind the server: LLMEngine's step loop on its own thread, each
request's outputs handed back to asyncio callers through its own stream.

The event loop never runs a step and the step loop never waits on the event
loop. Requests and aborts go into a lock-protected inbox that the loop thread
drains before each step; outputs come back in one ``call_soon_threadsafe``
batch per step. LLMEngine itself is touched by the loop thread only.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rvllm.config import EngineArgs
from rvllm.inputs import PromptType
from rvllm.outputs import RequestOutput
from rvllm.pooling_params import PoolingParams
from rvllm.sampling_params import SamplingParams
from rvllm.tokenizer import Tokenizer

if TYPE_CHECKING:  # torch loads with it; the server's front process runs without
    from rvllm.engine.llm_engine import LLMEngine

__all__ = ["AsyncEngine", "EngineDeadError", "EngineSnapshot", "PromptType", "RequestStream"]

logger = logging.getLogger("rvllm")

# Called on the loop thread after each iteration with the outputs of the step and
# the ids of the requests aborted (or failed) in it.
StepObserver = Callable[[list[RequestOutput], list[str]], None]


class EngineDeadError(RuntimeError):
    """The engine cannot take or finish this request (it failed a step or shut down)."""


@dataclass(slots=True)
class EngineSnapshot:
    """Engine gauges and counters, read without stopping the loop."""

    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage: float
    num_free_blocks: int
    num_blocks: int
    prompt_tokens: int
    generation_tokens: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    # Structured output: constrained requests, and the grammar compile-time histogram
    # (counts per bucket of structured_output.manager.COMPILE_BUCKETS, then past the last).
    structured_output_requests: int = 0
    grammar_compile_buckets: tuple[int, ...] = ()
    grammar_compile_seconds: float = 0.0
    grammar_compile_count: int = 0
    # Speculative decoding: steps of one sequence that verified drafts, drafted and
    # accepted tokens, and acceptances by draft position.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_accepted_per_pos: tuple[int, ...] = ()
    engine_resident_memory_bytes: int = 0  # the engine process's resident memory
    num_requests_swapped: int = 0  # preempted to CPU swap space (not in waiting's count)
    # LoRA (--enable-lora): the adapters of the running and the waiting requests, by
    # name, and --max-loras (0: LoRA off).
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    max_loras: int = 0


def snapshot_of(engine: LLMEngine) -> EngineSnapshot:
    """The gauges and counters of ``engine`` now (read from the thread that steps it, or
    while it is not stepping)."""
    bm = engine.block_manager
    scheduler = engine.scheduler
    lora = scheduler.config.max_loras > 0  # the adapters' names only where LoRA is on
    running = len({s.request_id for s in list(scheduler.running)})
    swapped = len({s.request_id for s in list(scheduler.swapped)})
    return EngineSnapshot(
        num_requests_running=running,
        num_requests_waiting=max(0, engine.num_unfinished_requests() - running - swapped),
        kv_cache_usage=bm.usage, num_free_blocks=bm.num_free_blocks, num_blocks=bm.num_blocks,
        prompt_tokens=engine.stats["prompt_tokens"],
        generation_tokens=engine.stats["generation_tokens"],
        prefix_cache_queries=bm.prefix_cache_queries, prefix_cache_hits=bm.prefix_cache_hits,
        num_preemptions=scheduler.num_preemptions, num_requests_swapped=swapped,
        running_lora_adapters=_adapters(list(scheduler.running)) if lora else (),
        waiting_lora_adapters=(_adapters([*scheduler.waiting, *scheduler.swapped])
                               if lora else ()),
        max_loras=scheduler.config.max_loras,
        **engine.snapshot_counters())


def _adapters(seqs: list[Any]) -> tuple[str, ...]:
    """The names of the LoRA adapters ``seqs`` run, sorted."""
    return tuple(sorted({s.params.lora_request.lora_name for s in seqs
                         if s.params.lora_request is not None}))


_END = object()  # end of a stream without a finished output (the request was aborted)


class RequestStream:
    """The outputs of one request, in order, as an async iterator.

    Outputs carry cumulative text and token ids, so when the consumer falls behind
    the queued ones are merged into the newest (``new_token_counts`` summed): a slow
    client costs the loop nothing and loses nothing.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop,
                 final_only: bool) -> None:
        self.request_id = request_id
        self.loop = loop
        self.final_only = final_only
        self.accepted: asyncio.Future[None] = loop.create_future()
        self.finished = False
        self._items: deque[object] = deque()
        self._ready = asyncio.Event()

    def put(self, item: object) -> None:
        """Event loop thread only: an output, an exception, or ``_END``."""
        self._items.append(item)
        self._ready.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        while not self._items:
            if self.finished:
                raise StopAsyncIteration
            self._ready.clear()
            await self._ready.wait()
        latest: RequestOutput | None = None
        counts: list[int] = []
        while self._items:
            item = self._items[0]
            if not isinstance(item, RequestOutput):
                if latest is not None:
                    break  # hand out what came before the end first
                self._items.popleft()
                self.finished = True
                if item is _END:
                    raise StopAsyncIteration
                assert isinstance(item, BaseException)
                raise item
            self._items.popleft()
            counts = item.new_token_counts if latest is None else [
                a + b for a, b in zip(counts, item.new_token_counts)]
            latest = item
        assert latest is not None
        latest.new_token_counts = counts
        self.finished = latest.finished
        return latest


class _Outbox:
    """What one loop iteration hands to the event loop(s), sent in one call each."""

    def __init__(self) -> None:
        self.items: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, object]]] = {}

    def add(self, stream: RequestStream, item: object) -> None:
        self.items.setdefault(stream.loop, []).append((stream, item))

    def flush(self) -> None:
        for loop, batch in self.items.items():
            try:
                loop.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:  # that loop is closed: nobody is listening
                pass
        self.items = {}


def _deliver(batch: list[tuple[RequestStream, object]]) -> None:
    for stream, item in batch:
        if not stream.accepted.done():
            if isinstance(item, BaseException):  # rejected, or failed before acceptance
                stream.accepted.set_exception(item)
                continue
            stream.accepted.set_result(None)
        if item is not _ACCEPTED:
            stream.put(item)


_ACCEPTED = object()


@dataclass(slots=True)
class _NewRequest:
    stream: RequestStream
    prompt: PromptType
    params: SamplingParams
    arrival_time: float


class AsyncEngine:
    """An LLMEngine driven by a background thread, for asyncio callers.

    ``await add_request(...)`` returns a RequestStream once the engine has
    accepted the request, or raises ValueError (nothing queued) when the prompt or
    the parameters are unusable. ``abort`` is safe from any thread. A step that
    raises fails the requests in flight with EngineDeadError and the loop goes on.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.step_observers: list[StepObserver] = []
        # Called on the loop thread when the engine can never step again.
        self.on_fatal: Callable[[Exception], None] | None = None
        self._cond = threading.Condition()
        self._new: list[_NewRequest] = []
        self._aborts: list[str] = []
        self._stopping = False
        self._streams: dict[str, RequestStream] = {}  # loop thread only
        self._thread = threading.Thread(target=self._run, name="rvllm-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> AsyncEngine:
        from rvllm.engine.llm_engine import LLMEngine

        return cls(LLMEngine(args))

    # ------------------------------------------------------------ for callers

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.model_config.vocab_size

    @property
    def model_path(self) -> str:
        return self.engine.model_config.path

    @property
    def runner_type(self) -> str:
        """What the model runs as: "generate" or "pooling" (embeddings)."""
        return self.engine.runner_type

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The token ids that end a sequence (unless a request ignores EOS)."""
        return self.engine.eos_token_ids

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    async def add_request(self, request_id: str, prompt: PromptType,
                          params: SamplingParams | PoolingParams,
                          final_only: bool = False) -> RequestStream:
        """Queue a request and wait until the engine has taken it. With ``final_only``
        the stream yields just the finished output."""
        stream = RequestStream(request_id, asyncio.get_running_loop(), final_only)
        with self._cond:
            if self._stopping:
                raise EngineDeadError("the engine is shutting down.")
            self._new.append(_NewRequest(stream, prompt, params, time.time()))
            self._cond.notify()
        try:
            await stream.accepted
        except asyncio.CancelledError:
            self.abort(request_id)  # the caller left while the request was being queued
            raise
        return stream

    async def generate(self, prompt: PromptType, params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as it runs; leaving the loop early aborts it."""
        stream = await self.add_request(request_id, prompt, params)
        try:
            async for out in stream:
                yield out
        finally:
            if not stream.finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks at the start of the next step."""
        with self._cond:
            self._aborts.append(request_id)
            self._cond.notify()

    def snapshot(self) -> EngineSnapshot:
        snap = snapshot_of(self.engine)
        snap.num_requests_waiting += len(self._new)  # added, not yet taken by the loop
        return snap

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop after its current step and end every open stream."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
        if self._thread.is_alive():
            logger.error("the engine loop did not stop within %.0fs", timeout)
            return
        out = _Outbox()
        self._fail_all(EngineDeadError("the server is shutting down."), out)
        for item in self._new:
            out.add(item.stream, EngineDeadError("the server is shutting down."))
        self._new = []
        out.flush()

    # ------------------------------------------------------------ loop thread

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._has_work() and not self.engine.has_idle_work:
                    self._cond.wait()
                if not self._has_work():
                    self._cond.wait(self.engine.idle_work_due_in())  # a request may come
                idle = not self._has_work()
            if idle:
                if not self.engine.idle_work_due_in():
                    self.engine.idle_work()  # nothing to step: a slice of deferred work
                continue
            with self._cond:
                if self._stopping:
                    return
                new, self._new = self._new, []
                aborts, self._aborts = self._aborts, []
            out = _Outbox()
            for item in new:
                self._add(item, out)
            aborted = [r for r in aborts if self._abort(r, out)]
            out.flush()  # accept before the step, so callers need not wait for it
            outputs: list[RequestOutput] = []
            if self.engine.has_unfinished_requests():
                outputs = self._step(out, aborted)
                out.flush()
            if outputs or aborted:
                self._notify(outputs, aborted)

    def _has_work(self) -> bool:
        """Something for the loop to take or step (call with ``_cond`` held)."""
        return bool(self._new or self._aborts or self._stopping
                    or self.engine.has_unfinished_requests())

    def _add(self, item: _NewRequest, out: _Outbox) -> None:
        request_id = item.stream.request_id
        try:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use.")
            self.engine.add_request(request_id, item.prompt, item.params, item.arrival_time)
        except ValueError as e:
            out.add(item.stream, e)
            return
        except Exception as e:  # a bug, not bad input: still never leave the caller hanging
            logger.exception("add_request failed for %s", request_id)
            out.add(item.stream, ValueError(f"the request could not be added: {e}"))
            return
        self._streams[request_id] = item.stream
        out.add(item.stream, _ACCEPTED)

    def _abort(self, request_id: str, out: _Outbox) -> bool:
        live = self.engine.abort_request(request_id)
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            out.add(stream, _END)
        return live

    def _step(self, out: _Outbox, aborted: list[str]) -> list[RequestOutput]:
        try:
            outputs = self.engine.step()
        except Exception as e:
            logger.exception("engine step failed; failing the %d requests in flight",
                             self.engine.num_unfinished_requests())
            aborted += self._fail_all(EngineDeadError(f"the engine failed a step: {e}"), out)
            if _is_fatal(e):
                # A lost tensor-parallel worker cannot come back: take no more requests,
                # and let the owner (the server) exit.
                with self._cond:
                    self._stopping = True
                if self.on_fatal is not None:
                    self.on_fatal(e)
            return []
        for o in outputs:
            stream = self._streams.get(o.request_id)
            if stream is None:
                continue
            if o.finished:
                del self._streams[o.request_id]
            elif stream.final_only:
                continue
            out.add(stream, o)
        return outputs

    def _notify(self, outputs: list[RequestOutput], aborted: list[str]) -> None:
        for observe in self.step_observers:
            try:
                observe(outputs, aborted)
            except Exception:
                logger.exception("step observer failed")

    def _fail_all(self, error: Exception, out: _Outbox) -> list[str]:
        failed = list(self.engine.requests)
        for request_id in failed:
            try:
                self.engine.abort_request(request_id)
            except Exception:
                logger.exception("abort of %s failed", request_id)
        for stream in self._streams.values():
            out.add(stream, error)
        self._streams.clear()
        return failed


def _is_fatal(error: Exception) -> bool:
    from rvllm.executor.parallel import WorkerDiedError

    return isinstance(error, WorkerDiedError)
