"""A small asyncio HTTP/1.1 client for the load generator: one connection per request,
JSON in, the response body out as it streams (Content-Length or chunked).

The standard library is enough here, and a lean client matters on a small machine: every
cycle the client spends is a cycle the server under test does not get.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit


class HTTPError(Exception):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:300]}")
        self.status = status


def split_url(url: str) -> tuple[str, int, str]:
    """``http://host:port/path`` -> (host, port, path); only plain http is spoken."""
    parts = urlsplit(url)
    if parts.scheme != "http":
        raise ValueError(f"only http:// URLs are supported, got {url!r}.")
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    return parts.hostname or "127.0.0.1", parts.port or 80, path


async def _open(url: str, method: str, body: bytes | None, headers: dict[str, str]
                ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, int, dict[str, str]]:
    host, port, path = split_url(url)
    reader, writer = await asyncio.open_connection(host, port)
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}:{port}", "Connection: close",
             "Accept: */*"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    if body is not None:
        lines.append(f"Content-Length: {len(body)}")
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b""))
    await writer.drain()
    status_line = await reader.readline()
    if not status_line:
        raise ConnectionError("the server closed the connection without answering.")
    status = int(status_line.split()[1])
    response_headers: dict[str, str] = {}
    while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
        key, _, value = line.decode("latin-1").partition(":")
        response_headers[key.strip().lower()] = value.strip()
    return reader, writer, status, response_headers


async def _body_chunks(reader: asyncio.StreamReader, headers: dict[str, str]
                       ) -> AsyncIterator[bytes]:
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while True:
            size_line = await reader.readline()
            if not size_line:
                return
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                return
            data = await reader.readexactly(size)
            await reader.readline()  # the CRLF closing the chunk
            yield data
    elif "content-length" in headers:
        remaining = int(headers["content-length"])
        while remaining > 0:
            data = await reader.read(min(remaining, 65536))
            if not data:
                return
            remaining -= len(data)
            yield data
    else:
        while data := await reader.read(65536):
            yield data


async def stream_post(url: str, payload: dict[str, Any],
                      headers: dict[str, str] | None = None) -> AsyncIterator[bytes]:
    """POST ``payload`` as JSON and yield the response body as it arrives, in the
    pieces the transport delivers. Raises HTTPError for a non-2xx status."""
    body = json.dumps(payload).encode()
    all_headers = {"Content-Type": "application/json", **(headers or {})}
    reader, writer, status, rh = await _open(url, "POST", body, all_headers)
    try:
        if not 200 <= status < 300:
            text = b"".join([c async for c in _body_chunks(reader, rh)])
            raise HTTPError(status, text.decode("utf-8", "replace"))
        async for chunk in _body_chunks(reader, rh):
            yield chunk
    finally:
        writer.close()


async def get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    """GET ``url``: (status, body)."""
    async def go() -> tuple[int, bytes]:
        reader, writer, status, rh = await _open(url, "GET", None, {})
        try:
            return status, b"".join([c async for c in _body_chunks(reader, rh)])
        finally:
            writer.close()

    return await asyncio.wait_for(go(), timeout)


async def sse_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """The ``data:`` payloads of a server-sent-event stream, in order ("[DONE]" included)."""
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            line = line.strip()
            if line.startswith(b"data:"):
                yield line[5:].strip().decode("utf-8", "replace")
    if buffer.strip().startswith(b"data:"):
        yield buffer.strip()[5:].strip().decode("utf-8", "replace")
