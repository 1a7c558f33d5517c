"""What a tool-call stream sends (``StreamDelta``: content and ``ToolCallDelta`` pieces), and
``ToolCallStream``, the machinery every format's stream shares: content held back where
a marker could begin, calls opened once their name is known, arguments sent as they
grow, and the fall back to content when the markup turns out not to be a call."""

from collections.abc import Callable
from dataclasses import dataclass, field

from rvllm.server.tool_parsers.json_scan import DONE, FAIL, WAIT, WS, CallScanner, loads


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



def partial_marker_len(buf: str, pos: int, marker: str) -> int:
    """Length of the longest tail of ``buf[pos:]`` that is a proper prefix of ``marker``."""
    for size in range(min(len(marker) - 1, len(buf) - pos), 0, -1):
        if buf.endswith(marker[:size]):
            return size
    return 0



# Payload states: a call object, or a JSON list of them.
P_START, _P_OBJ, _P_LIST_ITEM, _P_LIST_OBJ, _P_LIST_SEP = range(5)


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
        self._scanner: CallScanner | None = None
        self._args_sent = 0
        self._pstate = P_START

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The calls streamed so far, with the arguments sent so far (complete after
        :meth:`finish`)."""
        return [
            ToolCall(call.id, call.name, "".join(parts))
            for call, parts in zip(self._calls, self._arg_parts)
        ]

    @property
    def invalid(self) -> bool:
        """Whether some markup looked like a call but was not a valid one."""
        return self._invalid

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
        while pos < len(buf) and buf[pos] in WS:
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
        end = len(buf) - (0 if final else partial_marker_len(buf, self._pos, marker))
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

    def _ended(self, result: int) -> bool:
        """Whether a payload or call object that ``_step_payload`` or ``_step_object``
        advanced (``result``) is complete; one that failed is given up on first."""
        if result == FAIL:
            self._fail()
        return result == DONE

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
            return self._object_failed(scanner, len(buf)) if final else WAIT
        if scanner.name is None or not isinstance(loads(buf[scanner.start:scanner.end]), dict):
            return self._object_failed(scanner, scanner.end)
        if scanner.args_start is None:
            self._send_args("{}")
        self._open = None
        self._scanner = None
        return DONE

    def _object_failed(self, scanner: CallScanner, pos: int) -> int:
        self._err_pos = pos if self._open is not None else scanner.start
        return FAIL

    def _step_payload(self, final: bool) -> int:
        """Advances a payload: one call object, or a non-empty JSON list of them."""
        while True:
            state = self._pstate
            if state == _P_OBJ or state == _P_LIST_OBJ:
                result = self._step_object(final)
                if result != DONE or state == _P_OBJ:
                    return result
                self._pstate = _P_LIST_SEP
                continue
            if not self._skip_ws():
                if final:
                    self._err_pos = self._pos
                    return FAIL
                return WAIT
            char = self._buf[self._pos]
            if state == _P_LIST_SEP:
                if char == ",":
                    self._pos += 1
                    self._pstate = _P_LIST_ITEM
                    continue
                if char == "]":
                    self._pos += 1
                    return DONE
            elif char == "{":
                self._scanner = CallScanner(self._pos)
                self._args_sent = 0
                self._pstate = _P_OBJ if state == P_START else _P_LIST_OBJ
                continue
            elif char == "[" and state == P_START:
                self._pos += 1
                self._pstate = _P_LIST_ITEM
                continue
            self._err_pos = self._pos
            return FAIL

