"""The gateway inbox: TokenBatch messages from every worker, fanned out to per-request inboxes."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Callable

from shared.messages import TokenBatch


@dataclass(frozen=True, slots=True)
class StreamFailed:
    """Put into a request's inbox instead of a TokenDelta when the request cannot go on."""

    status: int  # the HTTP status a non-streaming answer gets
    message: str
    type: str = "service_unavailable"


class DeltaInbox:
    """A request's inbox. Deltas wait here until the request's consumer is attached; from then on
    the router hands them to it in one synchronous call per burst of TokenBatches, so a token costs
    no task wake-up, future or await (at a thousand streams, those were a third of the gateway's CPU)."""

    __slots__ = ("_items", "_consumer")

    def __init__(self) -> None:
        self._items: list = []
        self._consumer: Callable[[list], None] | None = None

    def add(self, item: object) -> bool:
        """Queue one item; True when the caller must deliver() later (the first item since the last
        hand-over, with a consumer attached)."""
        items = self._items
        items.append(item)
        return len(items) == 1 and self._consumer is not None

    def deliver(self) -> None:
        consumer = self._consumer
        if consumer is not None and self._items:
            items, self._items = self._items, []
            consumer(items)

    def put(self, item: object) -> None:
        """Queue one item and hand it over at once (failures, which come outside a batch)."""
        self._items.append(item)
        self.deliver()

    def attach(self, consumer: Callable[[list], None]) -> None:
        """From now on hand everything to `consumer`, starting with what arrived before."""
        self._consumer = consumer
        self.deliver()

    def detach(self) -> None:
        self._consumer = None

    def __len__(self) -> int:
        return len(self._items)


class RequestStream:
    """The inbox of one HTTP request: TokenDeltas of its choices (request ids), plus StreamFailed."""

    __slots__ = ("inbox", "request_ids", "workers", "started", "failed", "migrate")

    def __init__(self, request_ids: list[str]):
        self.inbox = DeltaInbox()
        self.request_ids = request_ids
        self.workers: dict[str, str] = {}  # request id → worker id, once routed
        self.started = time.monotonic()
        self.failed = False
        # (request id, silent worker) → True when the request was sent elsewhere instead of failing.
        self.migrate: Callable[[str, str], bool] | None = None


class TokenRouter:
    """request id → RequestStream; fed by the single inbox subscription of this gateway."""

    def __init__(self) -> None:
        self._streams: dict[str, RequestStream] = {}
        self._open: set[RequestStream] = set()
        self._ready: list[DeltaInbox] = []  # inboxes with deltas since the last hand-over
        self._delivery_scheduled = False
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
        ready = self._ready
        wid = batch.worker_id
        for item in batch.items:
            rid = item.request_id
            stream = streams.get(rid)
            if stream is None:
                self.unknown_deltas += 1
                continue
            if stream.workers.get(rid, wid) != wid:
                # Handed from a prefill to a decode worker: aborts and liveness follow the request.
                stream.workers[rid] = wid
                if not item.token_ids and item.finish_reason is None:
                    continue  # the prefill worker's notice of the hand-off: nothing to show
            if stream.inbox.add(item):
                ready.append(stream.inbox)
        if ready and not self._delivery_scheduled:
            self._delivery_scheduled = True
            asyncio.get_running_loop().call_soon(self._deliver)

    def _deliver(self) -> None:
        """Hand over what the current burst of TokenBatches brought, one call per request: when
        the gateway keeps up a burst is one step, and when it falls behind (several steps queued
        on the subscription) each request gets all of them in one call, and one socket write."""
        self._delivery_scheduled = False
        ready, self._ready = self._ready, []
        for inbox in ready:
            inbox.deliver()

    def streams(self) -> list[RequestStream]:
        return list(self._open)

    def fail(self, stream: RequestStream, failure: StreamFailed) -> None:
        """End the request with an error (once: the first failure is the one reported)."""
        if not stream.failed:
            stream.failed = True
            stream.inbox.put(failure)

    @property
    def in_flight(self) -> int:
        return len(self._open)
