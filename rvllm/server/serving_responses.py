"""POST /v1/responses: OpenAI's Responses API for text, whole or streamed.

The request's ``instructions`` and ``input`` become a conversation rendered with the chat
template, as /v1/chat/completions renders ``messages``; the answer is one assistant
message item holding one ``output_text`` part. Streamed, the events are the Responses
API's: ``response.created``, ``response.in_progress``, the output item and its content
part added, ``response.output_text.delta`` per piece of text, their ``.done`` events, and
``response.completed`` (or ``response.incomplete`` when ``max_output_tokens`` cut it).
Responses are not stored, so ``previous_response_id`` is refused, as are tools and
background runs.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from rvllm.engine.async_engine import EngineDeadError, RequestStream
from rvllm.outputs import RequestOutput
from rvllm.server.errors import APIError, bad_request
from rvllm.server.protocol_responses import ResponsesRequest
from rvllm.server.serving import PARAM_FIELDS, ServingBase, merge_streams
from rvllm.server.serving_chat import render_chat_prompt

# Fields whose messages name them, beside the sampling ones.
_FIELDS = PARAM_FIELDS | {"max_output_tokens", "text", "input", "instructions"}


class ResponsesServing(ServingBase):
    id_prefix = "resp"

    async def create(self, body: bytes, request: Request) -> Response:
        req = ResponsesRequest.model_validate_json(body)
        lora = self.check_model(req.model)
        for name in ("tools", "previous_response_id", "background"):
            if getattr(req, name):
                raise APIError(f"{name} is not supported by rvllm's /v1/responses yet.",
                               param=name)
        if isinstance(req.input, list) and not req.input:
            raise APIError("input must not be empty.", param="input")
        prompt_ids = render_chat_prompt(self.engine.tokenizer, req.messages(), True, False,
                                        None, None, None, self.engine.max_model_len)
        try:
            params = req.sampling_params(self.default_sampling)
        except ValueError as e:
            err = bad_request(e, _FIELDS)
            if err.param == "max_tokens":
                err.param = "max_output_tokens"  # the name the client used
            raise err from e
        params.lora_request = lora
        response_id = self.new_id()
        streams = await self.add_requests(response_id, [prompt_ids], params,
                                          final_only=not req.stream, constraint_field="text")
        shell = _Shell(req, response_id, self.response_model(req.model))
        if req.stream:
            return self.sse_response(self._stream(shell, streams[0]), streams)
        try:
            (final,) = await self.collect(streams, request)
        finally:
            self.abort_unfinished(streams)
        completion = final.outputs[0]
        return JSONResponse(shell.response(
            _status(completion.finish_reason), completion.text,
            self._usage(final)))

    def _usage(self, out: RequestOutput) -> dict[str, Any]:
        prompt, generated = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
        return {"input_tokens": prompt, "output_tokens": generated,
                "total_tokens": prompt + generated,
                "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
                "output_tokens_details": {"reasoning_tokens": 0}}

    async def _stream(self, shell: _Shell, stream: RequestStream) -> AsyncIterator[str]:
        events = _Events()
        yield events.send("response.created", {"response": shell.response("in_progress")})
        yield events.send("response.in_progress", {"response": shell.response("in_progress")})
        yield events.send("response.output_item.added", {
            "output_index": 0, "item": shell.message("", "in_progress")})
        yield events.send("response.content_part.added", {
            "item_id": shell.message_id, "output_index": 0, "content_index": 0,
            "part": _text_part("")})
        sent = 0
        final: RequestOutput | None = None
        try:
            async for _, out in merge_streams([stream]):
                final = out
                text = out.outputs[0].text
                if len(text) > sent:
                    yield events.send("response.output_text.delta", {
                        "item_id": shell.message_id, "output_index": 0, "content_index": 0,
                        "delta": text[sent:], "logprobs": []})
                    sent = len(text)
        except EngineDeadError as e:
            yield events.send("error", {"code": "server_error", "message": str(e),
                                        "param": None})
            return
        finally:
            self.abort_unfinished([stream])
        assert final is not None
        completion = final.outputs[0]
        status = _status(completion.finish_reason)
        yield events.send("response.output_text.done", {
            "item_id": shell.message_id, "output_index": 0, "content_index": 0,
            "text": completion.text, "logprobs": []})
        yield events.send("response.content_part.done", {
            "item_id": shell.message_id, "output_index": 0, "content_index": 0,
            "part": _text_part(completion.text)})
        yield events.send("response.output_item.done", {
            "output_index": 0, "item": shell.message(completion.text, status)})
        kind = "response.completed" if status == "completed" else "response.incomplete"
        yield events.send(kind, {"response": shell.response(status, completion.text,
                                                            self._usage(final))})


class _Shell:
    """What every form of one response shares: ids, times, the request's settings."""

    def __init__(self, req: ResponsesRequest, response_id: str, model: str) -> None:
        self.req = req
        self.response_id = response_id
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.model = model
        self.created_at = int(time.time())

    def message(self, text: str, status: str) -> dict[str, Any]:
        return {"type": "message", "id": self.message_id, "role": "assistant",
                "status": status, "content": [_text_part(text)] if text or
                status != "in_progress" else []}

    def response(self, status: str, text: str | None = None,
                 usage: dict[str, Any] | None = None) -> dict[str, Any]:
        req = self.req
        fmt = req.text.format.model_dump(exclude_none=True, by_alias=True) if req.text \
            else {"type": "text"}
        return {
            "id": self.response_id, "object": "response", "created_at": self.created_at,
            "model": self.model, "status": status,
            "incomplete_details": ({"reason": "max_output_tokens"}
                                   if status == "incomplete" else None),
            "error": None, "instructions": req.instructions,
            "output": [] if text is None else [self.message(text, status)],
            "max_output_tokens": req.max_output_tokens, "temperature": req.temperature,
            "top_p": req.top_p, "parallel_tool_calls": False, "tool_choice": "auto",
            "tools": [], "text": {"format": fmt}, "metadata": req.metadata,
            "previous_response_id": None, "store": False, "truncation": "disabled",
            "user": req.user, "usage": usage,
        }


class _Events:
    """Server-Sent Events of the Responses API: ``event:`` and a numbered ``data:``."""

    def __init__(self) -> None:
        self.number = 0

    def send(self, kind: str, payload: dict[str, Any]) -> str:
        data = {"type": kind, "sequence_number": self.number, **payload}
        self.number += 1
        return (f"event: {kind}\ndata: "
                f"{json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n")


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _status(finish_reason: str | None) -> str:
    """A finished output's response status: cut by max_output_tokens is incomplete."""
    return "incomplete" if finish_reason == "length" else "completed"
