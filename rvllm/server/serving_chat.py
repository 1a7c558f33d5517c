"""POST /v1/chat/completions: messages through the model's chat template, streamed or whole."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from rvllm.engine.async_engine import EngineDeadError, RequestStream
from rvllm.outputs import Logprob, RequestOutput
from rvllm.server.errors import APIError, bad_request, error_event
from rvllm.server.protocol import ChatCompletionRequest, ChatMessage
from rvllm.server.serving import (
    DONE,
    PARAM_FIELDS,
    ServingBase,
    clamp_logprob,
    merge_streams,
    sse,
    usage,
)
from rvllm.server.serving_completion import prompt_logprobs_json
from rvllm.tokenizer import Tokenizer


class ChatServing(ServingBase):
    id_prefix = "chatcmpl"

    async def create(self, body: bytes, request: Request) -> Response:
        req = ChatCompletionRequest.model_validate_json(body)
        self.check_model(req.model)
        _check_supported(req)
        prompt_ids = render_chat_prompt(self.engine.tokenizer, req.messages,
                                        _add_generation_prompt(req),
                                        req.continue_final_message, req.tools, req.chat_template,
                                        req.chat_template_kwargs)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
            else req.max_tokens
        try:
            params = req.sampling_params(max_tokens, logprobs, req.prompt_logprobs)
        except ValueError as e:
            err = bad_request(e, PARAM_FIELDS)
            if err.param == "max_tokens" and req.max_completion_tokens is not None:
                err.param = "max_completion_tokens"  # the name the client used
            raise err from e
        request_id = self.new_id()
        streams = await self.add_requests(request_id, [prompt_ids], params,
                                          final_only=not req.stream)
        if req.stream:
            return self.sse_response(self._stream(req, request_id, streams[0]), streams)
        try:
            (final,) = await self.collect(streams, request)
        finally:
            self.abort_unfinished(streams)
        return JSONResponse(self._response(req, request_id, final))

    def _response(self, req: ChatCompletionRequest, request_id: str,
                  final: RequestOutput) -> dict[str, Any]:
        choices = []
        for c in final.outputs:
            choices.append({
                "index": c.index,
                "message": {"role": "assistant", "content": c.text, "tool_calls": []},
                "logprobs": _chat_logprobs(c.token_ids, c.logprobs, req.top_logprobs or 0)
                if req.logprobs else None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            })
        completion_tokens = sum(len(c.token_ids) for c in final.outputs)
        response = {"id": request_id, "object": "chat.completion", "created": self.created(),
                    "model": self.model_name, "choices": choices,
                    "usage": usage(len(final.prompt_token_ids), completion_tokens)}
        if req.prompt_logprobs is not None:
            response["prompt_logprobs"] = prompt_logprobs_json(final.prompt_logprobs)
        return response

    async def _stream(self, req: ChatCompletionRequest, request_id: str,
                      stream: RequestStream) -> AsyncIterator[str]:
        created = self.created()
        head = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                "model": self.model_name}
        extra: dict[str, Any] = {"usage": None} if req.include_usage else {}
        sent_text = [0] * req.n
        sent_tokens = [0] * req.n
        prompt_tokens = completion_tokens = 0
        try:
            # The role comes first, before any token, as OpenAI sends it.
            yield "".join(sse({**head, "choices": [
                {"index": i, "delta": {"role": "assistant", "content": ""},
                 "logprobs": None, "finish_reason": None}], **extra}) for i in range(req.n))
            async for _, out in merge_streams([stream]):
                prompt_tokens = len(out.prompt_token_ids)
                completion_tokens = sum(len(c.token_ids) for c in out.outputs)
                if req.continuous_usage:
                    extra["usage"] = usage(prompt_tokens, completion_tokens)
                chunks = []
                for c in out.outputs:
                    i = c.index
                    text = c.text[sent_text[i]:]
                    start, end = sent_tokens[i], len(c.token_ids)
                    # A token that ends mid-character adds no text yet: nothing to send.
                    if not (text or c.finish_reason or (req.logprobs and end > start)):
                        continue
                    sent_text[i], sent_tokens[i] = len(c.text), end
                    logprobs = _chat_logprobs(c.token_ids[start:end], (c.logprobs or [])[start:end],
                                              req.top_logprobs or 0) if req.logprobs else None
                    delta = {"content": text} if text or not c.finish_reason else {}
                    chunks.append(sse({**head, "choices": [
                        {"index": i, "delta": delta, "logprobs": logprobs,
                         "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}],
                        **extra}))
                if chunks:
                    yield "".join(chunks)
            if req.include_usage:
                yield sse({**head, "choices": [],
                           "usage": usage(prompt_tokens, completion_tokens)})
        except EngineDeadError as e:
            yield error_event(APIError(str(e), 503))
        finally:
            self.abort_unfinished([stream])
        yield DONE


def _check_supported(req: ChatCompletionRequest) -> None:
    if not req.messages:
        raise APIError("messages must not be empty.", param="messages")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError("top_logprobs requires logprobs to be true.", param="top_logprobs")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
        raise APIError(f"top_logprobs must be in [0, 20], got {req.top_logprobs}.",
                       param="top_logprobs")
    if req.tool_choice not in (None, "none", "auto"):
        raise APIError("tool_choice may be 'none' or 'auto': rvllm does not force tool calls.",
                       param="tool_choice")
    fmt = (req.response_format or {}).get("type", "text")
    if fmt != "text":
        raise APIError(f"response_format type {fmt!r} is not supported (only 'text').",
                       param="response_format")
    if req.continue_final_message:
        if req.messages[-1].role != "assistant":
            raise APIError("continue_final_message needs an assistant message last.",
                           param="continue_final_message")
        if "add_generation_prompt" in req.model_fields_set and req.add_generation_prompt:
            raise APIError("add_generation_prompt and continue_final_message cannot both be "
                           "true.", param="continue_final_message")


def _add_generation_prompt(req: ChatCompletionRequest) -> bool:
    return req.add_generation_prompt and not req.continue_final_message


def render_chat_prompt(tokenizer: Tokenizer, messages: list[ChatMessage],
                       add_generation_prompt: bool, continue_final_message: bool,
                       tools: list[dict[str, Any]] | None, chat_template: str | None,
                       template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Token ids of a conversation rendered with the chat template (``template_kwargs``
    become template variables). The template holds the special tokens itself, so none
    are added on encoding."""
    conversation = [_template_message(m) for m in messages]
    try:
        text = tokenizer.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, tools=tools,
            chat_template=chat_template, **(template_kwargs or {}),
        )
    except Exception as e:  # a template may raise on purpose (roles out of order, ...)
        raise APIError(f"The chat template could not render these messages: {e}",
                       param="messages") from e
    return tokenizer.encode(text, add_special_tokens=False)


def _template_message(m: ChatMessage) -> dict[str, Any]:
    message = m.model_dump(exclude_none=True)
    if isinstance(m.content, list):
        texts = []
        for part in m.content:
            if part.type != "text" or part.text is None:
                raise APIError(f"Content parts of type {part.type!r} are not supported "
                               "(only 'text').", param="messages")
            texts.append(part.text)
        message["content"] = "\n".join(texts)
    elif m.content is None:
        message["content"] = ""
    for call in message.get("tool_calls") or []:
        # Templates index into the arguments, which OpenAI sends as a JSON string.
        fn = call.get("function")
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = json.loads(fn["arguments"])
            except json.JSONDecodeError:
                pass
    return message


def _chat_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]] | None,
                   k: int) -> dict[str, Any]:
    content = []
    for token_id, entry in zip(token_ids, entries or []):
        chosen = entry[token_id]
        top = sorted((lp for lp in entry.values() if lp.rank is not None and lp.rank <= k),
                     key=lambda lp: lp.rank or 0)
        content.append({**_token_logprob(chosen),
                        "top_logprobs": [_token_logprob(lp) for lp in top]})
    return {"content": content}


def _token_logprob(lp: Logprob) -> dict[str, Any]:
    token = lp.decoded_token or ""
    return {"token": token, "logprob": clamp_logprob(lp.logprob),
            "bytes": list(token.encode("utf-8"))}
