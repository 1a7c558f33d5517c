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

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

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


@dataclass
class ToolCall:
    """One complete tool call."""

    id: str
    name: str
    arguments: str  # the arguments object's JSON text, as the model wrote it


@dataclass
class ExtractedToolCalls:
    """A whole generated text, split into content and tool calls."""

    content: str | None  # text outside the calls, stripped; None when empty
    tool_calls: list[ToolCall]  # [] when the text holds no valid call


@dataclass
class ToolCallDelta:
    """One streamed piece of one call: id and name on its first piece, then arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class StreamDelta:
    """What one chunk of generated text adds to the response."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


# --------------------------------------------------------------------------------------
# Incremental JSON scanning
# --------------------------------------------------------------------------------------

_WS = " \t\n\r"
_ARG_KEYS = ("arguments", "parameters")
_STRING_STOP = re.compile(r'["\\]')
_CONTAINER_STOP = re.compile(r'["{}\[\]]')
_SCALAR_RUN = re.compile(r"[A-Za-z0-9+\-.]*")
_SCALAR_START = frozenset("-0123456789tfnNI")

# Scan results.
_WAIT, _DONE, _FAIL = range(3)


def _loads(text: str) -> object:
    """``json.loads``, or a sentinel that matches no JSON type on any failure."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return _loads


class _ValueEnd:
    """Finds where one JSON value ends, over a text that grows.

    Tracks strings (with escapes) and bracket depth only; whether the value is valid JSON
    is checked with ``json.loads`` once it is complete. Built from the value's first
    character: a string or container has that character consumed, a scalar does not.
    """

    __slots__ = ("_scalar", "_depth", "_in_string", "_escape", "done")

    def __init__(self, first: str) -> None:
        self._scalar = first not in '"{['
        self._depth = 1 if first in "{[" else 0
        self._in_string = first == '"'
        self._escape = False
        self.done = False

    def run(self, buf: str, pos: int) -> int:
        """Scans ``buf`` from ``pos``; returns how far it got (just past the value once
        ``done``; for a scalar, the character that ended it)."""
        n = len(buf)
        if self._scalar:
            end = _SCALAR_RUN.match(buf, pos).end()
            self.done = end < n
            return end
        while pos < n:
            if self._escape:
                self._escape = False
                pos += 1
            elif self._in_string:
                match = _STRING_STOP.search(buf, pos)
                if match is None:
                    return n
                pos = match.end()
                if match.group() == "\\":
                    self._escape = True
                else:
                    self._in_string = False
                    if self._depth == 0:
                        self.done = True
                        return pos
            else:
                match = _CONTAINER_STOP.search(buf, pos)
                if match is None:
                    return n
                pos = match.end()
                char = match.group()
                if char == '"':
                    self._in_string = True
                elif char in "{[":
                    self._depth += 1
                else:
                    self._depth -= 1
                    if self._depth == 0:
                        self.done = True
                        return pos
        return pos


# States of _CallScanner.
_K_FIRST, _K_KEY, _K_IN_KEY, _K_COLON, _K_VALUE, _K_IN_VALUE, _K_AFTER = range(7)


class _CallScanner:
    """Scans one call object ``{"name": ..., "arguments": {...}, ...}`` as it grows.

    The object's own structure is checked as it comes (so garbage shows early); its values
    are only delimited. It records the name once its string is complete and the span of
    the first ``arguments``/``parameters`` value, which must be an object.
    """

    def __init__(self, start: int) -> None:
        self.start = start  # index of the opening brace
        self.pos = start + 1
        self.name: str | None = None
        self.args_start: int | None = None
        self.args_end: int | None = None
        self.end: int | None = None  # just past the closing brace
        self.failed = False
        self._state = _K_FIRST
        self._key: str | None = None
        self._item_start = 0
        self._value: _ValueEnd | None = None
        self._role: str | None = None

    def run(self, buf: str) -> None:
        n = len(buf)
        pos = self.pos
        while pos < n and self.end is None and not self.failed:
            state = self._state
            if state == _K_IN_KEY or state == _K_IN_VALUE:
                pos = self._value.run(buf, pos)
                if not self._value.done:
                    break
                raw = buf[self._item_start:pos]
                if state == _K_IN_KEY:
                    key = _loads(raw)
                    self._key = key if isinstance(key, str) else None
                    self.failed = self._key is None
                    self._state = _K_COLON
                else:
                    if self._role == "name":
                        name = _loads(raw)
                        if isinstance(name, str):
                            self.name = name
                        else:
                            self.failed = True
                    elif self._role == "args":
                        self.args_end = pos
                    self._state = _K_AFTER
                continue
            char = buf[pos]
            if char in _WS:
                pos += 1
            elif char == "}" and state in (_K_FIRST, _K_AFTER):
                pos += 1
                self.end = pos
            elif char == '"' and state in (_K_FIRST, _K_KEY):
                self._item_start = pos
                self._value = _ValueEnd(char)
                self._state = _K_IN_KEY
                pos += 1
            elif char == "," and state == _K_AFTER:
                self._state = _K_KEY
                pos += 1
            elif char == ":" and state == _K_COLON:
                self._state = _K_VALUE
                pos += 1
            elif state == _K_VALUE and (char in '"{[' or char in _SCALAR_START):
                self._role = None
                if self._key == "name" and self.name is None:
                    self._role = "name"
                    self.failed = char != '"'
                elif self._key in _ARG_KEYS and self.args_start is None:
                    self._role = "args"
                    self.failed = char != "{"
                    self.args_start = pos
                self._item_start = pos
                self._value = _ValueEnd(char)
                self._state = _K_IN_VALUE
                if char in '"{[':
                    pos += 1
            else:
                self.failed = True
        self.pos = pos


def _partial_marker_len(buf: str, pos: int, marker: str) -> int:
    """Length of the longest tail of ``buf[pos:]`` that is a proper prefix of ``marker``."""
    for size in range(min(len(marker) - 1, len(buf) - pos), 0, -1):
        if buf.endswith(marker[:size]):
            return size
    return 0


# --------------------------------------------------------------------------------------
# Streams
# --------------------------------------------------------------------------------------

# Payload states: a call object, or a JSON list of them.
_P_START, _P_OBJ, _P_LIST_ITEM, _P_LIST_OBJ, _P_LIST_SEP = range(5)


class ToolCallStream:
    """Per-choice streaming state of a :class:`ToolParser`: feed it the generated text
    chunk by chunk, then call :meth:`finish`. Chunks may split markers, tokens and JSON
    anywhere. Each call returns what to send for that chunk."""

    def __init__(self, new_id: Callable[[], str]) -> None:
        self._new_id = new_id
        self._buf = ""
        self._pos = 0  # everything before has been handled
        self._content: list[str] = []
        self._deltas: list[ToolCallDelta] = []
        self._held_ws = ""
        self._calls: list[ToolCall] = []  # arguments are kept in _arg_parts until asked for
        self._arg_parts: list[list[str]] = []
        self._open: list[str] | None = None  # argument parts of the call being streamed
        self._passthrough = False  # the rest of the text is content
        self._invalid = False  # something looked like a call but was not a valid one
        self._finished = False
        self._block_start = 0  # where the current call markup began
        self._block_calls = 0  # calls made before it
        self._err_pos = 0
        self._scanner: _CallScanner | None = None
        self._args_sent = 0
        self._pstate = _P_START

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The calls streamed so far, with the arguments sent so far (complete after
        :meth:`finish`)."""
        return [
            ToolCall(call.id, call.name, "".join(parts))
            for call, parts in zip(self._calls, self._arg_parts)
        ]

    def feed(self, delta: str) -> StreamDelta:
        """Takes the next chunk of generated text; returns what it makes ready to send."""
        if self._finished:
            raise RuntimeError("feed() after finish()")
        self._buf += delta
        self._run(final=False)
        return self._take()

    def finish(self) -> StreamDelta:
        """Ends the generation: decides and flushes everything still held back."""
        if self._finished:
            return StreamDelta()
        self._run(final=True)
        self._finished = True
        if not self._calls and self._held_ws:
            self._content.append(self._held_ws)
        self._held_ws = ""
        return self._take()

    # -- machinery shared by the formats -------------------------------------------------

    def _advance(self, final: bool) -> None:
        raise NotImplementedError

    def _idle(self) -> bool:
        """Whether no position before ``self._pos`` is needed any more (outside any call
        markup), so that the handled text can be dropped."""
        return False

    def _run(self, final: bool) -> None:
        if not self._passthrough:
            self._advance(final)
        if self._passthrough:
            self._text(self._buf[self._pos:])
            self._pos = len(self._buf)
        if self._pos and (self._passthrough or self._idle()):
            self._buf = self._buf[self._pos:]
            self._pos = 0

    def _take(self) -> StreamDelta:
        out = StreamDelta("".join(self._content), self._deltas)
        self._content = []
        self._deltas = []
        return out

    def _text(self, text: str) -> None:
        """Sends content, holding trailing whitespace until something follows it."""
        if not text:
            return
        text = self._held_ws + text
        body = text.rstrip()
        if body:
            self._content.append(body)
        self._held_ws = text[len(body):]

    def _skip_ws(self) -> bool:
        """Skips whitespace; says whether a character follows."""
        buf = self._buf
        pos = self._pos
        while pos < len(buf) and buf[pos] in _WS:
            pos += 1
        self._pos = pos
        return pos < len(buf)

    def _find_marker(self, marker: str, final: bool) -> bool:
        """Sends the text up to ``marker`` as content and moves past the marker; without a
        marker, sends what cannot be the start of one and says so with False."""
        buf = self._buf
        found = buf.find(marker, self._pos)
        if found >= 0:
            self._text(buf[self._pos:found])
            self._begin_block(found)
            self._pos = found + len(marker)
            return True
        end = len(buf) - (0 if final else _partial_marker_len(buf, self._pos, marker))
        self._text(buf[self._pos:end])
        self._pos = end
        return False

    def _begin_block(self, start: int) -> None:
        self._block_start = start
        self._block_calls = len(self._calls)

    def _fail(self, err_pos: int | None = None) -> None:
        """Gives up on the current markup. If none of its calls went out, it all becomes
        content; otherwise the text from where it broke does."""
        if err_pos is not None:
            self._err_pos = err_pos
        self._invalid = True
        self._open = None
        self._scanner = None
        self._passthrough = True
        self._pos = self._block_start if len(self._calls) == self._block_calls else self._err_pos

    def _open_call(self, name: str, call_id: str | None = None) -> None:
        call = ToolCall(call_id or self._new_id(), name, "")
        self._calls.append(call)
        self._open = []
        self._arg_parts.append(self._open)
        self._deltas.append(ToolCallDelta(len(self._calls) - 1, call.id, name))

    def _send_args(self, fragment: str) -> None:
        if not fragment:
            return
        self._open.append(fragment)
        index = len(self._calls) - 1
        if self._deltas and self._deltas[-1].index == index:
            self._deltas[-1].arguments += fragment
        else:
            self._deltas.append(ToolCallDelta(index, arguments=fragment))

    def _step_object(self, final: bool) -> int:
        """Advances the call object that starts at ``self._scanner``."""
        scanner = self._scanner
        buf = self._buf
        scanner.run(buf)
        self._pos = scanner.pos
        if scanner.failed:
            return self._object_failed(scanner, scanner.pos)
        if self._open is None and scanner.name is not None:
            self._open_call(scanner.name)
        if self._open is not None and scanner.args_start is not None:
            sent = max(self._args_sent, scanner.args_start)
            upto = scanner.args_end if scanner.args_end is not None else scanner.pos
            self._send_args(buf[sent:upto])
            self._args_sent = upto
        if scanner.end is None:
            return self._object_failed(scanner, len(buf)) if final else _WAIT
        if scanner.name is None or not isinstance(_loads(buf[scanner.start:scanner.end]), dict):
            return self._object_failed(scanner, scanner.end)
        if scanner.args_start is None:
            self._send_args("{}")
        self._open = None
        self._scanner = None
        return _DONE

    def _object_failed(self, scanner: _CallScanner, pos: int) -> int:
        self._err_pos = pos if self._open is not None else scanner.start
        return _FAIL

    def _step_payload(self, final: bool) -> int:
        """Advances a payload: one call object, or a non-empty JSON list of them."""
        while True:
            state = self._pstate
            if state == _P_OBJ or state == _P_LIST_OBJ:
                result = self._step_object(final)
                if result != _DONE or state == _P_OBJ:
                    return result
                self._pstate = _P_LIST_SEP
                continue
            if not self._skip_ws():
                if final:
                    self._err_pos = self._pos
                    return _FAIL
                return _WAIT
            char = self._buf[self._pos]
            if state == _P_LIST_SEP:
                if char == ",":
                    self._pos += 1
                    self._pstate = _P_LIST_ITEM
                    continue
                if char == "]":
                    self._pos += 1
                    return _DONE
            elif char == "{":
                self._scanner = _CallScanner(self._pos)
                self._args_sent = 0
                self._pstate = _P_OBJ if state == _P_START else _P_LIST_OBJ
                continue
            elif char == "[" and state == _P_START:
                self._pos += 1
                self._pstate = _P_LIST_ITEM
                continue
            self._err_pos = self._pos
            return _FAIL


# Modes of the format-specific streams.
_TEXT, _PAYLOAD, _CLOSE, _START, _OBJ_START, _SEP, _NAME, _CALL_ID, _ARGS_START, _ARGS = range(10)


class _HermesStream(ToolCallStream):
    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"

    def __init__(self, new_id: Callable[[], str]) -> None:
        super().__init__(new_id)
        self._mode = _TEXT

    def _idle(self) -> bool:
        return self._mode == _TEXT

    def _advance(self, final: bool) -> None:
        while not self._passthrough:
            if self._mode == _TEXT:
                if not self._find_marker(self.OPEN, final):
                    return
                self._pstate = _P_START
                self._mode = _PAYLOAD
            elif self._mode == _PAYLOAD:
                result = self._step_payload(final)
                if result == _WAIT:
                    return
                if result == _FAIL:
                    self._fail()
                    return
                self._mode = _CLOSE
            else:
                self._skip_ws()
                buf = self._buf
                if buf.startswith(self.CLOSE, self._pos):
                    self._pos += len(self.CLOSE)
                    self._mode = _TEXT
                elif self.CLOSE.startswith(buf[self._pos:self._pos + len(self.CLOSE)]):
                    # Nothing yet, or part of the closing tag; at the end, an unclosed
                    # (or cut-off) block is accepted.
                    if final:
                        self._pos = len(buf)
                    return
                else:
                    self._fail(self._pos)
                    return


class _Llama3JsonStream(ToolCallStream):
    TAG = "<|python_tag|>"

    def __init__(self, new_id: Callable[[], str]) -> None:
        super().__init__(new_id)
        self._mode = _START
        self._allow_end = False

    def _advance(self, final: bool) -> None:
        while not self._passthrough:
            buf = self._buf
            mode = self._mode
            if mode == _START:
                if not self._skip_ws():
                    if final:
                        self._passthrough, self._pos = True, 0
                    return
                self._begin_block(0)
                if buf[self._pos] == "{":
                    self._mode = _OBJ_START
                elif buf.startswith(self.TAG, self._pos):
                    self._pos += len(self.TAG)
                    self._mode = _OBJ_START
                elif self.TAG.startswith(buf[self._pos:self._pos + len(self.TAG)]) and not final:
                    return
                else:  # plain text
                    self._passthrough, self._pos = True, 0
            elif mode == _OBJ_START:
                if not self._skip_ws():
                    if final and not self._allow_end:
                        self._fail(self._pos)
                    return
                if buf[self._pos] != "{":
                    self._fail(self._pos)
                    return
                self._scanner = _CallScanner(self._pos)
                self._args_sent = 0
                self._mode = _PAYLOAD
            elif mode == _PAYLOAD:
                result = self._step_object(final)
                if result == _WAIT:
                    return
                if result == _FAIL:
                    self._fail()
                    return
                self._mode = _SEP
            else:  # _SEP
                if not self._skip_ws():
                    return
                if buf[self._pos] != ";":
                    self._fail(self._pos)
                    return
                self._pos += 1
                self._allow_end = True  # a trailing ";" is harmless
                self._mode = _OBJ_START


_MISTRAL_NAME = re.compile(r"[A-Za-z0-9_.\-]*")
_MISTRAL_ID = re.compile(r"[A-Za-z0-9]*")


class _MistralStream(ToolCallStream):
    MARK = "[TOOL_CALLS]"
    ARGS = "[ARGS]"
    CALL_ID = "[CALL_ID]"

    def __init__(self, new_id: Callable[[], str]) -> None:
        super().__init__(new_id)
        self._mode = _TEXT
        self._name_start = 0
        self._name = ""
        self._call_id: str | None = None
        self._value: _ValueEnd | None = None
        self._args_start = 0

    def _idle(self) -> bool:
        return self._mode == _TEXT

    def _advance(self, final: bool) -> None:
        while not self._passthrough:
            buf = self._buf
            mode = self._mode
            if mode == _TEXT:
                if not self._find_marker(self.MARK, final):
                    return
                self._mode = _START
            elif mode == _START:  # just after [TOOL_CALLS]
                if not self._skip_ws():
                    if final:
                        self._fail(self._pos)
                    return
                if buf[self._pos] in "[{":
                    self._pstate = _P_START
                    self._mode = _PAYLOAD
                else:
                    self._name_start = self._pos
                    self._call_id = None
                    self._mode = _NAME
            elif mode == _PAYLOAD:
                result = self._step_payload(final)
                if result == _WAIT:
                    return
                if result == _FAIL:
                    self._fail()
                    return
                self._mode = _SEP
            elif mode == _NAME or mode == _CALL_ID:
                pattern = _MISTRAL_NAME if mode == _NAME else _MISTRAL_ID
                end = self._pos = pattern.match(buf, self._pos).end()
                token = buf[self._name_start:end]
                tail = buf[end:end + len(self.CALL_ID)]
                if token and tail.startswith(self.ARGS):
                    if mode == _NAME:
                        self._name = token
                    else:
                        self._call_id = token
                    self._open_call(self._name, self._call_id)
                    self._pos = end + len(self.ARGS)
                    self._mode = _ARGS_START
                elif token and mode == _NAME and tail.startswith(self.CALL_ID):
                    self._name = token
                    self._pos = self._name_start = end + len(self.CALL_ID)
                    self._mode = _CALL_ID
                elif not final and (
                    self.ARGS.startswith(tail) or (mode == _NAME and self.CALL_ID.startswith(tail))
                ):
                    return
                else:
                    self._fail(end)
                    return
            elif mode == _ARGS_START:
                if not self._skip_ws():
                    if final:
                        self._fail(self._pos)
                    return
                if buf[self._pos] != "{":
                    self._fail(self._pos)
                    return
                self._args_start = self._args_sent = self._pos
                self._value = _ValueEnd("{")
                self._pos += 1
                self._mode = _ARGS
            elif mode == _ARGS:
                self._pos = self._value.run(buf, self._pos)
                self._send_args(buf[self._args_sent:self._pos])
                self._args_sent = self._pos
                if not self._value.done:
                    if final:
                        self._fail(self._pos)
                    return
                if not isinstance(_loads(buf[self._args_start:self._pos]), dict):
                    self._fail(self._pos)
                    return
                self._open = None
                self._mode = _SEP
            else:  # _SEP: after a call section, only another [TOOL_CALLS] may follow
                if not self._skip_ws():
                    return
                if buf.startswith(self.MARK, self._pos):
                    self._begin_block(self._pos)
                    self._pos += len(self.MARK)
                    self._mode = _START
                elif not final and self.MARK.startswith(buf[self._pos:]):
                    return
                else:
                    self._fail(self._pos)
                    return


class _JsonListStream(ToolCallStream):
    """A bare JSON list of call objects (see :func:`parse_tool_calls_json`)."""

    def __init__(self, new_id: Callable[[], str]) -> None:
        super().__init__(new_id)
        self._mode = _START

    def _advance(self, final: bool) -> None:
        while not self._passthrough:
            if self._mode == _START:
                if not self._skip_ws():
                    if final:
                        self._fail(self._pos)
                    return
                if self._buf[self._pos] != "[":
                    self._fail(self._pos)
                    return
                self._pstate = _P_START
                self._mode = _PAYLOAD
            elif self._mode == _PAYLOAD:
                result = self._step_payload(final)
                if result == _WAIT:
                    return
                if result == _FAIL:
                    self._fail()
                    return
                self._mode = _SEP
            else:
                if self._skip_ws():
                    self._fail(self._pos)
                return


# --------------------------------------------------------------------------------------
# Parsers
# --------------------------------------------------------------------------------------


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
        if stream._invalid:
            return ExtractedToolCalls(text.strip() or None, [])
        return ExtractedToolCalls(content.strip() or None, stream.tool_calls)


class HermesToolParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen, Hermes, SmolLM2)."""

    name = "hermes"
    _stream_class = _HermesStream


class Llama3JsonToolParser(ToolParser):
    """``<|python_tag|>{"name": ..., "parameters": {...}}; {...}`` (Llama 3.1/3.2)."""

    name = "llama3_json"
    _stream_class = _Llama3JsonStream


class MistralToolParser(ToolParser):
    """``[TOOL_CALLS][{...}, ...]`` or ``[TOOL_CALLS]name[ARGS]{...}`` (Mistral)."""

    name = "mistral"
    _stream_class = _MistralStream
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
    value = _loads(text)
    if value == []:
        return []
    if not isinstance(value, list):
        return None
    stream = _JsonListStream(_openai_id)
    stream.feed(text)
    stream.finish()
    return None if stream._invalid else stream.tool_calls
