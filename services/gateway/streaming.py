"""Server-sent events for streamed completions: framing, the JSON encoder, the response writer."""

from __future__ import annotations

import asyncio
import json
from json.encoder import encode_basestring  # the C version when available
from typing import Any, Callable

from aiohttp import web

try:  # orjson is several times faster on the per-token path; the standard library is the fallback
    import orjson

    def dumps(obj: Any) -> bytes:
        return orjson.dumps(obj)
except ImportError:  # pragma: no cover - depends on the environment
    _encode: Callable[[Any], str] = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode

    def dumps(obj: Any) -> bytes:
        return _encode(obj).encode()

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # proxies such as nginx must not buffer a stream
}


def event(obj: Any) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


_FINISH = {None: b"null", "stop": b'"stop"', "length": b'"length"'}


def json_str(text: str) -> bytes:
    """A JSON string literal (UTF-8, quotes included), through the C encoder of the json module."""
    return encode_basestring(text).encode()


def json_finish(reason: str | None) -> bytes:
    f = _FINISH.get(reason)
    return f if f is not None else json_str(reason)


class ChunkFrame:
    """A stream chunk's fixed envelope (id, object, created, model), encoded once per request;
    each chunk then encodes only its small choice entry (or is filled into a byte template)."""

    __slots__ = ("head",)

    def __init__(self, response_id: str, obj: str, created: int, model: str):
        head = dumps({"id": response_id, "object": obj, "created": created, "model": model})
        self.head = b"data: " + head[:-1] + b',"choices":['  # + entry + b"]}\n\n"

    def chunk(self, entry: dict) -> bytes:
        return self.head + dumps(entry) + b"]}\n\n"

    def usage_chunk(self, usage: dict) -> bytes:
        return self.head + b'],"usage":' + dumps(usage) + b"}\n\n"


class SseWriter:
    """The streaming response; `closed` turns True once a write fails (the client went away).

    Chunks are written synchronously, straight to the request's transport, with the HTTP/1.1
    chunk framing that aiohttp announced in the headers: aiohttp's own write() is a coroutine,
    and the per-token path runs inside the inbox's hand-over, where nothing may wait. A slow
    reader's bytes wait in the transport's buffer instead (before, aiohttp's write waited for it
    to drain while the deltas waited in the request's queue: the same bound, the request's output).
    The end of the body (write_eof) still goes through aiohttp, which keeps its keep-alive logic."""

    __slots__ = ("response", "closed", "transport", "chunked")

    def __init__(self) -> None:
        self.response = web.StreamResponse(status=200, headers=SSE_HEADERS)
        self.closed = False
        self.transport: asyncio.Transport | None = None
        self.chunked = False

    async def start(self, request: web.Request) -> None:
        await self.response.prepare(request)  # sends the headers at once (StreamResponse does not buffer them)
        self.transport = request.transport
        # aiohttp chunks a body of unknown length for HTTP/1.1 and sends it bare (then closes) for 1.0.
        self.chunked = self.response.headers.get("Transfer-Encoding") == "chunked"

    def send(self, data: bytes) -> bool:
        """Write now; False when the client is gone (the caller then aborts the request)."""
        if not data:
            return not self.closed  # an empty HTTP chunk would end the body
        transport = self.transport
        if self.closed or transport is None or transport.is_closing():
            self.closed = True
            return False
        try:
            transport.write(b"%x\r\n%s\r\n" % (len(data), data) if self.chunked else data)
        except (ConnectionError, RuntimeError):
            self.closed = True
            return False
        return True

    async def finish(self, data: bytes = b"") -> None:
        """The last chunks, [DONE] and the end of the body."""
        if self.send(data + DONE):
            try:
                await self.response.write_eof()
            except (ConnectionError, RuntimeError):  # aiohttp: reset, or "Cannot write to closing transport"
                self.closed = True
