"""Tool-call parsers: split a chat model's generated text into content and OpenAI tool calls.

Models that support function calling write their calls as ordinary text in a format of
their own. A parser knows one format; it turns a whole generated text into content plus
tool calls (:meth:`ToolParser.extract`, for non-streaming responses), or does the same
chunk by chunk (:meth:`ToolParser.start_stream`, for streaming responses), sending each
call's id and name as soon as the name is known and then its arguments as they grow.

Formats, by the name :func:`get_tool_parser` takes:

``hermes``
    Qwen2.5/Qwen3, Hermes and SmolLM2: one or more
    ``<tool_call>{"name": "f", "arguments": {...}}</tool_call>`` blocks, possibly after some
    text, or one block holding a JSON list of such objects. A missing ``</tool_call>`` at
    the very end is tolerated.
``llama3_json``
    Llama 3.1/3.2: ``{"name": "f", "parameters": {...}}``, optionally after
    ``<|python_tag|>``, several calls separated by ``;``. Text that does not start with
    ``{`` or ``<|python_tag|>`` is plain content.
``mistral``
    ``[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]``, or the newer
    ``[TOOL_CALLS]f[ARGS]{...}`` (optionally ``[TOOL_CALLS]f[CALL_ID]id[ARGS]{...}``),
    possibly repeated, after optional text.

``"parameters"`` is accepted wherever ``"arguments"`` is; if both appear, the first one
counts. A call's ``arguments`` is the raw text of its arguments object exactly as the model
wrote it (checked to be a JSON object, never re-serialised); a call without arguments gets
``"{}"``. Hence the argument fragments a stream sends for a call add up to exactly the
``arguments`` that :meth:`ToolParser.extract` returns for the same text.

When the text looks like a tool call but is not a valid one, :meth:`ToolParser.extract`
returns no calls and the whole text as content. A stream cannot take back what it already
sent: if the problem shows before a call's name is complete, the held-back markup goes out as
content (when no call went out before it, the result then matches ``extract``); otherwise it
keeps what it sent and passes the rest of the text on as content.

Content is stripped of surrounding whitespace by ``extract``. A stream sends content as it
comes, except that it holds back a tail that could begin a tool-call marker, and it holds
trailing whitespace until more text follows (whitespace left at the end is dropped once a
call has been made). Joined and stripped, a stream's content equals ``extract``'s.
"""

import uuid

from rvllm.server.tool_parsers.formats import (
    HermesStream,
    JsonListStream,
    Llama3JsonStream,
    MistralStream,
)
from rvllm.server.tool_parsers.json_scan import loads
from rvllm.server.tool_parsers.stream import (
    ExtractedToolCalls,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
)

__all__ = [
    "TOOL_PARSERS",
    "ExtractedToolCalls",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "StreamDelta",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallStream",
    "ToolParser",
    "get_tool_parser",
    "parse_tool_calls_json",
]


def _openai_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


_ALPHANUMERIC = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"


def _mistral_id() -> str:
    """Nine random alphanumeric characters, the id format Mistral's templates expect."""
    number = uuid.uuid4().int
    chars = []
    for _ in range(9):
        number, digit = divmod(number, len(_ALPHANUMERIC))
        chars.append(_ALPHANUMERIC[digit])
    return "".join(chars)


class ToolParser:
    """Base class: one model family's tool-call format."""

    name: str = ""
    _stream_class: type[ToolCallStream] = ToolCallStream
    _new_id = staticmethod(_openai_id)

    def start_stream(self) -> ToolCallStream:
        """Fresh streaming state, one per choice."""
        return self._stream_class(self._new_id)

    def extract(self, text: str) -> ExtractedToolCalls:
        """Splits a whole generated text into content and tool calls."""
        stream = self.start_stream()
        content = stream.feed(text).content + stream.finish().content
        if stream.invalid:
            return ExtractedToolCalls(text.strip() or None, [])
        return ExtractedToolCalls(content.strip() or None, stream.tool_calls)


class HermesToolParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen, Hermes, SmolLM2)."""

    name = "hermes"
    _stream_class = HermesStream


class Llama3JsonToolParser(ToolParser):
    """``<|python_tag|>{"name": ..., "parameters": {...}}; {...}`` (Llama 3.1/3.2)."""

    name = "llama3_json"
    _stream_class = Llama3JsonStream


class MistralToolParser(ToolParser):
    """``[TOOL_CALLS][{...}, ...]`` or ``[TOOL_CALLS]name[ARGS]{...}`` (Mistral)."""

    name = "mistral"
    _stream_class = MistralStream
    _new_id = staticmethod(_mistral_id)


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser
    for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)
}


def get_tool_parser(name: str) -> ToolParser:
    """A parser by its name (a key of :data:`TOOL_PARSERS`)."""
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        known = ", ".join(sorted(TOOL_PARSERS))
        raise ValueError(f"unknown tool parser {name!r}; known parsers: {known}") from None


def parse_tool_calls_json(text: str) -> list[ToolCall] | None:
    """Calls from a JSON list of ``{"name": str, "arguments" (or "parameters"): object}``,
    the form a grammar-forced ``tool_choice: "required"`` makes the model write; None if
    ``text`` is not such a list. Arguments are kept as written, like the parsers'."""
    value = loads(text)
    if value == []:
        return []
    if not isinstance(value, list):
        return None
    stream = JsonListStream(_openai_id)
    stream.feed(text)
    stream.finish()
    return None if stream.invalid else stream.tool_calls

