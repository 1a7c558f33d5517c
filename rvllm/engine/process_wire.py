"""A ProcessEngine's child: its entry point and loop, and what it says to the parent.

Outputs carry cumulative prompt, text, token ids and logprobs; sending them whole
every step would cost O(length) per request per step. So each output goes over
the pipe as a delta (the prompt once, then what is new since the last output of
that request) and the parent's OutputDecoder makes it whole again.
"""

from __future__ import annotations

import logging
import pickle
import signal
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from rvllm.config import EngineArgs, resolve_device
from rvllm.engine.async_engine import EngineSnapshot, snapshot_of
from rvllm.outputs import CompletionOutput, PromptLogprobs, RequestMetrics, RequestOutput
from rvllm.startup import pause_collector, resume_collector

if TYPE_CHECKING:  # torch loads with it: only the engine process imports it
    from rvllm.engine.llm_engine import LLMEngine

logger = logging.getLogger("rvllm")


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the parent learns of the child's model when it is ready. No torch objects (a
    ModelConfig holds a torch dtype): the server's front process never imports torch."""

    path: str
    max_model_len: int
    vocab_size: int
    # ``LLMEngine.settings()``: what the engine resolved (dtype, kernels, ...), as strings.
    settings: dict[str, Any] = field(default_factory=dict)
    eos_token_ids: frozenset[int] = frozenset()


@dataclass(slots=True)
class WireCompletion:
    """One CompletionOutput, each cumulative field as (start, what follows it)."""

    index: int
    text_start: int
    text: str
    token_ids_start: int
    token_ids: list[int]
    logprobs_start: int
    logprobs: list[Any] | None
    cumulative_logprob: float | None
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass(slots=True)
class WireOutput:
    request_id: str
    prompt: tuple[str | None, list[int]] | None  # on a request's first output only
    prompt_logprobs_start: int
    prompt_logprobs: PromptLogprobs | None
    completions: list[WireCompletion]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int
    new_token_counts: list[int]
    pooled: list[float] | None = None  # a pooling request's vector, sent once, at its end


@dataclass(slots=True)
class Reply:
    """The child's answer to one batch of requests, or the result of one step."""

    accepted: list[str] = field(default_factory=list)
    rejected: list[tuple[str, ValueError]] = field(default_factory=list)
    ended: list[str] = field(default_factory=list)  # aborts handled: end these streams
    aborted: list[str] = field(default_factory=list)  # ... of which these were live
    outputs: list[WireOutput] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)  # failed by a step that raised
    failure: str | None = None
    snapshot: EngineSnapshot | None = None


def _start(seq: Any, sent: int) -> int:
    """Where the new part begins: after what was sent, unless the field shrank."""
    return sent if seq is not None and len(seq) >= sent else 0


def _tail(seq: Any, start: int) -> Any:
    return None if seq is None else seq[start:]


def _join(prev: Any, start: int, tail: Any) -> Any:
    if tail is None:
        return None
    head = prev[:start] if prev is not None else tail[:0]
    assert len(head) == start, "an output delta does not follow the previous output"
    return head + tail


class OutputEncoder:
    """Child side: remembers how much of each live request has been sent."""

    def __init__(self) -> None:
        self._sent: dict[str, list[int]] = {}

    def encode(self, o: RequestOutput) -> WireOutput:
        sent = self._sent.get(o.request_id)
        first = sent is None
        if sent is None:
            sent = [0] * (1 + 3 * len(o.outputs))
        plp_start = _start(o.prompt_logprobs, sent[0])
        lengths = [len(o.prompt_logprobs or ())]
        completions = []
        for i, c in enumerate(o.outputs):
            text0 = _start(c.text, sent[1 + 3 * i])
            ids0 = _start(c.token_ids, sent[2 + 3 * i])
            lp0 = _start(c.logprobs, sent[3 + 3 * i])
            completions.append(WireCompletion(
                c.index, text0, c.text[text0:], ids0, c.token_ids[ids0:], lp0,
                _tail(c.logprobs, lp0), c.cumulative_logprob, c.finish_reason, c.stop_reason))
            lengths += [len(c.text), len(c.token_ids), len(c.logprobs or ())]
        if o.finished:
            self._sent.pop(o.request_id, None)
        else:
            self._sent[o.request_id] = lengths
        return WireOutput(
            o.request_id, (o.prompt, o.prompt_token_ids) if first else None, plp_start,
            _tail(o.prompt_logprobs, plp_start), completions, o.finished, o.metrics,
            o.num_cached_tokens, o.new_token_counts, o.pooled)

    def forget(self, request_id: str) -> None:
        self._sent.pop(request_id, None)


class OutputDecoder:
    """Parent side: the last whole output of each live request, to add deltas to."""

    def __init__(self) -> None:
        self._last: dict[str, RequestOutput] = {}

    def decode(self, w: WireOutput) -> RequestOutput:
        prev = self._last.get(w.request_id)
        if w.prompt is not None:
            prompt, prompt_token_ids = w.prompt
        else:
            assert prev is not None, f"no first output for {w.request_id}"
            prompt, prompt_token_ids = prev.prompt, prev.prompt_token_ids
        completions = []
        for i, c in enumerate(w.completions):
            p = prev.outputs[i] if prev is not None else None
            completions.append(CompletionOutput(
                c.index, _join(p and p.text, c.text_start, c.text),
                _join(p and p.token_ids, c.token_ids_start, c.token_ids),
                c.cumulative_logprob, _join(p and p.logprobs, c.logprobs_start, c.logprobs),
                c.finish_reason, c.stop_reason))
        out = RequestOutput(
            request_id=w.request_id, prompt=prompt, prompt_token_ids=prompt_token_ids,
            prompt_logprobs=_join(prev and prev.prompt_logprobs, w.prompt_logprobs_start,
                                  w.prompt_logprobs),
            outputs=completions, finished=w.finished, metrics=w.metrics,
            num_cached_tokens=w.num_cached_tokens, new_token_counts=w.new_token_counts,
            pooled=w.pooled)
        if w.finished:
            self._last.pop(w.request_id, None)
        else:
            self._last[w.request_id] = out
        return out

    def forget(self, request_id: str) -> None:
        self._last.pop(request_id, None)


def serve(engine: LLMEngine, requests: Connection, outputs: Connection) -> None:
    """The child's loop: take what came in, step, answer. Returns when the parent hangs
    up (EOFError) or after a fatal step error."""
    encoder = OutputEncoder()
    while True:
        if not engine.has_unfinished_requests() and engine.has_idle_work:
            if not requests.poll(engine.idle_work_due_in()):
                engine.idle_work()  # nothing to step: a slice of deferred start-up work
                continue
        messages = [] if engine.has_unfinished_requests() else [requests.recv()]
        while requests.poll():
            messages.append(requests.recv())
        if messages:
            reply = _take(engine, encoder, messages)
            reply.snapshot = snapshot_of(engine)
            outputs.send(("reply", reply))  # accept before the step, as AsyncEngine does
        if not engine.has_unfinished_requests():
            continue
        reply, fatal = _step(engine, encoder)
        reply.snapshot = snapshot_of(engine)
        outputs.send(("reply", reply))
        if fatal is not None:
            outputs.send(("fatal", fatal))
            return


def _take(engine: LLMEngine, encoder: OutputEncoder, messages: list[Any]) -> Reply:
    reply = Reply()
    for _kind, adds, aborts in messages:
        for request_id, prompt, params, arrival_time in adds:
            try:
                engine.add_request(request_id, prompt, params, arrival_time)
            except ValueError as e:
                reply.rejected.append((request_id, ValueError(str(e))))
                continue
            except Exception as e:  # a bug, not bad input: still never leave the caller hanging
                logger.exception("add_request failed for %s", request_id)
                reply.rejected.append(
                    (request_id, ValueError(f"the request could not be added: {e}")))
                continue
            reply.accepted.append(request_id)
        for request_id in aborts:
            if engine.abort_request(request_id):
                reply.aborted.append(request_id)
            encoder.forget(request_id)
            reply.ended.append(request_id)
    return reply


def _step(engine: LLMEngine, encoder: OutputEncoder) -> tuple[Reply, str | None]:
    from rvllm.executor.parallel import WorkerDiedError

    reply = Reply()
    try:
        step_outputs = engine.step()
    except Exception as e:
        logger.exception("engine step failed; failing the %d requests in flight",
                         engine.num_unfinished_requests())
        reply.failed = list(engine.requests)
        reply.failure = f"the engine failed a step: {e}"
        for request_id in reply.failed:
            try:
                engine.abort_request(request_id)
            except Exception:
                logger.exception("abort of %s failed", request_id)
            encoder.forget(request_id)
        # A lost tensor-parallel worker cannot come back: this process is done.
        return reply, (reply.failure if isinstance(e, WorkerDiedError) else None)
    reply.outputs = [encoder.encode(o) for o in step_outputs]
    return reply, None


def child_main(args: EngineArgs, requests: Connection, outputs: Connection,
               num_threads: int | None, log_level: int) -> None:
    """Entry point of the engine process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    pause_collector()  # until the engine is up, as in the CLI's commands: rvllm.startup
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")
    import torch

    from rvllm.engine.llm_engine import LLMEngine

    if num_threads:
        torch.set_num_threads(num_threads)
    try:
        device = resolve_device(args.device)
        if device.type == "cuda" and device.index is not None:
            torch.cuda.set_device(device)
        engine = LLMEngine(args)
    except BaseException as e:
        logger.debug("engine start-up failed", exc_info=True)
        try:
            outputs.send(("error", _portable(e)))
        except OSError:
            pass  # the parent is gone
        return
    try:
        resume_collector()
        config = engine.model_config
        info = EngineInfo(config.path, config.max_model_len, config.vocab_size,
                          engine.settings(), engine.eos_token_ids)
        outputs.send(("ready", (info, snapshot_of(engine))))
        serve(engine, requests, outputs)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the parent is gone or has hung up: nobody to serve
    finally:
        engine.shutdown()


def _portable(error: BaseException) -> BaseException:
    """The error itself if it survives a pickle round trip, else a RuntimeError naming it."""
    try:
        pickle.loads(pickle.dumps(error))
        return error.with_traceback(None)
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
