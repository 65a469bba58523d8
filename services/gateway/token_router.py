"""The gateway inbox: TokenBatch messages from every worker, fanned out to per-request queues."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from shared.messages import TokenBatch


@dataclass(frozen=True, slots=True)
class StreamFailed:
    """Put into a request's queue instead of a TokenDelta when the request cannot go on."""

    status: int  # the HTTP status a non-streaming answer gets
    message: str
    type: str = "service_unavailable"


class DeltaQueue:
    """A request's inbox: appends from the subscription, one wake-up of the handler per batch of
    arrivals (cheaper than asyncio.Queue, which costs several calls per item)."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: list = []
        self._waiter: asyncio.Future | None = None

    def put(self, item: object) -> None:
        self._items.append(item)
        w = self._waiter
        if w is not None:
            self._waiter = None
            if not w.done():
                w.set_result(None)

    async def take_all(self) -> list:
        """Everything queued, waiting until there is at least one item."""
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, self._items = self._items, []
        return items

    def __len__(self) -> int:
        return len(self._items)


class RequestStream:
    """The inbox of one HTTP request: TokenDeltas of its choices (request ids), plus StreamFailed."""

    __slots__ = ("queue", "request_ids", "workers", "started", "failed")

    def __init__(self, request_ids: list[str]):
        self.queue = DeltaQueue()
        self.request_ids = request_ids
        self.workers: dict[str, str] = {}  # request id → worker id, once routed
        self.started = time.monotonic()
        self.failed = False


class TokenRouter:
    """request id → RequestStream; fed by the single inbox subscription of this gateway."""

    def __init__(self) -> None:
        self._streams: dict[str, RequestStream] = {}
        self._open: set[RequestStream] = set()
        self.unknown_deltas = 0  # deltas for requests already finished here (late, or after an abort)

    def open(self, request_ids: list[str]) -> RequestStream:
        """Register before sending the requests, so that no early delta is lost."""
        stream = RequestStream(request_ids)
        for rid in request_ids:
            self._streams[rid] = stream
        self._open.add(stream)
        return stream

    def assign(self, stream: RequestStream, request_id: str, worker_id: str) -> None:
        stream.workers[request_id] = worker_id

    def release(self, request_id: str) -> None:
        """Stop delivering one request's deltas (it finished here, e.g. on a stop string)."""
        self._streams.pop(request_id, None)

    def close(self, stream: RequestStream) -> None:
        for rid in stream.request_ids:
            if self._streams.get(rid) is stream:
                del self._streams[rid]
        self._open.discard(stream)

    def on_batch(self, batch: TokenBatch) -> None:
        streams = self._streams
        for item in batch.items:
            stream = streams.get(item.request_id)
            if stream is None:
                self.unknown_deltas += 1
            else:
                stream.queue.put(item)

    def streams(self) -> list[RequestStream]:
        return list(self._open)

    def fail(self, stream: RequestStream, failure: StreamFailed) -> None:
        """End the request with an error (once: the first failure is the one reported)."""
        if not stream.failed:
            stream.failed = True
            stream.queue.put(failure)

    @property
    def in_flight(self) -> int:
        return len(self._open)
