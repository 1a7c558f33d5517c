"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with the
right status, for every way a request can be wrong.

A message never echoes more than a slice of what the client sent: a value quoted in it
is cut to ``MAX_QUOTED_CHARS`` characters with an ellipsis, and the whole message to
about ``MAX_MESSAGE_CHARS`` (``APIError`` bounds every message it is given)."""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("rvllm")

MAX_QUOTED_CHARS = 100  # of one value from the request, quoted in a message
MAX_MESSAGE_CHARS = 1024  # of a whole message
ELLIPSIS = "\u2026"

# What may be a value from the request inside a message: a span quoted with backticks, or
# with quotes that are not apostrophes (repr's 'x', a JSON "x"), or a long unbroken run.
_LONG = MAX_QUOTED_CHARS + 1
_QUOTED_OR_RUN = re.compile(
    rf"(?P<q>`[^`]{{{_LONG},}}`|(?<!\w)'[^'\n]{{{_LONG},}}'(?!\w)"
    rf"|(?<!\w)\"[^\"\n]{{{_LONG},}}\"(?!\w))|\S{{{_LONG},}}")


def _clip_match(m: re.Match[str]) -> str:
    text = m[0]
    return text[0] + clip(text[1:-1]) + text[-1] if m["q"] else clip(text)


def clip(value: object, limit: int = MAX_QUOTED_CHARS) -> str:
    """``value`` as text, cut to ``limit`` characters with an ellipsis: how a message
    quotes something the client sent."""
    text = value if isinstance(value, str) else str(value)
    return text if len(text) <= limit else text[:limit] + ELLIPSIS


def bound_message(message: str) -> str:
    """``message`` with every quoted span and unbroken run longer than
    ``MAX_QUOTED_CHARS`` clipped, and then at most about ``MAX_MESSAGE_CHARS`` long (its
    start and its end kept). The server's own words are never that long, so only what a
    client sent is cut."""
    if len(message) <= MAX_QUOTED_CHARS:
        return message
    message = _QUOTED_OR_RUN.sub(_clip_match, message)
    if len(message) > MAX_MESSAGE_CHARS:
        tail = MAX_MESSAGE_CHARS // 4
        message = f"{message[:MAX_MESSAGE_CHARS - tail]} {ELLIPSIS} {message[-tail:]}"
    return message


class APIError(Exception):
    """An error to send back: a status code and OpenAI's error fields. The message and
    param are bounded (``bound_message``, ``clip``): they may quote the request."""

    def __init__(self, message: str, status_code: int = 400, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        message = bound_message(message)
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = None if param is None else clip(param)
        self.code = code
        self.headers = headers  # e.g. Retry-After on a 503


def error_body(message: str, status_code: int, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    kind = "invalid_request_error" if status_code < 500 else "server_error"
    if status_code == 401:
        kind = "authentication_error"
    return {"error": {"message": message, "type": kind, "param": param,
                      "code": code if code is not None else status_code}}


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(error_body(err.message, err.status_code, err.param, err.code),
                        status_code=err.status_code, headers=err.headers)


def error_event(err: APIError) -> str:
    """The same error as a Server-Sent Event, for failures after streaming began."""
    return f"data: {json.dumps(error_body(err.message, err.status_code, err.param, err.code))}\n\n"


def bad_request(e: ValueError, fields: set[str] | frozenset[str] = frozenset()) -> APIError:
    """A ValueError from SamplingParams or the engine; their messages start with the
    field name when one field is to blame."""
    message = str(e)
    first = message.split(" ", 1)[0].split(".", 1)[0].rstrip(":")
    param = first if first in fields else None
    code = "context_length_exceeded" if "maximum context length is" in message else None
    return APIError(message, 400, param, code)


def _is_type_tag(part: object) -> bool:
    # pydantic names the branch of a union it tried: "str", "list[int]", ...
    return isinstance(part, str) and (part in {"str", "int", "float", "bool", "none"}
                                      or "[" in part)


def validation_error(errors: list[Any]) -> APIError:
    """The first problem pydantic found, told the way OpenAI tells it."""
    if not errors:
        return APIError("Invalid request.")
    first = errors[0]
    loc = [p for p in first.get("loc", ()) if p != "body" and not _is_type_tag(p)]
    # A dict key or an unknown field's name in the path is the client's: clipped.
    param = ".".join(clip(p) for p in loc) or None
    kind = first.get("type", "")
    if kind == "json_invalid":
        detail = first.get("ctx", {}).get("error") or first.get("msg", "")
        return APIError(f"The request body is not valid JSON: {clip(detail, 200)}")
    if kind == "value_error" and isinstance(first.get("ctx", {}).get("error"), ValueError):
        # A check of protocol.py's own (a size cap): its message is whole as it is.
        return APIError(str(first["ctx"]["error"]), param=param)
    if kind in ("model_type", "model_attributes_type", "dict_type") and not loc:
        return APIError("The request body must be a JSON object.")
    if kind == "extra_forbidden":
        return APIError(f"Unrecognized request argument supplied: {param}", param=param)
    if kind == "missing":
        return APIError(f"Missing required parameter: '{param}'.", param=param)
    same = [e for e in errors
            if [p for p in e.get("loc", ()) if p != "body" and not _is_type_tag(p)] == loc]
    msgs = list(dict.fromkeys(e.get("msg", "") for e in same))
    return APIError(f"Invalid value for '{param}': {'; or '.join(msgs)}.", param=param)


def install_error_handlers(app: FastAPI) -> None:
    """Every error, including FastAPI's own, leaves as OpenAI error JSON."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _request_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(list(exc.errors())))

    @app.exception_handler(ValidationError)
    async def _validation(_: Request, exc: ValidationError) -> JSONResponse:
        return error_response(validation_error(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(APIError(str(exc.detail), exc.status_code))

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return error_response(APIError(f"Internal server error: {exc}", 500))
