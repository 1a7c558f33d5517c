"""What the completion and chat endpoints share: model check, queuing a batch of
requests, waiting for them while watching the client, and Server-Sent Events."""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from rvllm.beam_search import (
    BeamSearch,
    BeamSearchParams,
    advance_all,
    as_request_output,
    pending_beams,
)
from rvllm.engine.async_engine import AsyncEngine, EngineDeadError, PromptType, RequestStream
from rvllm.lora.request import LoRARequest
from rvllm.outputs import RequestOutput
from rvllm.sampling_params import SamplingParams
from rvllm.server.errors import APIError, bad_request
from rvllm.server.protocol import BEAM_SEARCH_REFUSES

DONE = "data: [DONE]\n\n"
# What SamplingParams and the engine name at the start of their messages.
PARAM_FIELDS = frozenset({
    "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p",
    "top_k", "min_p", "seed", "stop", "stop_token_ids", "max_tokens", "min_tokens", "logprobs",
    "prompt_logprobs", "logit_bias", "allowed_token_ids", "truncate_prompt_tokens", "priority",
    "prompt", "dimensions", "normalize", "use_beam_search", "length_penalty",
    "response_format", "structured_outputs",
    "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "guided_whitespace_pattern",
})

# What beam search's refusals start with: PARAM_FIELDS and the fields it does not take.
BEAM_SEARCH_FIELDS = PARAM_FIELDS | BEAM_SEARCH_REFUSES | {"stream"}


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def clamp_logprob(value: float) -> float:
    """JSON has no -inf: a token ruled out (logit_bias, top-k) reads as -9999, as in vLLM."""
    return -9999.0 if math.isnan(value) or value < -9999.0 else value


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class ServingBase:
    """One endpoint's view of the engine."""

    id_prefix = "cmpl"
    # ``--max-waiting-requests``: past this many waiting, a request gets 503 (0: no limit).
    max_waiting_requests = 0
    # ``--enable-prompt-tokens-details``: usage counts the prompt tokens the prefix cache had.
    prompt_tokens_details = False
    # ``--return-tokens-as-token-ids``: logprobs name tokens "token_id:<id>" by default.
    tokens_as_ids = False
    RETRY_AFTER_S = 1

    # --lora-modules by name: a request whose model names one runs with that adapter.
    lora_modules: dict[str, LoRARequest] = {}  # noqa: RUF012 - replaced, never changed

    def __init__(self, engine: AsyncEngine, model_names: str | Sequence[str],
                 default_sampling: dict[str, Any] | None = None) -> None:
        self.engine = engine
        # Requests may name any of them; responses carry the first.
        self.model_names = [model_names] if isinstance(model_names, str) else list(model_names)
        self.model_name = self.model_names[0]
        # The model's generation config: what a request's unset sampling fields become.
        self.default_sampling = default_sampling or {}

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int
              ) -> dict[str, Any]:
        """A response's ``usage``; with ``prompt_tokens_details``, how many of the prompt
        tokens came from the prefix cache (``prompt_tokens_details.cached_tokens``)."""
        out: dict[str, Any] = usage(prompt_tokens, completion_tokens)
        if self.prompt_tokens_details:
            out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
        return out

    def token_name(self, token_id: int, decoded: str | None, as_ids: bool) -> str:
        """How logprobs name a token: its text, or with ``as_ids`` "token_id:<id>"."""
        if as_ids:
            return f"token_id:{token_id}"
        if decoded is None:
            return self.engine.tokenizer.decode([token_id], skip_special_tokens=False)
        return decoded

    def check_model(self, model: str | None) -> LoRARequest | None:
        """404 unless ``model`` is unset or a name served; the LoRA adapter it names, if
        it names one."""
        if model is not None and model in self.lora_modules:
            return self.lora_modules[model]
        if model is not None and model not in self.model_names:
            raise APIError(f"The model `{model}` does not exist.", 404, "model",
                           "model_not_found")
        return None

    def response_model(self, model: str | None) -> str:
        """The model a response names: the LoRA adapter asked for, else the first name."""
        return model if model is not None and model in self.lora_modules else self.model_name

    def new_id(self, prefix: str | None = None) -> str:
        return f"{prefix or self.id_prefix}-{uuid.uuid4().hex}"

    @staticmethod
    def created() -> int:
        return int(time.time())

    async def add_requests(self, request_id: str, prompts: Sequence[PromptType],
                           params: SamplingParams, final_only: bool,
                           constraint_field: str = "structured_outputs"
                           ) -> list[RequestStream]:
        """Queue every prompt at once (one engine drain, not one per prompt); if any is
        refused, withdraw the others and answer 400 (a constraint's error names
        ``constraint_field``, the field the client sent it in). With more than
        ``max_waiting_requests`` waiting already, nothing is queued: 503 and Retry-After."""
        limit = self.max_waiting_requests
        if limit and self.engine.snapshot().num_requests_waiting + len(prompts) > limit:
            raise APIError(f"The server is overloaded: more than {limit} requests are "
                           "waiting (--max-waiting-requests). Retry later.", 503,
                           code="server_overloaded",
                           headers={"Retry-After": str(self.RETRY_AFTER_S)})
        ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        results = await asyncio.gather(
            *(self.engine.add_request(rid, p, params, final_only) for rid, p in zip(ids, prompts)),
            return_exceptions=True,
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if not errors:
            return list(results)  # type: ignore[arg-type]
        for rid, r in zip(ids, results):
            if not isinstance(r, BaseException):
                self.engine.abort(rid)
        err = errors[0]
        if isinstance(err, ValueError):
            api_error = bad_request(err, PARAM_FIELDS)
            if api_error.param == "structured_outputs":
                api_error.param = constraint_field
            raise api_error
        if isinstance(err, EngineDeadError):
            raise APIError(str(err), 503)
        raise err

    async def beam_search(self, request_id: str, prompts: Sequence[str | list[int]],
                          params: BeamSearchParams, request: Request,
                          lora_request: LoRARequest | None = None) -> list[RequestOutput]:
        """Beam search over each prompt (``rvllm.beam_search``), every live beam of every
        prompt one request of each step; a finished output per prompt, its beams the
        completions, best first. A client that hangs up aborts the step's requests."""
        engine = self.engine
        searches = []
        try:
            for prompt in prompts:
                ids = prompt if isinstance(prompt, list) else self.encode_text(prompt)
                searches.append(BeamSearch(ids, params, engine.eos_token_ids,
                                           engine.max_model_len, lora_request))
        except ValueError as e:
            raise bad_request(e, PARAM_FIELDS) from e
        arrival = time.time()
        step = 0
        while pending := pending_beams(searches):
            streams = await self.add_requests(
                f"{request_id}-step{step}", [beam.tokens for _, beam in pending],
                pending[0][0].step_params(), final_only=True)
            try:
                advance_all(pending, await self.collect(streams, request))
            finally:
                self.abort_unfinished(streams)
            step += 1
        return [as_request_output(f"{request_id}-{i}", p if isinstance(p, str) else None,
                                  s.prompt_ids, s.results(engine.tokenizer), arrival)
                for i, (p, s) in enumerate(zip(prompts, searches))]

    def encode_text(self, text: str, add_special_tokens: bool = True,
                    field: str = "prompt") -> list[int]:
        """A text's token ids, tokenized only as far as the context allows: a text
        longer than the context is a 400 naming ``field``, found before it is all
        tokenized."""
        limit = self.engine.max_model_len
        ids = self.engine.tokenizer.encode_bounded(text, limit, add_special_tokens)
        if ids is None:
            raise APIError(f"This model's maximum context length is {limit} tokens, and "
                           f"the {field} ({len(text)} characters) is longer than that.",
                           param=field, code="context_length_exceeded")
        return ids

    def sse_response(self, events: AsyncIterator[str],
                     streams: list[RequestStream]) -> StreamingResponse:
        return _SSEResponse(events, lambda: self.abort_unfinished(streams))

    def abort_unfinished(self, streams: list[RequestStream]) -> None:
        for s in streams:
            if not s.finished:
                self.engine.abort(s.request_id)

    async def collect(self, streams: list[RequestStream], request: Request
                      ) -> list[RequestOutput]:
        """The finished output of every stream; a client that hangs up aborts them."""
        gather = asyncio.ensure_future(_final_outputs(streams))
        watch = asyncio.ensure_future(wait_for_disconnect(request))
        try:
            await asyncio.wait({gather, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not gather.done():
                gather.cancel()
                self.abort_unfinished(streams)
        if gather.cancelled():
            raise APIError("The client closed the connection.", 499)
        try:
            return gather.result()
        except EngineDeadError as e:
            raise APIError(str(e), 503) from e


class _SSEResponse(StreamingResponse):
    """An event stream that aborts its requests however the response ends: a client
    gone before the first event never starts the generator, so its own cleanup
    would not run."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream")
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


async def _final_outputs(streams: list[RequestStream]) -> list[RequestOutput]:
    finals: list[RequestOutput | None] = [None] * len(streams)
    async for i, out in merge_streams(streams):
        if out.finished:
            finals[i] = out
    if any(f is None for f in finals):
        raise EngineDeadError("the request was aborted.")
    return finals  # type: ignore[return-value]


async def merge_streams(streams: list[RequestStream]
                        ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(index, output) from several streams as each becomes ready."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                try:
                    out = task.result()
                except StopAsyncIteration:
                    continue
                yield i, out
                pending[asyncio.ensure_future(anext(streams[i]))] = i
    finally:
        for task in pending:
            task.cancel()


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client hangs up (the body has been read by then)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
