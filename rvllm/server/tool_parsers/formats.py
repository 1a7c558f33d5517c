"""One stream per tool-call format, each a state machine over ``ToolCallStream``'s
machinery: ``hermes``, ``llama3_json``, ``mistral``, and the bare JSON list that a
grammar-forced ``tool_choice: "required"`` makes the model write."""

import re
from collections.abc import Callable

from rvllm.server.tool_parsers.json_scan import CallScanner, ValueEnd, loads
from rvllm.server.tool_parsers.stream import P_START, ToolCallStream

# Modes of the format-specific streams.
_TEXT, _PAYLOAD, _CLOSE, _START, _OBJ_START, _SEP, _NAME, _CALL_ID, _ARGS_START, _ARGS = range(10)


class HermesStream(ToolCallStream):
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
                self._pstate = P_START
                self._mode = _PAYLOAD
            elif self._mode == _PAYLOAD:
                if not self._ended(self._step_payload(final)):
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


class Llama3JsonStream(ToolCallStream):
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
                self._scanner = CallScanner(self._pos)
                self._args_sent = 0
                self._mode = _PAYLOAD
            elif mode == _PAYLOAD:
                if not self._ended(self._step_object(final)):
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


class MistralStream(ToolCallStream):
    MARK = "[TOOL_CALLS]"
    ARGS = "[ARGS]"
    CALL_ID = "[CALL_ID]"

    def __init__(self, new_id: Callable[[], str]) -> None:
        super().__init__(new_id)
        self._mode = _TEXT
        self._name_start = 0
        self._name = ""
        self._call_id: str | None = None
        self._value: ValueEnd | None = None
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
                    self._pstate = P_START
                    self._mode = _PAYLOAD
                else:
                    self._name_start = self._pos
                    self._call_id = None
                    self._mode = _NAME
            elif mode == _PAYLOAD:
                if not self._ended(self._step_payload(final)):
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
                self._value = ValueEnd("{")
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
                if not isinstance(loads(buf[self._args_start:self._pos]), dict):
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


class JsonListStream(ToolCallStream):
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
                self._pstate = P_START
                self._mode = _PAYLOAD
            elif self._mode == _PAYLOAD:
                if not self._ended(self._step_payload(final)):
                    return
                self._mode = _SEP
            else:
                if self._skip_ws():
                    self._fail(self._pos)
                return

