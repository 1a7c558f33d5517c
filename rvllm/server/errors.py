"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with the
right status, for every way a request can be wrong."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("rvllm")


class APIError(Exception):
    """An error to send back as is: a status code and OpenAI's error fields."""

    def __init__(self, message: str, status_code: int = 400, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.code = code


def error_body(message: str, status_code: int, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    kind = "invalid_request_error" if status_code < 500 else "server_error"
    if status_code == 401:
        kind = "authentication_error"
    return {"error": {"message": message, "type": kind, "param": param,
                      "code": code if code is not None else status_code}}


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(error_body(err.message, err.status_code, err.param, err.code),
                        status_code=err.status_code)


def error_event(err: APIError) -> str:
    """The same error as a Server-Sent Event, for failures after streaming began."""
    return f"data: {json.dumps(error_body(err.message, err.status_code, err.param, err.code))}\n\n"


def bad_request(e: ValueError, fields: set[str] | frozenset[str] = frozenset()) -> APIError:
    """A ValueError from SamplingParams or the engine; their messages start with the
    field name when one field is to blame."""
    message = str(e)
    first = message.split(" ", 1)[0].split(".", 1)[0].rstrip(":")
    param = first if first in fields else None
    code = "context_length_exceeded" if "maximum context length" in message else None
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
    param = ".".join(str(p) for p in loc) or None
    kind = first.get("type", "")
    if kind == "json_invalid":
        detail = first.get("ctx", {}).get("error") or first.get("msg", "")
        return APIError(f"The request body is not valid JSON: {detail}")
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
