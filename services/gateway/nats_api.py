"""The NATS transport: the OpenAI API on {p}.api.v1.* (queue group over the gateway replicas), over
the same request path as HTTP, with cancellation by message and by missing keep-alives.
The wire contract (subjects, headers, the terminal message) is shared/nats_api.py."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg

from services.gateway.errors import ApiError, invalid, too_large, unavailable
from services.gateway.gateway import Gateway
from services.gateway.schemas import is_unicode
from services.gateway.serving import CHAT, COMPLETIONS, Call, Endpoint, failure_error, generate
from services.gateway.streaming import dumps
from services.gateway.token_router import StreamFailed
from shared.logging import get_logger
from shared.nats_api import (AUTHORIZATION, CANCELLED, KEEPALIVE, KEEPALIVE_TIMEOUT, MAX_REQUEST_ID_CHARS,
                             REQUEST_ID, SESSION_AFFINITY, STATUS, TIMEOUT, decode_ids)
from shared.nats_client import NatsConnection
from shared.subjects import GATEWAY_QUEUE

SWEEP_INTERVAL = 0.05  # how often kept-alive requests are checked (a vanished caller: noticed within 0.75 s)
PENDING_MSGS_LIMIT = 1 << 16
EARLY_CANCEL_SECONDS = 5.0  # a cancel may overtake its request (other subscription): it is kept this long
MAX_EARLY_CANCELS = 4096

log = get_logger("gateway.nats_api")


class NatsReply:
    """A request's answer on its caller's reply subject: for a stream (as a ChunkSink), one message
    per chunk event; in every case, exactly one terminal message, which carries x-status."""

    __slots__ = ("nc", "subject", "request_id", "closed", "ended", "_queue", "_flushing")

    def __init__(self, nc: Client, subject: str, request_id: str):
        self.nc = nc
        self.subject = subject
        self.request_id = request_id
        self.closed = False  # publishing failed: the connection is gone
        self.ended = False
        self._queue: list[bytes] = []
        self._flushing: asyncio.Task | None = None

    async def open(self) -> None:
        pass  # a stream's first message is its first chunk

    def send(self, events: bytes) -> bool:
        # nats-py's publish is a coroutine, and the per-token hand-over may not wait: queue the
        # events and publish them from one task per burst, in order.
        if self.closed:
            return False
        if events:
            self._queue.append(events)
            if self._flushing is None:
                self._flushing = asyncio.ensure_future(self._flush())
        return True

    async def _flush(self) -> None:
        try:
            while self._queue:
                queued, self._queue = self._queue, []
                for events in queued:
                    # SSE framing: "data: <json>\n\n" per event, and compact JSON holds no raw newline.
                    for e in events.split(b"\n\n"):
                        if e:
                            await self.nc.publish(self.subject, e[6:])
        except Exception as e:
            self.closed = True
            log.warning("nats_reply_failed", error=repr(e))
        finally:
            self._flushing = None

    async def _drained(self) -> None:
        while self._flushing is not None:
            await asyncio.shield(self._flushing)  # a cancelled request still sends what it had

    async def finish(self, events: bytes, last: bytes = b"") -> None:
        self.send(events)
        await self.end(200, last[6:-2])

    async def fail(self, events: bytes, failure: StreamFailed) -> None:
        self.send(events)
        await self.error(failure_error(failure))

    async def error(self, err: ApiError) -> None:
        await self.end(err.status, err.json(), err.headers())

    async def end(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        """The terminal message (once; later calls do nothing)."""
        if self.ended:
            return
        self.ended = True
        await self._drained()
        try:
            await self.nc.publish(self.subject, body, headers={STATUS: str(status), REQUEST_ID: self.request_id,
                                                               **(headers or {})})
        except Exception as e:  # the caller cannot be told; it times out by itself
            log.warning("nats_reply_failed", error=repr(e), status=status)


@dataclass(slots=True)
class InFlight:
    """A request this gateway is serving, by the caller's request id."""

    task: asyncio.Task
    keepalive: bool  # the caller sends keep-alives: cancel the request when they stop
    last_seen: float  # monotonic time of the request or of its last keep-alive
    cancelled: bool = False

    def cancel(self) -> None:
        """Once: a second cancel would interrupt the request's terminal message."""
        if not self.cancelled and not self.task.done():
            self.cancelled = True
            self.task.cancel()


class NatsApi:
    """The API subjects of one gateway and the requests it serves from them."""

    def __init__(self, gw: Gateway):
        self.gw = gw
        self.calls: dict[str, InFlight] = {}
        self.nc: Client | None = None
        self.refused_control = 0  # cancel / keep-alive messages without a valid key or body
        self._early_cancels: dict[str, float] = {}  # cancelled ids not (yet) seen as requests → when
        self._requests: list[Any] = []
        self._control: list[Any] = []
        self._watch: asyncio.Task | None = None

    async def start(self, conn: NatsConnection) -> None:
        """Take requests from the API subjects (the gateway must be attached to `conn`)."""
        nc = self.nc = conn.client
        s = self.gw.subjects
        for subject, endpoint in ((s.api_chat_completions, CHAT), (s.api_completions, COMPLETIONS),
                                  (s.api_models, None)):
            self._requests.append(await nc.subscribe(subject, queue=GATEWAY_QUEUE, cb=self._taker(endpoint),
                                                     pending_msgs_limit=PENDING_MSGS_LIMIT))
        self._control.append(await nc.subscribe(s.api_cancel, cb=self._on_cancel))
        self._control.append(await nc.subscribe(s.api_keepalive, cb=self._on_keepalive))
        await conn.flush()
        self._watch = self.gw.spawn(self._watch_callers())
        log.info("nats_api_listening", subjects=[s.api_chat_completions, s.api_completions, s.api_models])

    async def stop_accepting(self) -> None:
        """Leave the queue group (draining): other replicas take the new requests."""
        for sub in self._requests:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._requests.clear()

    async def close(self) -> None:
        await self.stop_accepting()
        for sub in self._control:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._control.clear()
        if self._watch is not None:
            self._watch.cancel()
        for call in list(self.calls.values()):
            call.cancel()

    # -- requests -------------------------------------------------------------------------------

    def _taker(self, endpoint: Endpoint | None):
        async def take(msg: Msg) -> None:
            self._take(endpoint, msg)
        return take

    def _take(self, endpoint: Endpoint | None, msg: Msg) -> None:
        """Start serving one request (nats-py delivers a subscription's messages one by one: the
        work happens in a task of its own)."""
        arrival = time.monotonic()
        if not msg.reply:
            log.warning("nats_request_without_reply", subject=msg.subject)
            return
        headers = msg.headers or {}
        request_id = headers.get(REQUEST_ID) or uuid.uuid4().hex
        reply = NatsReply(self.nc, msg.reply, request_id[:MAX_REQUEST_ID_CHARS])
        if len(request_id) > MAX_REQUEST_ID_CHARS or request_id in self.calls or not is_unicode(request_id):
            err = invalid(f"x-request-id must be 1-{MAX_REQUEST_ID_CHARS} characters, unique among the "
                          "requests in flight", param=REQUEST_ID)
            self.gw.metrics.request_errors.labels(status="400").inc()
            self.gw.spawn(reply.error(err))
            return
        if self._early_cancels.pop(request_id, None) is not None:
            self.gw.spawn(reply.error(cancelled()))
            return
        task = self.gw.spawn(self._serve(endpoint, msg.data, headers, reply, arrival))
        call = self.calls[request_id] = InFlight(task, KEEPALIVE in headers, arrival)

        def forget(_: asyncio.Task) -> None:
            if self.calls.get(request_id) is call:
                del self.calls[request_id]
        task.add_done_callback(forget)

    async def _serve(self, endpoint: Endpoint | None, body: bytes, headers: dict[str, str], reply: NatsReply,
                     arrival: float) -> None:
        gw = self.gw
        try:
            tenant = gw.keys.check(headers.get(AUTHORIZATION))
            if len(body) > gw.cfg.max_body_bytes:
                raise too_large(gw.cfg.max_body_bytes)
            if endpoint is None:
                await reply.end(200, dumps(gw.models()))
                return
            if gw.draining:
                raise unavailable("the gateway is shutting down")
            call = Call(body, headers.get(SESSION_AFFINITY), headers.get(TIMEOUT), reply.request_id, arrival,
                        tenant)
            answer = await generate(gw, endpoint, call, lambda: reply)
            if isinstance(answer, bytes):
                await reply.end(200, answer, call.rate_headers)
        except ApiError as e:
            gw.metrics.request_errors.labels(status=str(e.status)).inc()
            await reply.error(e)
        except asyncio.CancelledError:  # a cancel message, a vanished caller, or the gateway closing
            # Not counted as an error, as an HTTP client's disconnect is not.
            await reply.error(cancelled())
        except Exception:
            log.exception("nats_request_failed", request_id=reply.request_id)
            gw.metrics.request_errors.labels(status="500").inc()
            await reply.error(ApiError(500, "internal error", type="server_error"))

    # -- cancellation ---------------------------------------------------------------------------

    def _ids(self, msg: Msg) -> list[str]:
        """The request ids of a cancel or keep-alive message; [] when it is refused."""
        try:
            self.gw.keys.check((msg.headers or {}).get(AUTHORIZATION))
            return decode_ids(msg.data)
        except (ApiError, ValueError) as e:
            self.refused_control += 1
            log.debug("nats_control_refused", subject=msg.subject, error=str(e))
            return []

    async def _on_cancel(self, msg: Msg) -> None:
        now = time.monotonic()
        for request_id in self._ids(msg):
            call = self.calls.get(request_id)
            if call is None:
                self._remember_cancel(request_id, now)
            elif not call.cancelled:
                log.info("nats_request_cancelled", client_request_id=request_id)
                call.cancel()

    def _remember_cancel(self, request_id: str, now: float) -> None:
        """A cancel for a request not seen here: it may be on its way (or served by another replica)."""
        early = self._early_cancels
        if len(early) >= MAX_EARLY_CANCELS or (early and next(iter(early.values())) < now - EARLY_CANCEL_SECONDS):
            for rid, at in list(early.items()):  # oldest first
                if at >= now - EARLY_CANCEL_SECONDS and len(early) < MAX_EARLY_CANCELS:
                    break
                del early[rid]
        early[request_id] = now

    async def _on_keepalive(self, msg: Msg) -> None:
        now = time.monotonic()
        for request_id in self._ids(msg):
            call = self.calls.get(request_id)
            if call is not None:
                call.last_seen = now

    async def _watch_callers(self) -> None:
        """Cancel the kept-alive requests whose callers went silent: nobody reads their answers."""
        while True:
            await asyncio.sleep(SWEEP_INTERVAL)
            silent_since = time.monotonic() - KEEPALIVE_TIMEOUT
            for request_id, call in list(self.calls.items()):
                if call.keepalive and call.last_seen < silent_since and not call.cancelled:
                    log.info("nats_caller_vanished", client_request_id=request_id)
                    call.cancel()


def cancelled() -> ApiError:
    return ApiError(CANCELLED, "the request was cancelled", type="cancelled", code="cancelled")
