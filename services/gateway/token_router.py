"""The gateway inbox: TokenBatch messages from every worker, fanned out to per-request inboxes."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Callable

from shared import hop_trace
from shared.messages import TokenBatch
from shared.wire import unpack_ids


@dataclass(frozen=True, slots=True)
class StreamFailed:
    """Put into a request's inbox instead of a TokenDelta when the request cannot go on."""

    status: int  # the HTTP status a non-streaming answer gets
    message: str
    type: str = "service_unavailable"


HOLD_S = 1.0  # how long deltas wait for their request's first token before they go out without it


class DeltaInbox:
    """A request's inbox. Deltas wait here until the request's consumer is attached; from then on
    the router hands them to it in one synchronous call per burst of TokenBatches, so a token costs
    no task wake-up, future or await (at a thousand streams, those were a third of the gateway's CPU).

    A consumer may also take plain tokens (one token mid-stream, nothing else: almost every token of
    a stream): those skip the Delta objects and come as ids, ahead of the deltas of the same burst."""

    __slots__ = ("_items", "_consumer", "_tokens", "_take_tokens")

    def __init__(self) -> None:
        self._items: list = []
        self._consumer: Callable[[list], None] | None = None
        self._tokens: list[int] = []
        self._take_tokens: Callable[[list[int]], None] | None = None

    def add(self, item: object) -> bool:
        """Queue one item; True when the caller must deliver() later (the first item since the last
        hand-over, with a consumer attached)."""
        items = self._items
        items.append(item)
        return len(items) == 1 and self._consumer is not None

    def add_token(self, token: int) -> bool | None:
        """Queue a plain token: True when the caller must deliver() later, False when it already
        must, None when this inbox takes no plain tokens now (no such consumer, or deltas are
        queued: a token behind them must not overtake them) and the token goes as a delta."""
        if self._take_tokens is None or self._items:
            return None
        tokens = self._tokens
        tokens.append(token)
        return len(tokens) == 1

    def deliver(self) -> None:
        if self._tokens:
            tokens, self._tokens = self._tokens, []
            self._take_tokens(tokens)
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

    def take_tokens(self, take: Callable[[list[int]], None]) -> None:
        """From now on hand plain tokens to `take` as ids (the consumer says when it can)."""
        self._take_tokens = take

    def detach(self) -> None:
        self._consumer = self._take_tokens = None
        self._tokens = []

    def __len__(self) -> int:
        return len(self._items) + len(self._tokens)


class RequestStream:
    """The inbox of one HTTP request: TokenDeltas of its choices (request ids), plus StreamFailed."""

    __slots__ = ("inbox", "request_ids", "workers", "started", "failed", "migrate", "seen", "held")

    def __init__(self, request_ids: list[str]):
        self.inbox = DeltaInbox()
        self.request_ids = request_ids
        self.workers: dict[str, str] = {}  # request id → worker id, once routed
        self.seen: set[str] = set()  # request ids whose first token has come
        # Deltas that came before their request's first token: a decode worker's, which overtook the
        # prefill worker's first token (two publishers: NATS orders each one's messages, not the two).
        self.held: dict[str, list[tuple[object, str]]] = {}
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
        counts = unpack_ids(batch.token_counts)
        tokens = unpack_ids(batch.token_ids)
        special = batch.special_rows()
        others = []  # rows that go as Deltas: ends, logprobs, notices, a worker's first token
        pos = 0
        for i, rid in enumerate(batch.request_ids):
            n = counts[i]
            if n == 1 and i not in special:
                stream = streams.get(rid)
                if stream is not None and stream.workers.get(rid, wid) == wid:
                    first = stream.inbox.add_token(tokens[pos])
                    if first is not None:
                        if first:
                            ready.append(stream.inbox)
                        pos += 1
                        continue
            others.append(i)
            pos += n
        if others:
            self._on_deltas(batch.deltas(others), wid)
        if ready:
            self._schedule_delivery()

    def _schedule_delivery(self) -> None:
        if not self._delivery_scheduled:
            self._delivery_scheduled = True
            asyncio.get_running_loop().call_soon(self._deliver)

    def _on_deltas(self, items: list, wid: str) -> None:
        streams = self._streams
        for item in items:
            rid = item.request_id
            stream = streams.get(rid)
            if stream is None:
                self.unknown_deltas += 1
                continue
            if rid not in stream.seen:
                if item.completion_tokens > item.num_tokens:  # tokens before these have not come
                    self._hold(stream, rid, item, wid)
                    continue
                if item.token_ids:
                    stream.seen.add(rid)
                    if hop_trace.TRACE is not None:
                        hop_trace.TRACE.mark(rid, "gw_first")
            self._add(stream, rid, item, wid)
            if stream.held and rid in stream.seen and rid in stream.held:
                self._release(stream, rid)

    def _add(self, stream: RequestStream, rid: str, item, wid: str) -> None:
        if stream.workers.get(rid, wid) != wid:
            # Handed from a prefill to a decode worker: aborts and liveness follow the request.
            stream.workers[rid] = wid
            if not item.token_ids and item.finish_reason is None:
                return  # the prefill worker's notice of the hand-off: nothing to show
        if stream.inbox.add(item):
            self._ready.append(stream.inbox)

    def _hold(self, stream: RequestStream, rid: str, item, wid: str) -> None:
        held = stream.held.setdefault(rid, [])
        held.append((item, wid))
        if len(held) == 1:  # the first token may be lost with its worker: then they go out anyway
            asyncio.get_running_loop().call_later(HOLD_S, self._release, stream, rid)

    def _release(self, stream: RequestStream, rid: str) -> None:
        held = stream.held.pop(rid, None)
        if not held or self._streams.get(rid) is not stream:
            return
        stream.seen.add(rid)
        for item, wid in held:
            self._add(stream, rid, item, wid)
        self._schedule_delivery()

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
