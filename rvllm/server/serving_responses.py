"""POST /v1/responses: OpenAI's Responses API for text, whole or streamed.

The request's ``instructions`` and ``input`` become a conversation rendered with the chat
template, as /v1/chat/completions renders ``messages``; the answer is one assistant
message item holding one ``output_text`` part, after a ``reasoning`` item with the
``<think>`` block's text where the server has a reasoning parser. Streamed, the events
are the Responses API's: ``response.created``, ``response.in_progress``, each output item
(and the message's content part) added, ``response.reasoning_text.delta`` and
``response.output_text.delta`` per piece of text, their ``.done`` events, and
``response.completed`` (or ``response.incomplete`` when ``max_output_tokens`` cut it).
A request with function tools (not streamed) goes through the chat endpoint, which
reads the calls out of the model's text, and each call comes back as a ``function_call``
item; ``function_call`` and ``function_call_output`` items in ``input`` render as the
assistant's tool calls and tool messages. Responses are not stored, so
``previous_response_id`` is refused, as are background runs.
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
from rvllm.server.protocol import ChatCompletionRequest
from rvllm.server.protocol_responses import ResponsesRequest
from rvllm.server.reasoning_parsers import get_reasoning_parser
from rvllm.server.serving import PARAM_FIELDS, ServingBase, merge_streams
from rvllm.server.serving_chat import (
    ChatServing,
    Thinking,
    render_chat_prompt,
    split_delta,
    thinking,
)

# Fields whose messages name them, beside the sampling ones.
_FIELDS = PARAM_FIELDS | {"max_output_tokens", "text", "input", "instructions"}


class ResponsesServing(ServingBase):
    id_prefix = "resp"

    def __init__(self, engine: Any, model_names: str | list[str],
                 default_sampling: dict[str, Any] | None = None,
                 reasoning_parser: str | None = None,
                 chat: ChatServing | None = None) -> None:
        super().__init__(engine, model_names, default_sampling)
        self.reasoning_parser = (get_reasoning_parser(reasoning_parser)
                                 if reasoning_parser else None)
        # Requests with tools go through the chat endpoint, which reads calls out of text.
        self.chat = chat

    async def create(self, body: bytes, request: Request) -> Response:
        req = ResponsesRequest.model_validate_json(body)
        lora = self.check_model(req.model)
        for name in ("previous_response_id", "background"):
            if getattr(req, name):
                raise APIError(f"{name} is not supported by rvllm's /v1/responses yet.",
                               param=name)
        if isinstance(req.input, list) and not req.input:
            raise APIError("input must not be empty.", param="input")
        if req.tools:
            return await self._with_tools(req, request)
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
        split = thinking(self.reasoning_parser, self.engine.tokenizer, prompt_ids, params)
        response_id = self.new_id()
        streams = await self.add_requests(response_id, [prompt_ids], params,
                                          final_only=not req.stream, constraint_field="text")
        shell = _Shell(req, response_id, self.response_model(req.model))
        if req.stream:
            return self.sse_response(self._stream(shell, split, streams[0]), streams)
        try:
            (final,) = await self.collect(streams, request)
        finally:
            self.abort_unfinished(streams)
        completion = final.outputs[0]
        reasoning, content = (None, completion.text) if split is None else \
            split.parser.extract(completion.text, split.prompt_tail)
        status = _status(completion.finish_reason)
        items = [shell.reasoning(reasoning, status)] if reasoning else []
        items.append(shell.message(content or "", status))
        return JSONResponse(shell.response(status, items, _usage_of(final)))

    async def _with_tools(self, req: ResponsesRequest, request: Request) -> Response:
        """A request with tools, answered by the chat endpoint and told as Responses
        items: reasoning, the message's text, and a ``function_call`` item per call."""
        if req.stream:
            raise APIError("stream with tools is not supported by rvllm's /v1/responses "
                           "yet.", param="stream")
        assert self.chat is not None
        answer = await self.chat.respond(
            ChatCompletionRequest.model_validate(req.chat_request()), request)
        body = json.loads(bytes(answer.body))
        choice = body["choices"][0]
        message = choice["message"]
        status = _status(choice["finish_reason"])
        shell = _Shell(req, self.new_id(), body["model"])
        items = [shell.reasoning(message["reasoning"], status)] if message.get(
            "reasoning") else []
        if message.get("content") or not message.get("tool_calls"):
            items.append(shell.message(message.get("content") or "", status))
        for call in message.get("tool_calls") or []:
            items.append({"type": "function_call", "id": f"fc_{uuid.uuid4().hex}",
                          "call_id": call["id"], "name": call["function"]["name"],
                          "arguments": call["function"]["arguments"],
                          "status": "completed"})
        usage = body["usage"]
        return JSONResponse(shell.response(status, items, _usage(
            usage["prompt_tokens"], usage["completion_tokens"], 0)))

    async def _stream(self, shell: _Shell, split: Thinking | None, stream: RequestStream
                      ) -> AsyncIterator[str]:
        events = _Events()
        yield events.send("response.created", {"response": shell.response("in_progress")})
        yield events.send("response.in_progress", {"response": shell.response("in_progress")})
        reasoning_stream = None if split is None else split.parser.start_stream(
            split.prompt_tail)
        items = _ItemStreams(shell, events)
        final: RequestOutput | None = None
        sent = 0
        try:
            async for _, out in merge_streams([stream]):
                final = out
                completion = out.outputs[0]
                text, sent = completion.text[sent:], len(completion.text)
                done = completion.finish_reason is not None
                reasoning = ""
                if reasoning_stream is not None:
                    reasoning, text = split_delta(reasoning_stream, text, done)
                for event in items.feed(reasoning, text):
                    yield event
        except EngineDeadError as e:
            yield events.send("error", {"code": "server_error", "message": str(e),
                                        "param": None})
            return
        finally:
            self.abort_unfinished([stream])
        assert final is not None
        status = _status(final.outputs[0].finish_reason)
        for event in items.close(status):
            yield event
        kind = "response.completed" if status == "completed" else "response.incomplete"
        yield events.send(kind, {"response": shell.response(status, items.done,
                                                            _usage_of(final))})


class _ItemStreams:
    """A streamed response's output items as their events: a reasoning item while the
    model thinks (with a reasoning parser), then the message; each opened on its first
    text, the message at the end if it never got any."""

    def __init__(self, shell: _Shell, events: _Events) -> None:
        self.shell = shell
        self.events = events
        self.open: str | None = None  # "reasoning" or "message"
        self.text = ""
        self.done: list[dict[str, Any]] = []

    def feed(self, reasoning: str, content: str) -> list[str]:
        out = []
        if reasoning:
            out += self._switch("reasoning")
            out.append(self._delta("response.reasoning_text.delta", reasoning))
        if content:
            out += self._switch("message")
            out.append(self._delta("response.output_text.delta", content))
        return out

    def close(self, status: str) -> list[str]:
        out = [] if self.open == "message" else self._switch("message")
        return out + self._finish(status)

    def _switch(self, kind: str) -> list[str]:
        if self.open == kind:
            return []
        out = self._finish("completed") if self.open is not None else []
        self.open, self.text = kind, ""
        index = len(self.done)
        item = (self.shell.reasoning("", "in_progress") if kind == "reasoning"
                else self.shell.message("", "in_progress"))
        out.append(self.events.send("response.output_item.added",
                                    {"output_index": index, "item": item}))
        if kind == "message":
            out.append(self.events.send("response.content_part.added", {
                **self._where(), "part": _text_part("")}))
        return out

    def _delta(self, kind: str, text: str) -> str:
        self.text += text
        return self.events.send(kind, {**self._where(), "delta": text,
                                       **({"logprobs": []} if self.open == "message"
                                          else {})})

    def _finish(self, status: str) -> list[str]:
        where = self._where()
        if self.open == "reasoning":
            item = self.shell.reasoning(self.text, status)
            out = [self.events.send("response.reasoning_text.done",
                                    {**where, "text": self.text})]
        else:
            item = self.shell.message(self.text, status)
            out = [self.events.send("response.output_text.done",
                                    {**where, "text": self.text, "logprobs": []}),
                   self.events.send("response.content_part.done",
                                    {**where, "part": _text_part(self.text)})]
        out.append(self.events.send("response.output_item.done",
                                    {"output_index": where["output_index"], "item": item}))
        self.done.append(item)
        self.open = None
        return out

    def _where(self) -> dict[str, Any]:
        item_id = (self.shell.reasoning_id if self.open == "reasoning"
                   else self.shell.message_id)
        return {"item_id": item_id, "output_index": len(self.done), "content_index": 0}


def _usage(prompt: int, generated: int, cached: int) -> dict[str, Any]:
    return {"input_tokens": prompt, "output_tokens": generated,
            "total_tokens": prompt + generated,
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens_details": {"reasoning_tokens": 0}}


def _usage_of(out: RequestOutput) -> dict[str, Any]:
    return _usage(len(out.prompt_token_ids), len(out.outputs[0].token_ids),
                  out.num_cached_tokens)


class _Shell:
    """What every form of one response shares: ids, times, the request's settings."""

    def __init__(self, req: ResponsesRequest, response_id: str, model: str) -> None:
        self.req = req
        self.response_id = response_id
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.reasoning_id = f"rs_{uuid.uuid4().hex}"
        self.model = model
        self.created_at = int(time.time())

    def message(self, text: str, status: str) -> dict[str, Any]:
        return {"type": "message", "id": self.message_id, "role": "assistant",
                "status": status, "content": [_text_part(text)] if text or
                status != "in_progress" else []}

    def reasoning(self, text: str | None, status: str) -> dict[str, Any]:
        return {"type": "reasoning", "id": self.reasoning_id, "status": status,
                "summary": [],
                "content": [{"type": "reasoning_text", "text": text}] if text else []}

    def response(self, status: str, output: list[dict[str, Any]] | None = None,
                 usage: dict[str, Any] | None = None) -> dict[str, Any]:
        req = self.req
        fmt = req.text.format.model_dump(exclude_none=True, by_alias=True) if req.text \
            else {"type": "text"}
        return {
            "id": self.response_id, "object": "response", "created_at": self.created_at,
            "model": self.model, "status": status,
            "incomplete_details": ({"reason": "max_output_tokens"}
                                   if status == "incomplete" else None),
            "error": None, "instructions": req.instructions, "output": output or [],
            "max_output_tokens": req.max_output_tokens, "temperature": req.temperature,
            "top_p": req.top_p, "parallel_tool_calls": req.parallel_tool_calls is not False,
            "tool_choice": (req.tool_choice.model_dump() if hasattr(req.tool_choice,
                                                                   "model_dump")
                            else req.tool_choice or "auto"),
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "text": {"format": fmt}, "metadata": req.metadata,
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
