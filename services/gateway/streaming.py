"""Server-sent events for streamed completions: framing, the JSON encoder, the response writer."""

from __future__ import annotations

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
    """The streaming response; `closed` turns True once a write fails (the client went away)."""

    __slots__ = ("response", "closed")

    def __init__(self) -> None:
        self.response = web.StreamResponse(status=200, headers=SSE_HEADERS)
        self.closed = False

    async def start(self, request: web.Request) -> None:
        await self.response.prepare(request)

    async def write(self, data: bytes) -> bool:
        """False when the client is gone (the caller then aborts the request)."""
        if self.closed:
            return False
        try:
            await self.response.write(data)
        except (ConnectionError, RuntimeError):  # aiohttp: reset, or "Cannot write to closing transport"
            self.closed = True
            return False
        return True

    async def finish(self, data: bytes = b"") -> None:
        if data:
            await self.write(data + DONE)
        else:
            await self.write(DONE)
        if not self.closed:
            try:
                await self.response.write_eof()
            except (ConnectionError, RuntimeError):
                self.closed = True
