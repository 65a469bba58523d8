"""Streamed answers in any transport: SSE-framed chunk events, the JSON encoder, the sink they go to."""

from __future__ import annotations

import json
from json.encoder import encode_basestring  # the C version when available
from typing import TYPE_CHECKING, Any, Callable, Protocol

if TYPE_CHECKING:
    from services.gateway.token_router import StreamFailed

try:  # orjson is several times faster on the per-token path; the standard library is the fallback
    import orjson

    def dumps(obj: Any) -> bytes:
        return orjson.dumps(obj)
except ImportError:  # pragma: no cover - depends on the environment
    _encode: Callable[[Any], str] = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode

    def dumps(obj: Any) -> bytes:
        return _encode(obj).encode()

DONE = b"data: [DONE]\n\n"


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


class ChunkSink(Protocol):
    """Where a streamed answer goes. Events come SSE-framed (`data: <json>\\n\\n`, possibly several
    per call): HTTP writes them as they are; other transports unframe them."""

    closed: bool  # True once the caller is known to be gone

    async def open(self) -> None:
        """The request was accepted: the answer begins (HTTP: status and headers)."""

    def send(self, events: bytes) -> bool:
        """Hand over events now, without waiting; False once the caller is gone."""

    async def finish(self, events: bytes, last: bytes = b"") -> None:
        """The last events, then `last` (the usage chunk, or b""), then the end of the stream."""

    async def fail(self, events: bytes, failure: StreamFailed) -> None:
        """The last events, then the error that ends the stream."""
