"""POST /v1/chat/completions: messages through the model's chat template, streamed or whole."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from rvllm.engine.async_engine import EngineDeadError, RequestStream
from rvllm.lora.request import LoRARequest
from rvllm.outputs import Logprob, RequestOutput
from rvllm.sampling_params import SamplingParams, StructuredOutputsParams
from rvllm.server.errors import APIError, bad_request, error_event
from rvllm.server.protocol import ChatCompletionRequest, ChatMessage, NamedToolChoice
from rvllm.server.reasoning_parsers import (
    THINK_END,
    ReasoningParser,
    ReasoningStream,
    get_reasoning_parser,
)
from rvllm.server.serving import (
    BEAM_SEARCH_FIELDS,
    DONE,
    PARAM_FIELDS,
    ServingBase,
    clamp_logprob,
    merge_streams,
    sse,
)
from rvllm.server.serving_completion import prompt_logprobs_json
from rvllm.server.tool_parsers import (
    ToolCall,
    ToolParser,
    get_tool_parser,
    parse_tool_calls_json,
)
from rvllm.tokenizer import Tokenizer


class ChatServing(ServingBase):
    id_prefix = "chatcmpl"

    def __init__(self, engine: Any, model_name: str | list[str],
                 tool_call_parser: str | None = None,
                 enable_auto_tool_choice: bool = False,
                 reasoning_parser: str | None = None,
                 default_sampling: dict[str, Any] | None = None) -> None:
        super().__init__(engine, model_name, default_sampling)
        self.tool_parser = get_tool_parser(tool_call_parser) if tool_call_parser else None
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.reasoning_parser = (get_reasoning_parser(reasoning_parser)
                                 if reasoning_parser else None)

    async def create(self, body: bytes, request: Request) -> Response:
        return await self.respond(ChatCompletionRequest.model_validate_json(body), request)

    async def respond(self, req: ChatCompletionRequest, request: Request) -> Response:
        """The response to a parsed request: JSON, or an event stream."""
        lora = self.check_model(req.model)
        _check_supported(req)
        tools = _ToolUse(req, self.tool_parser if self.enable_auto_tool_choice else None)
        prompt_ids = render_chat_prompt(self.engine.tokenizer, req.messages,
                                        _add_generation_prompt(req),
                                        req.continue_final_message, tools.template_tools,
                                        req.chat_template, req.chat_template_kwargs,
                                        # A conversation to truncate is tokenized whole.
                                        None if req.truncate_prompt_tokens is not None
                                        else self.engine.max_model_len)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
            else req.max_tokens
        if req.use_beam_search:
            return await self._beam_search(req, tools, prompt_ids, max_tokens, request, lora)
        try:
            params = req.sampling_params(max_tokens, logprobs, req.prompt_logprobs,
                                         self.default_sampling)
        except ValueError as e:
            err = bad_request(e, PARAM_FIELDS)
            if err.param == "max_tokens" and req.max_completion_tokens is not None:
                err.param = "max_completion_tokens"  # the name the client used
            raise err from e
        tools.constrain(params)
        params.lora_request = lora
        thinking = self._thinking(prompt_ids, params)
        request_id = self.new_id()
        try:
            streams = await self.add_requests(request_id, [prompt_ids], params,
                                              final_only=not req.stream,
                                              constraint_field=tools.field(req))
        except APIError as e:
            if e.param == "logprobs" and req.top_logprobs is not None:
                e.param = "top_logprobs"  # the name the client used (--max-logprobs)
            raise
        if req.stream:
            return self.sse_response(
                self._stream(req, tools, thinking, request_id, streams[0]), streams)
        try:
            (final,) = await self.collect(streams, request)
        finally:
            self.abort_unfinished(streams)
        return JSONResponse(self._response(req, tools, thinking, request_id, final))

    async def _beam_search(self, req: ChatCompletionRequest, tools: _ToolUse,
                           prompt_ids: list[int], max_tokens: int | None, request: Request,
                           lora: LoRARequest | None) -> Response:
        try:
            params = req.beam_search_params(max_tokens)
        except ValueError as e:
            raise bad_request(e, BEAM_SEARCH_FIELDS) from e
        request_id = self.new_id()
        (final,) = await self.beam_search(request_id, [prompt_ids], params, request, lora)
        thinking = self._thinking(prompt_ids, SamplingParams())
        return JSONResponse(self._response(req, tools, thinking, request_id, final))

    def _thinking(self, prompt_ids: list[int], params: Any) -> Thinking | None:
        return thinking(self.reasoning_parser, self.engine.tokenizer, prompt_ids, params)

    def _response(self, req: ChatCompletionRequest, tools: _ToolUse,
                  thinking: Thinking | None, request_id: str, final: RequestOutput
                  ) -> dict[str, Any]:
        choices = []
        for c in final.outputs:
            reasoning, text = (None, c.text) if thinking is None else thinking.parser.extract(
                c.text, thinking.prompt_tail)
            content, calls = tools.extract(text) if text is not None else (None, [])
            message: dict[str, Any] = {"role": "assistant", "content": content,
                                       "tool_calls": [_tool_call_json(call) for call in calls]}
            if thinking is not None:
                message["reasoning"] = message["reasoning_content"] = reasoning
            echo = _echo(req)
            if echo:
                message["content"] = echo + (content or "")
            choices.append({
                "index": c.index,
                "message": message,
                "logprobs": _chat_logprobs(c.token_ids, c.logprobs, req.top_logprobs or 0,
                                           req.tokens_as_ids(self.tokens_as_ids))
                if req.logprobs else None,
                "finish_reason": _finish_reason(c.finish_reason, calls),
                "stop_reason": c.stop_reason,
            })
        completion_tokens = sum(len(c.token_ids) for c in final.outputs)
        response = {"id": request_id, "object": "chat.completion", "created": self.created(),
                    "model": self.response_model(req.model), "choices": choices,
                    "usage": self.usage(len(final.prompt_token_ids), completion_tokens,
                                        final.num_cached_tokens)}
        if req.prompt_logprobs is not None:
            response["prompt_logprobs"] = prompt_logprobs_json(final.prompt_logprobs)
        return response

    async def _stream(self, req: ChatCompletionRequest, tools: _ToolUse,
                      thinking: Thinking | None, request_id: str, stream: RequestStream
                      ) -> AsyncIterator[str]:
        created = self.created()
        head = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                "model": self.response_model(req.model)}
        extra: dict[str, Any] = {"usage": None} if req.include_usage else {}
        sent_text = [0] * req.n
        sent_tokens = [0] * req.n
        as_ids = req.tokens_as_ids(self.tokens_as_ids)
        tool_streams = [tools.stream() for _ in range(req.n)]
        reasoning_streams = [None if thinking is None
                             else thinking.parser.start_stream(thinking.prompt_tail)
                             for _ in range(req.n)]
        prompt_tokens = completion_tokens = cached_tokens = 0
        try:
            # The role comes first, before any token, as OpenAI sends it.
            yield "".join(sse({**head, "choices": [
                {"index": i, "delta": {"role": "assistant", "content": ""},
                 "logprobs": None, "finish_reason": None}], **extra}) for i in range(req.n))
            echo = _echo(req)
            if echo:
                yield "".join(sse({**head, "choices": [
                    {"index": i, "delta": {"content": echo}, "logprobs": None,
                     "finish_reason": None}], **extra}) for i in range(req.n))
            async for _, out in merge_streams([stream]):
                prompt_tokens = len(out.prompt_token_ids)
                cached_tokens = out.num_cached_tokens
                completion_tokens = sum(len(c.token_ids) for c in out.outputs)
                if req.continuous_usage:
                    extra["usage"] = self.usage(prompt_tokens, completion_tokens, cached_tokens)
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
                                              req.top_logprobs or 0, as_ids
                                              ) if req.logprobs else None
                    finish_reason = c.finish_reason
                    reasoning = ""
                    if reasoning_streams[i] is not None:
                        reasoning, text = split_delta(reasoning_streams[i], text,
                                                       bool(finish_reason))
                    if tool_streams[i] is None:
                        split = reasoning_streams[i] is not None
                        delta = ({"content": text} if text or not (finish_reason or split)
                                 else {})
                    else:
                        delta = tool_streams[i].feed(text, bool(finish_reason))
                        if finish_reason:
                            finish_reason = _finish_reason(finish_reason,
                                                           tool_streams[i].tool_calls)
                    if reasoning:
                        delta = {"reasoning": reasoning, "reasoning_content": reasoning, **delta}
                    if not (delta or finish_reason or logprobs is not None):
                        continue  # held back: a marker or tool call may be starting
                    chunks.append(sse({**head, "choices": [
                        {"index": i, "delta": delta, "logprobs": logprobs,
                         "finish_reason": finish_reason, "stop_reason": c.stop_reason}],
                        **extra}))
                if chunks:
                    yield "".join(chunks)
            if req.include_usage:
                yield sse({**head, "choices": [],
                           "usage": self.usage(prompt_tokens, completion_tokens,
                                               cached_tokens)})
        except EngineDeadError as e:
            yield error_event(APIError(str(e), 503))
        finally:
            self.abort_unfinished([stream])
        yield DONE


# Tokens at the end of a rendered prompt in which a reasoning parser looks for the chat
# template's own <think> or </think> (its generation prompt).
_PROMPT_TAIL_TOKENS = 32


@dataclass
class Thinking:
    """One request's reasoning split: the server's reasoning parser, and the end of the
    request's prompt, which may open or close the block."""

    parser: ReasoningParser
    prompt_tail: str


def thinking(parser: ReasoningParser | None, tokenizer: Tokenizer, prompt_ids: list[int],
             params: Any) -> Thinking | None:
    """How a request's output splits into reasoning and content; None without a
    reasoning parser. A constraint (structured output, a forced tool call) starts after
    the reasoning's </think>, unless the prompt has closed the block."""
    if parser is None:
        return None
    tail = tokenizer.decode(prompt_ids[-_PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
    constraint = params.structured_outputs
    if constraint is not None and parser.may_think(tail):
        constraint.starts_after = tokenizer.encode(THINK_END, add_special_tokens=False)
    return Thinking(parser, tail)


def split_delta(stream: ReasoningStream, text: str, final: bool) -> tuple[str, str]:
    """A streamed choice's new text as (reasoning, content); at the end, with whatever
    the stream held back."""
    reasoning, content = stream.feed(text)
    if final:
        more_reasoning, more_content = stream.finish()
        reasoning, content = reasoning + more_reasoning, content + more_content
    return reasoning, content


class _ToolUse:
    """What ``tools`` and ``tool_choice`` ask of one request: the tools the template
    renders, the grammar that forces a call (``required``, or a named function), and how
    the generated text becomes ``tool_calls`` (parsed by the server's tool-call parser
    under ``auto``)."""

    def __init__(self, req: ChatCompletionRequest, auto_parser: ToolParser | None) -> None:
        self.template_tools = ([t.model_dump(exclude_none=True) for t in req.tools]
                               if req.tools is not None else None)
        self.parallel = req.parallel_tool_calls is not False
        self.named: str | None = None
        self.parser: ToolParser | None = None
        choice = req.tool_choice
        if req.tools is not None and not req.tools:
            raise APIError("tools must not be empty: leave it out for no tools.",
                           param="tools")
        if choice is not None and req.tools is None:
            raise APIError("tool_choice needs tools.", param="tool_choice")
        if choice is None:
            choice = "auto" if req.tools else "none"
        self.mode = "named" if isinstance(choice, NamedToolChoice) else choice
        if self.mode in ("named", "required") and _has_constraint(req):
            raise APIError(f"tool_choice {self.mode!r} forces its own output format: it "
                           "cannot be combined with response_format, structured_outputs "
                           "or guided_*.", param="tool_choice")
        functions = {t.function.name: t.function for t in req.tools or []}
        if isinstance(choice, NamedToolChoice):
            self.named = choice.function.name
            if self.named not in functions:
                raise APIError(f"tool_choice names the function {self.named!r}, which is not "
                               "in tools.", param="tool_choice")
            self.schema: Any = functions[self.named].parameters or {"type": "object"}
        elif self.mode == "required":
            self.schema = _required_schema(list(functions.values()), self.parallel)
        elif self.mode == "auto":
            if auto_parser is None:
                raise APIError('"auto" tool choice needs the server started with '
                               "--enable-auto-tool-choice and --tool-call-parser.",
                               param="tool_choice")
            self.parser = auto_parser

    def field(self, req: ChatCompletionRequest) -> str:
        """The field a constraint's error names: tool_choice for a forced call."""
        return "tool_choice" if self.mode in ("named", "required") else req.constraint_field()

    def constrain(self, params: Any) -> None:
        """The grammar that forces the call, on the request's SamplingParams; a parser
        whose markers are special tokens ([TOOL_CALLS], <|python_tag|>) needs them kept
        in the text."""
        if self.mode in ("named", "required"):
            params.structured_outputs = StructuredOutputsParams(json=self.schema)
        if self.parser is not None and self.parser.name in ("mistral", "llama3_json"):
            params.skip_special_tokens = False

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The message's content and tool calls from a choice's whole text."""
        if self.mode == "named":
            return None, [ToolCall(new_tool_call_id(), self.named or "", text)]
        if self.mode == "required":
            calls = parse_tool_calls_json(text)
            return (text, []) if calls is None else (None, self._limit(calls))
        if self.mode == "auto" and self.parser is not None:
            found = self.parser.extract(text)
            if found.tool_calls:
                return found.content, self._limit(found.tool_calls)
        return text, []

    def stream(self) -> _ToolStream | None:
        """Per-choice state that turns text deltas into OpenAI deltas; None for text."""
        if self.mode == "named":
            return _ToolStream(None, self.named, self.parallel)
        if self.mode == "required":
            return _ToolStream(get_tool_parser("hermes"), None, self.parallel,
                               prefix="<tool_call>")
        if self.mode == "auto" and self.parser is not None:
            return _ToolStream(self.parser, None, self.parallel)
        return None

    def _limit(self, calls: list[ToolCall]) -> list[ToolCall]:
        return calls if self.parallel else calls[:1]


class _ToolStream:
    """One streamed choice's tool calls: OpenAI deltas from the text's deltas. A named
    function's arguments are the whole text; otherwise a tool-call parser's stream finds
    the calls (``required``'s JSON list is read as hermes' list form)."""

    def __init__(self, parser: ToolParser | None, named: str | None, parallel: bool,
                 prefix: str = "") -> None:
        self.named = named
        self.parallel = parallel
        self.started = False
        self.calls: list[ToolCall] = []
        self.parser_stream = parser.start_stream() if parser is not None else None
        if self.parser_stream is not None and prefix:
            self.parser_stream.feed(prefix)

    @property
    def tool_calls(self) -> list[ToolCall]:
        if self.parser_stream is None:
            return self.calls
        calls = self.parser_stream.tool_calls
        return calls if self.parallel else calls[:1]

    def feed(self, text: str, final: bool) -> dict[str, Any]:
        if self.parser_stream is None:  # a named function: the text is its arguments
            deltas = []
            if not self.started:
                self.started = True
                self.calls.append(ToolCall(new_tool_call_id(), self.named or "", ""))
                deltas.append(_call_delta(0, self.calls[0].id, self.named, text))
            elif text:
                deltas.append(_call_delta(0, None, None, text))
            self.calls[0].arguments += text
            return {"tool_calls": deltas} if deltas else {}
        out = self.parser_stream.feed(text)
        content, calls = out.content, list(out.tool_calls)
        if final:
            end = self.parser_stream.finish()
            content += end.content
            calls += end.tool_calls
        if not self.parallel:
            calls = [d for d in calls if d.index == 0]
        delta: dict[str, Any] = {}
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = [_call_delta(d.index, d.id, d.name, d.arguments)
                                   for d in calls]
        return delta


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call_delta(index: int, call_id: str | None, name: str | None,
                arguments: str) -> dict[str, Any]:
    """One tool call's delta: the first carries its id, type and name."""
    if call_id is None:
        return {"index": index, "function": {"arguments": arguments}}
    return {"index": index, "id": call_id, "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _tool_call_json(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def _finish_reason(reason: str | None, calls: list[ToolCall]) -> str | None:
    return "tool_calls" if calls and reason == "stop" else reason


def _required_schema(functions: list[Any], parallel: bool) -> dict[str, Any]:
    """A JSON list of at least one call (at most one without parallel calls), each the
    name of one of the tools and arguments that match its parameters' schema."""
    calls = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [f.name]},
                             "parameters": f.parameters or {"type": "object"}},
              "required": ["name", "parameters"], "additionalProperties": False}
             for f in functions]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _has_constraint(req: ChatCompletionRequest) -> bool:
    return ((req.response_format is not None and req.response_format.type != "text")
            or req.structured_outputs is not None
            or any(v is not None for v in (req.guided_json, req.guided_regex,
                                           req.guided_choice, req.guided_grammar)))


def _check_supported(req: ChatCompletionRequest) -> None:
    if not req.messages:
        raise APIError("messages must not be empty.", param="messages")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError("top_logprobs requires logprobs to be true.", param="top_logprobs")
    if req.top_logprobs is not None and req.top_logprobs < 0:
        raise APIError(f"top_logprobs must be at least 0, got {req.top_logprobs}.",
                       param="top_logprobs")
    if req.continue_final_message:
        if req.messages[-1].role != "assistant":
            raise APIError("continue_final_message needs an assistant message last.",
                           param="continue_final_message")
        if "add_generation_prompt" in req.model_fields_set and req.add_generation_prompt:
            raise APIError("add_generation_prompt and continue_final_message cannot both be "
                           "true.", param="continue_final_message")


def _echo(req: ChatCompletionRequest) -> str:
    """With ``echo``, what the reply opens with: the last message's text, when it is the
    assistant's (the message ``continue_final_message`` continues), else nothing."""
    last = req.messages[-1]
    if not req.echo or last.role != "assistant" or last.content is None:
        return ""
    if isinstance(last.content, str):
        return last.content
    return "\n".join(part.text or "" for part in last.content if part.type == "text")


def _add_generation_prompt(req: ChatCompletionRequest) -> bool:
    return req.add_generation_prompt and not req.continue_final_message


def render_chat_prompt(tokenizer: Tokenizer, messages: list[ChatMessage],
                       add_generation_prompt: bool, continue_final_message: bool,
                       tools: list[dict[str, Any]] | None, chat_template: str | None,
                       template_kwargs: dict[str, Any] | None = None,
                       max_tokens: int | None = None) -> list[int]:
    """Token ids of a conversation rendered with the chat template (``template_kwargs``
    become template variables). The template holds the special tokens itself, so none
    are added on encoding. A conversation that cannot be ``max_tokens`` tokens is a 400
    before it is tokenized."""
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
    if max_tokens is None:
        return tokenizer.encode(text, add_special_tokens=False)
    ids = tokenizer.encode_bounded(text, max_tokens, add_special_tokens=False)
    if ids is None:
        raise APIError(f"This model's maximum context length is {max_tokens} tokens, and the "
                       f"messages ({len(text)} characters) are longer than that.",
                       param="messages", code="context_length_exceeded")
    return ids


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
                   k: int, as_ids: bool = False) -> dict[str, Any]:
    """OpenAI's chat logprobs; with ``as_ids`` each token is "token_id:<id>"."""
    content = []
    for token_id, entry in zip(token_ids, entries or []):
        top = sorted((item for item in entry.items()
                      if item[1].rank is not None and item[1].rank <= k),
                     key=lambda item: item[1].rank or 0)
        content.append({**_token_logprob(token_id, entry[token_id], as_ids),
                        "top_logprobs": [_token_logprob(t, lp, as_ids) for t, lp in top]})
    return {"content": content}


def _token_logprob(token_id: int, lp: Logprob, as_ids: bool) -> dict[str, Any]:
    token = f"token_id:{token_id}" if as_ids else lp.decoded_token or ""
    return {"token": token, "logprob": clamp_logprob(lp.logprob),
            "bytes": list(token.encode("utf-8"))}
