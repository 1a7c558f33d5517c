"""Limits the server applies before a request reaches the engine: the size of a body,
and how many requests may wait.

A body larger than ``--max-request-body-bytes`` is answered 413 from its
``Content-Length`` alone, before it is parsed or kept (a body sent without one is
counted as it arrives and refused once it passes the limit); the rest of it is read
and dropped, so that a client that sends it whole sees the answer. A 60 MB prompt costs
the server no memory and about a tenth of a second. The default follows the context:
64 bytes per token of ``max_model_len``, at least 4 MiB, which leaves room for any
prompt that could fit written as text or as token ids.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rvllm.malloc import release_freed_memory
from rvllm.server.errors import error_body

MIN_BODY_BYTES = 4 * 2**20
BODY_BYTES_PER_TOKEN = 64
# After a body this large, the freed memory goes back to the system.
TRIM_AFTER_BODY_BYTES = 2**20


def default_max_body_bytes(max_model_len: int) -> int:
    return max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * max_model_len)


class _TooLarge(Exception):
    pass


# A refused body is read and dropped, up to this much, so that a client that sends it
# whole before it reads the answer sees the 413 rather than a reset connection.
DISCARD_MAX_BYTES = 512 * 2**20


async def _discard_body(receive: Receive, length: int) -> None:
    dropped = 0
    while dropped < min(length, DISCARD_MAX_BYTES):
        message = await receive()
        if message["type"] != "http.request":
            return
        dropped += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


class BodyLimitMiddleware:
    """413, with an OpenAI-style error, for a request body over ``max_bytes()`` (read per
    request: the default waits for the engine's ``max_model_len``)."""

    def __init__(self, app: ASGIApp, max_bytes: Callable[[], int]) -> None:
        self.app = app
        self.limit = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        max_bytes = self.limit()
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > max_bytes:
            await self._refuse(send, max_bytes)
            await _discard_body(receive, int(length))
            return
        received = 0
        started = False

        async def counted_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > max_bytes:
                    raise _TooLarge
            return message

        async def watched_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, watched_send)
        except _TooLarge:
            if not started:
                await self._refuse(send, max_bytes)
        finally:
            if received > TRIM_AFTER_BODY_BYTES:
                release_freed_memory()

    @staticmethod
    async def _refuse(send: Send, max_bytes: int) -> None:
        body = json.dumps(error_body(
            f"The request body is larger than this server's limit of {max_bytes} bytes "
            "(--max-request-body-bytes).", 413, None, "request_too_large")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
