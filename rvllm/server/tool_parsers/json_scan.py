"""Incremental JSON scanning for the tool-call streams: where a JSON value ends in a text
that is still growing (``ValueEnd``), and one call object's name and arguments span as
it comes (``CallScanner``)."""

import json
import re

WS = " \t\n\r"
_ARG_KEYS = ("arguments", "parameters")
_STRING_STOP = re.compile(r'["\\]')
_CONTAINER_STOP = re.compile(r'["{}\[\]]')
_SCALAR_RUN = re.compile(r"[A-Za-z0-9+\-.]*")
_SCALAR_START = frozenset("-0123456789tfnNI")

# Scan results.
WAIT, DONE, FAIL = range(3)


def loads(text: str) -> object:
    """``json.loads``, or a sentinel that matches no JSON type on any failure."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return loads


class ValueEnd:
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


# States of CallScanner.
_K_FIRST, _K_KEY, _K_IN_KEY, _K_COLON, _K_VALUE, _K_IN_VALUE, _K_AFTER = range(7)


class CallScanner:
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
        self._value: ValueEnd | None = None
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
                    key = loads(raw)
                    self._key = key if isinstance(key, str) else None
                    self.failed = self._key is None
                    self._state = _K_COLON
                else:
                    if self._role == "name":
                        name = loads(raw)
                        if isinstance(name, str):
                            self.name = name
                        else:
                            self.failed = True
                    elif self._role == "args":
                        self.args_end = pos
                    self._state = _K_AFTER
                continue
            char = buf[pos]
            if char in WS:
                pos += 1
            elif char == "}" and state in (_K_FIRST, _K_AFTER):
                pos += 1
                self.end = pos
            elif char == '"' and state in (_K_FIRST, _K_KEY):
                self._item_start = pos
                self._value = ValueEnd(char)
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
                self._value = ValueEnd(char)
                self._state = _K_IN_VALUE
                if char in '"{[':
                    pos += 1
            else:
                self.failed = True
        self.pos = pos

