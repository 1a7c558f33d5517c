"""An engine in its own process: the AsyncEngine interface, with LLMEngine's step loop
running in a spawned child.

Requests go to the child in batches over one pipe (a sender thread drains the
inbox, so callers never block on a full pipe); the child answers once when it
has taken a batch and once per step, each answer carrying every output of the
step and a fresh EngineSnapshot. Outputs travel as deltas (the prompt once, then
only the new tokens, text and logprobs) and are made whole again in the parent,
where a reader thread hands them to each request's stream on its event loop and
to the step observers.

When the child dies (killed, out of memory, a lost tensor-parallel worker) the
reader sees the pipe close, fails every open request with EngineDeadError and
calls ``on_death`` (a data-parallel owner restarts the replica) or else
``on_fatal`` (a lone engine is gone for good, as with AsyncEngine).
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import logging
import multiprocessing
import multiprocessing.util  # noqa: F401 - its atexit hook must run after ours
import pickle
import signal
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from rvllm.config import EngineArgs
from rvllm.engine.async_engine import (
    _ACCEPTED,
    _END,
    AsyncEngine,
    EngineDeadError,
    EngineSnapshot,
    RequestStream,
    StepObserver,
    _Outbox,
)
from rvllm.engine.process_start import StartedChild, start_engine_child
from rvllm.engine.process_wire import EngineInfo, OutputDecoder, Reply
from rvllm.inputs import PromptType
from rvllm.pooling_params import PoolingParams
from rvllm.sampling_params import SamplingParams
from rvllm.tokenizer import Tokenizer, load_tokenizer

__all__ = ["ProcessEngine"]

logger = logging.getLogger("rvllm")

_live: weakref.WeakSet[ProcessEngine] = weakref.WeakSet()


@atexit.register
def _shutdown_live() -> None:
    # Children are not daemons (they may start tensor-parallel workers), so stop them
    # before multiprocessing's own exit hook would wait on them forever.
    for engine in list(_live):
        engine.shutdown(timeout=5.0)


class ProcessEngine:
    """An LLMEngine in a child process, driven like an AsyncEngine.

    ``from_engine_args`` returns once the child has loaded the model, or raises the
    child's start-up error (the same type and message). ``num_threads`` caps the
    child's torch threads (a CPU replica's share of the cores).
    """

    def __init__(self, args: EngineArgs, num_threads: int | None = None,
                 started: StartedChild | None = None) -> None:
        """Start the child (or take one ``process_start.start_engine_child`` started for
        ``args``); ``wait_ready`` finishes the start-up."""
        self.args = args
        self.num_threads = num_threads
        self.step_observers: list[StepObserver] = []
        # Called on the reader thread when the child is gone: on_death (the owner
        # restarts it) if set, else on_fatal (nothing can bring it back).
        self.on_death: Callable[[ProcessEngine, Exception], None] | None = None
        self.on_fatal: Callable[[Exception], None] | None = None
        self.info: EngineInfo | None = None  # set once the child is ready
        self._tokenizer: Tokenizer | None = None
        self._tokenizer_loaded = False
        self._tokenizer_error: Exception | None = None
        self._cond = threading.Condition()
        self._adds: list[tuple[str, PromptType, SamplingParams, float]] = []
        self._aborts: list[str] = []
        self._streams: dict[str, RequestStream] = {}
        self._stopping = False
        self._dead = False
        self._snapshot: EngineSnapshot | None = None
        self._decoder = OutputDecoder()
        if started is None:
            started = start_engine_child(args, num_threads,
                                         logging.getLogger("rvllm").getEffectiveLevel())
        self.process, self._requests, self._outputs = started
        _live.add(self)
        self._sender = threading.Thread(target=self._send_loop, name="rvllm-engine-send",
                                        daemon=True)
        self._reader = threading.Thread(target=self._read_loop, name="rvllm-engine-read",
                                        daemon=True)

    @classmethod
    def from_engine_args(cls, args: EngineArgs, num_threads: int | None = None
                         ) -> ProcessEngine:
        engine = cls(args, num_threads)
        engine.wait_ready()
        return engine

    def wait_ready(self) -> None:
        """Block until the child has loaded the model; raise its start-up error if not."""
        try:
            while not self._outputs.poll(0.1):
                if not self.process.is_alive():
                    raise RuntimeError(f"the engine process exited during start-up "
                                       f"({_exit_reason(self.process.exitcode)}).")
            kind, payload = self._outputs.recv()
        except (EOFError, OSError) as e:
            self._discard()
            raise RuntimeError(f"the engine process died during start-up "
                               f"({_exit_reason(self.process.exitcode)}).") from e
        except BaseException:
            self._discard()
            raise
        if kind == "error":
            self._discard()
            raise payload
        self.info, self._snapshot = payload
        try:
            self.load_tokenizer()
            if self._tokenizer_error is not None:
                raise self._tokenizer_error
        except BaseException:
            self._discard()
            raise
        self._sender.start()
        self._reader.start()

    def load_tokenizer(self) -> None:
        """Load the server's own tokenizer (prompts, chat templates; the child has its own).
        It needs no torch, so a caller may load it while the child is still loading the
        model. An error is kept for ``wait_ready`` to raise once the child has answered: a
        child's start-up error (a model path that does not exist, say) names the cause
        better, and comes first."""
        if self._tokenizer_loaded:
            return
        self._tokenizer_loaded = True
        if self.args.skip_tokenizer_init:
            return
        from rvllm.models.default_model import resolve_gguf_path

        try:
            model = self.args.resolve_model()
            gguf = resolve_gguf_path(model)
            self._tokenizer = load_tokenizer(model, None if gguf is None else str(gguf),
                                             self.args.tokenizer, self.args.chat_template)
        except Exception as e:
            self._tokenizer_error = e

    # ------------------------------------------------------------ for callers

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer  # type: ignore[return-value]

    @property
    def max_model_len(self) -> int:
        return self._info.max_model_len

    @property
    def vocab_size(self) -> int:
        return self._info.vocab_size

    @property
    def model_path(self) -> str:
        return self._info.path

    @property
    def runner_type(self) -> str:
        """What the model runs as: "generate" or "pooling" (embeddings)."""
        return self._info.settings.get("runner", "generate")

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The token ids that end a sequence (unless a request ignores EOS)."""
        return self._info.eos_token_ids

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def is_running(self) -> bool:
        return not (self._dead or self._stopping) and self.process.is_alive()

    async def add_request(self, request_id: str, prompt: PromptType,
                          params: SamplingParams | PoolingParams,
                          final_only: bool = False) -> RequestStream:
        """Queue a request and wait until the child has taken it (AsyncEngine's contract)."""
        stream = RequestStream(request_id, asyncio.get_running_loop(), final_only)
        with self._cond:
            if self._dead or self._stopping:
                raise EngineDeadError("the engine process is not running.")
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use.")
            self._streams[request_id] = stream
            self._adds.append((request_id, prompt, params, time.time()))
            self._cond.notify()
        try:
            await stream.accepted
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        return stream

    generate = AsyncEngine.generate

    def abort(self, request_id: str) -> None:
        """Stop a request; its stream ends once the child has dropped it."""
        with self._cond:
            if self._dead or self._stopping:
                return  # its stream has been ended already
            self._aborts.append(request_id)
            self._cond.notify()

    def snapshot(self) -> EngineSnapshot:
        with self._cond:
            snap = self._snapshot
            pending = len(self._adds)
            gone = self._dead or self._stopping
        if snap is None:
            return EngineSnapshot(0, pending, 0.0, 0, 0, 0, 0, 0, 0, 0)
        if gone:  # the counters stand; no request, no KV cache any more
            return EngineSnapshot(0, 0, 0.0, 0, 0, snap.prompt_tokens, snap.generation_tokens,
                                  snap.prefix_cache_queries, snap.prefix_cache_hits,
                                  snap.num_preemptions)
        return dataclasses.replace(snap, num_requests_waiting=snap.num_requests_waiting + pending)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the child and end every open stream."""
        with self._cond:
            already = self._stopping
            self._stopping = True
            self._cond.notify()
        _live.discard(self)
        # The streams end first: stopping the child (and any tensor-parallel workers it
        # holds) can take longer than the server's grace has left.
        self._fail_all(EngineDeadError("the server is shutting down."))
        if self._sender.is_alive() and self._sender is not threading.current_thread():
            self._sender.join(min(timeout, 5.0))
        if not already:
            self._requests.close()  # the child sees EOF and exits
        if self.info is None:
            self.process.kill()  # still starting: it holds no request, do not wait for it
        self.process.join(timeout)
        if self.process.is_alive():
            logger.error("the engine process did not stop within %.0fs; killing it", timeout)
            self.process.kill()
            self.process.join(5.0)
        if self._reader.is_alive() and self._reader is not threading.current_thread():
            self._reader.join(timeout)
        if not self._reader.is_alive():
            self._outputs.close()
        self._fail_all(EngineDeadError("the server is shutting down."))

    # ------------------------------------------------------------ threads

    @property
    def _info(self) -> EngineInfo:
        assert self.info is not None, "wait_ready() first"
        return self.info

    def _send_loop(self) -> None:
        while True:
            with self._cond:
                while not (self._adds or self._aborts or self._stopping):
                    self._cond.wait()
                adds, self._adds = self._adds, []
                aborts, self._aborts = self._aborts, []
                stopping = self._stopping
            try:
                if adds or aborts:
                    self._send(("requests", adds, aborts))
                if stopping:
                    return
            except OSError:
                return  # the child is gone; the reader reports it

    def _send(self, message: tuple[Any, ...]) -> None:
        try:
            data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # an unpicklable prompt: refuse those requests, not the rest
            self._fail_ids([a[0] for a in message[1]],
                           ValueError(f"the request could not be sent to the engine: {e}"))
            data = pickle.dumps(("requests", [], message[2]))
        self._requests.send_bytes(data)

    def _read_loop(self) -> None:
        error = "the pipe closed"
        while True:
            try:
                kind, payload = self._outputs.recv()
            except (EOFError, OSError):
                break
            if kind == "reply":
                self._handle(payload)
            elif kind == "fatal":
                error = payload
        self._on_child_exit(error)

    def _handle(self, reply: Reply) -> None:
        out = _Outbox()
        outputs = [self._decoder.decode(w) for w in reply.outputs]
        with self._cond:
            self._snapshot = reply.snapshot
            for request_id in reply.accepted:
                if (stream := self._streams.get(request_id)) is not None:
                    out.add(stream, _ACCEPTED)
            for request_id, error in reply.rejected:
                if (stream := self._streams.pop(request_id, None)) is not None:
                    out.add(stream, error)
            for request_id in reply.ended:
                if (stream := self._streams.pop(request_id, None)) is not None:
                    out.add(stream, _END)
            for o in outputs:
                stream = self._streams.get(o.request_id)
                if stream is None:
                    continue
                if o.finished:
                    del self._streams[o.request_id]
                elif stream.final_only:
                    continue
                out.add(stream, o)
            for request_id in reply.failed:
                if (stream := self._streams.pop(request_id, None)) is not None:
                    out.add(stream, EngineDeadError(reply.failure or "the engine failed."))
        out.flush()
        for request_id in reply.aborted + reply.failed:
            self._decoder.forget(request_id)
        if outputs or reply.aborted or reply.failed:
            self._notify(outputs, reply.aborted + reply.failed)

    def _on_child_exit(self, error: str) -> None:
        with self._cond:
            stopping = self._stopping
            self._dead = True
        if stopping:
            self._fail_all(EngineDeadError("the server is shutting down."))
            return
        self.process.join(2.0)
        dead = EngineDeadError(f"the engine process (pid {self.process.pid}) died "
                               f"({error}; {_exit_reason(self.process.exitcode)}); "
                               "its requests were not finished.")
        logger.error("%s", dead)
        failed = self._fail_all(dead)
        if failed:
            self._notify([], failed)
        if self.on_death is not None:
            self.on_death(self, dead)
        elif self.on_fatal is not None:
            self.on_fatal(dead)

    def _fail_all(self, error: Exception) -> list[str]:
        with self._cond:
            streams, self._streams = self._streams, {}
            self._adds = []
        out = _Outbox()
        for stream in streams.values():
            out.add(stream, error)
        out.flush()
        return list(streams)

    def _fail_ids(self, request_ids: list[str], error: Exception) -> None:
        out = _Outbox()
        with self._cond:
            for request_id in request_ids:
                if (stream := self._streams.pop(request_id, None)) is not None:
                    out.add(stream, error)
        out.flush()

    def _notify(self, outputs: list[Any], aborted: list[str]) -> None:
        for observe in self.step_observers:
            try:
                observe(outputs, aborted)
            except Exception:
                logger.exception("step observer failed")

    def _discard(self) -> None:
        """A child that never became ready: make sure it is gone."""
        _live.discard(self)
        self._stopping = True
        self._requests.close()
        self.process.join(5.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5.0)
        self._outputs.close()


def _exit_reason(exitcode: int | None) -> str:
    if exitcode is None:
        return "still exiting"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"
