"""The HTTP transport's stream: server-sent events written straight to the client's socket."""

from __future__ import annotations

import asyncio

from aiohttp import web

from services.gateway.errors import stream_error_event
from services.gateway.streaming import DONE, event
from services.gateway.token_router import StreamFailed

SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # proxies such as nginx must not buffer a stream
}


class SseWriter:
    """The streaming response (a ChunkSink); `closed` turns True once a write fails (the client went away).

    Chunks are written synchronously, straight to the request's transport, with the HTTP/1.1
    chunk framing that aiohttp announced in the headers: aiohttp's own write() is a coroutine,
    and the per-token path runs inside the inbox's hand-over, where nothing may wait. A slow
    reader's bytes wait in the transport's buffer instead (before, aiohttp's write waited for it
    to drain while the deltas waited in the request's queue: the same bound, the request's output).
    The end of the body (write_eof) still goes through aiohttp, which keeps its keep-alive logic."""

    __slots__ = ("request", "response", "closed", "transport", "chunked")

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response = web.StreamResponse(status=200, headers=SSE_HEADERS)
        self.closed = False
        self.transport: asyncio.Transport | None = None
        self.chunked = False

    async def open(self) -> None:
        await self.response.prepare(self.request)  # sends the headers at once (StreamResponse does not buffer them)
        self.transport = self.request.transport
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

    async def finish(self, events: bytes = b"", last: bytes = b"") -> None:
        """The last chunks, [DONE] and the end of the body."""
        if self.send(events + last + DONE):
            try:
                await self.response.write_eof()
            except (ConnectionError, RuntimeError):  # aiohttp: reset, or "Cannot write to closing transport"
                self.closed = True

    async def fail(self, events: bytes, failure: StreamFailed) -> None:
        """A stream that failed after it began ends with an error event (OpenAI clients raise it)."""
        await self.finish(events + event(stream_error_event(failure.status, failure.message, failure.type)))
