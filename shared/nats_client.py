"""The services' NATS connection: typed publish/request/subscribe, reconnect forever, JetStream KV buckets.

- The first connect waits for the server (backoff with jitter) until the caller's deadline, or forever.
- Afterwards nats-py reconnects forever (through its reconnect_to_server_handler). In a cluster the
  first attempt of an outage goes at once (after up to FAILOVER_JITTER s) to a server other than the
  one lost; any other attempt waits reconnect_time_wait plus random jitter, so a fleet of services
  does not hammer a restarting server in step. Subscriptions are replayed by nats-py after a reconnect.
- `connected` is True only while the connection is up; `on_state(connected)` hears every change.
- Handlers never see undecodable messages: those are counted in `bad_messages` and dropped. An
  exception in a handler is logged and never reaches nats-py.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import random
from typing import Any, Awaitable, Callable, TypeVar
from urllib.parse import urlsplit

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import KeyValueConfig
from nats.js.kv import KeyValue

from shared.config import NatsConfig
from shared.errors import MessageError, NoResponders, ServiceUnavailable
from shared.logging import get_logger
from shared.nats_tls import nats_options
from shared.wire import DecodeCounter, Message, encode, safe_decode

M = TypeVar("M", bound=Message)
StateCallback = Callable[[bool], Any]  # may return an awaitable
FAILOVER_JITTER = 0.1  # seconds: the spread of a fleet's first reconnects to a cluster's other servers
Handler = Callable[[M], "Awaitable[Message | None] | Message | None"]

_INITIAL_BACKOFF = 0.05
_MAX_BACKOFF = 2.0
_DEFAULT_PORTS = {"nats": 4222, "tls": 4222, "ws": 80, "wss": 443}
_DOWN = (nats.errors.ConnectionClosedError, nats.errors.ConnectionDrainingError,
         nats.errors.ConnectionReconnectingError, nats.errors.OutboundBufferLimitError,
         nats.errors.StaleConnectionError)


class NatsConnection:
    """One nats-py client with the services' conventions; create it with `connect_nats`."""

    def __init__(self, cfg: NatsConfig, name: str, on_state: StateCallback | None = None,
                 bad_messages: DecodeCounter | None = None):
        self.cfg = cfg
        self.name = name
        self.nc: Client | None = None
        self.bad_messages = bad_messages if bad_messages is not None else DecodeCounter()
        self._on_state = on_state
        self._connected = False
        self._errors_while_down = 0
        self._server = ""  # the netloc of the server connected to (or last connected to)
        self._closing = False
        self._attempt_error: Exception | None = None
        self._tls = nats_options(cfg)  # the files are read once: a reconnect needs no disk
        self._log = get_logger(__name__, nats_client=name)

    # -- state ----------------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self._connected

    @property
    def client(self) -> Client:
        if self.nc is None:
            raise ServiceUnavailable("NATS is not connected yet")
        return self.nc

    async def _set_connected(self, state: bool) -> None:
        if state == self._connected:
            return
        self._connected = state
        if state:
            self._errors_while_down = 0
        if self._on_state is not None:
            try:
                result = self._on_state(state)
                if inspect.isawaitable(result):
                    await result
            except Exception:
                self._log.exception("nats_on_state_failed")

    # -- connecting -----------------------------------------------------------------------------

    def _options(self, nc: Client) -> dict[str, Any]:
        # Callbacks of a client that is not (or no longer) ours are ignored: a failed initial
        # attempt's client can still call back while it is being closed.
        async def disconnected_cb() -> None:
            if nc is self.nc and self._connected:
                if not self._closing:
                    self._log.warning("nats_disconnected")
                await self._set_connected(False)

        async def reconnected_cb() -> None:
            if nc is self.nc:
                url = nc.connected_url
                self._server = url.netloc if url else ""
                self._log.info("nats_reconnected", url=url.geturl() if url else None)
                await self._set_connected(True)

        async def closed_cb() -> None:
            if nc is self.nc:
                self._log.info("nats_closed")
                await self._set_connected(False)

        async def error_cb(e: Exception) -> None:
            if nc is not self.nc:  # an initial attempt's first error (the cause, e.g. an authorization
                if self._attempt_error is None:  # violation, before the reset that follows), for open()
                    self._attempt_error = e
                return
            if self._connected:
                self._log.warning("nats_error", error=repr(e))
            else:  # every failed reconnect attempt lands here: say it once, then quietly
                self._errors_while_down += 1
                if self._errors_while_down == 1:
                    self._log.warning("nats_reconnect_failing", error=repr(e))
                else:
                    self._log.debug("nats_reconnect_failed", error=repr(e), attempts=self._errors_while_down)

        credentials = dict(user=self.cfg.user, password=self.cfg.password) if self.cfg.user else {}
        return dict(
            servers=self.cfg.servers,
            name=self.name,
            **credentials,
            **self._tls,
            connect_timeout=self.cfg.connect_timeout,
            allow_reconnect=True,
            max_reconnect_attempts=-1,  # forever
            reconnect_time_wait=self.cfg.reconnect_time_wait,
            reconnect_to_server_handler=self._next_server,
            ping_interval=self.cfg.ping_interval,
            max_outstanding_pings=2,
            drain_timeout=self.cfg.drain_timeout,
            error_cb=error_cb,
            disconnected_cb=disconnected_cb,
            reconnected_cb=reconnected_cb,
            closed_cb=closed_cb,
        )

    def _next_server(self, servers: list, info: dict) -> tuple[Any, float]:
        """nats-py's reconnect hook: which server to try, after how long. A cluster's other servers are
        up when one dies (the one connected to, `_server`), so the first try goes to one of them at
        once: waiting the pause first (and picking the dead server again one time in three, of three)
        left a gateway without the bus for 1.6-2.5 s (2026-11-29)."""
        others = [s for s in servers if s.uri.netloc != self._server]
        if others and self._errors_while_down == 0 and len(others) < len(servers):
            return random.choice(others), random.uniform(0.0, FAILOVER_JITTER)
        delay = self.cfg.reconnect_time_wait + random.uniform(0.0, self.cfg.reconnect_jitter)
        return (random.choice(servers) if servers else None), delay

    async def _reachable(self, timeout: float) -> str | None:
        """None when some server accepts TCP connections, else the last error (cheap pre-check).
        A server that handshakes first is asked for the handshake too: it logs a connection closed
        before one as an error, and a certificate it does not trust is said here."""
        error = "no server"
        tls = self._tls.get("tls") if self._tls.get("tls_handshake_first") else None
        for url in self.cfg.servers:
            parts = urlsplit(url)
            host = parts.hostname or "127.0.0.1"
            port = parts.port or _DEFAULT_PORTS.get(parts.scheme, 4222)
            try:
                opened = asyncio.open_connection(host, port, ssl=tls, server_hostname=host if tls else None)
                _, writer = await asyncio.wait_for(opened, timeout)
            except (OSError, asyncio.TimeoutError) as e:
                error = f"{host}:{port}: {e!r}"
                continue
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
            return None
        return error

    async def open(self, wait: float | None = None) -> None:
        """First connect: retry with exponential backoff and jitter for `wait` seconds (None: forever)."""
        loop = asyncio.get_running_loop()
        deadline = None if wait is None else loop.time() + wait
        backoff = _INITIAL_BACKOFF
        attempt = 0
        while True:
            attempt += 1
            remaining = None if deadline is None else deadline - loop.time()
            budget = self.cfg.connect_timeout
            if remaining is not None:
                budget = max(0.01, min(budget, remaining))
            error = await self._reachable(budget)
            if error is None:
                nc = Client()
                self._attempt_error = None
                try:
                    # The nats-py connect itself would retry forever (max_reconnect_attempts=-1), so
                    # bound it: TCP connect, INFO, CONNECT, PING/PONG.
                    await asyncio.wait_for(nc.connect(**self._options(nc)), 2 * budget)
                except (asyncio.TimeoutError, OSError, nats.errors.Error) as e:
                    error = repr(self._attempt_error or e)
                    await _discard(nc)
                except BaseException:  # cancelled while starting up: leave no half-open client behind
                    await _discard(nc)
                    raise
                else:
                    self.nc = nc
                    url = nc.connected_url
                    self._server = url.netloc if url else ""
                    self._log.info("nats_connected", url=url.geturl() if url else None, attempts=attempt)
                    await self._set_connected(True)
                    return
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                raise ServiceUnavailable(f"could not connect to NATS at {self.cfg.url} within {wait}s: {error}")
            pause = backoff * random.uniform(1.0, 1.5)
            if remaining is not None:
                pause = min(pause, remaining)
            if attempt == 1 or attempt % 20 == 0:
                self._log.warning("nats_unreachable", url=self.cfg.url, error=error, attempt=attempt,
                                  retry_in=round(pause, 3))
            await asyncio.sleep(pause)
            backoff = min(backoff * 2, _MAX_BACKOFF)

    # -- messaging ------------------------------------------------------------------------------

    async def publish(self, subject: str, msg: Message) -> None:
        """Publish a typed message; ServiceUnavailable when the connection cannot take it.

        While nats-py is reconnecting, messages are buffered (up to its pending size) and sent after.
        """
        await self.publish_encoded(subject, encode(msg), msg.TYPE)

    async def publish_encoded(self, subject: str, data: bytes, type_tag: str = "") -> None:
        """Publish bytes already made by shared.wire.encode (e.g. on a worker's step thread)."""
        try:
            await self.client.publish(subject, data)
        except nats.errors.MaxPayloadError:
            raise MessageError(f"{type_tag or 'message'} of {len(data)} bytes exceeds the server's max_payload",
                               "size", type_tag) from None
        except _DOWN as e:
            raise ServiceUnavailable(f"NATS connection is down ({e})") from None

    async def request(self, subject: str, msg: Message, reply_cls: type[M], timeout: float | None = None) -> M:
        """Request/reply with a typed reply. ServiceUnavailable (503) when nobody listens, nobody
        answers in time, the connection is down or the reply is malformed."""
        if not self._connected:
            raise ServiceUnavailable("NATS connection is down", retry_after=1.0)
        timeout = self.cfg.request_timeout if timeout is None else timeout
        try:
            resp = await self.client.request(subject, encode(msg), timeout=timeout)
        except nats.errors.NoRespondersError:
            raise NoResponders(f"no service is listening on {subject}", retry_after=1.0) from None
        except nats.errors.TimeoutError:
            raise ServiceUnavailable(f"no reply on {subject} within {timeout:g}s", retry_after=1.0) from None
        except _DOWN as e:
            raise ServiceUnavailable(f"NATS connection is down ({e})", retry_after=1.0) from None
        reply = safe_decode(reply_cls, resp.data, self.bad_messages, subject)
        if reply is None:
            raise ServiceUnavailable(f"malformed {reply_cls.__name__} on {subject}")
        return reply

    async def subscribe(self, subject: str, cls: type[M], handler: Handler, queue: str | None = None,
                        concurrency: int = 1, **options: Any) -> Subscription:
        """Deliver each decodable `cls` message on `subject` to `handler` (sync or async).

        If the message came with a reply subject and the handler returns a Message, that is sent
        as the reply. With concurrency > 1, up to that many handler calls run at once (each
        message in its own task) instead of one after the other. Returns when the server knows
        of the subscription.
        """
        nc = self.client
        log = self._log

        async def handle(raw: Msg) -> None:
            obj = safe_decode(cls, raw.data, self.bad_messages, raw.subject)
            if obj is None:
                return
            try:
                result = handler(obj)
                if inspect.isawaitable(result):
                    result = await result
                if result is not None and raw.reply:
                    await nc.publish(raw.reply, encode(result))
            except Exception:
                log.exception("nats_handler_failed", subject=raw.subject, type=cls.TYPE)

        if concurrency > 1:
            slots = asyncio.Semaphore(concurrency)
            tasks: set[asyncio.Task] = set()

            async def bounded(raw: Msg) -> None:
                async with slots:
                    await handle(raw)

            async def callback(raw: Msg) -> None:
                task = asyncio.ensure_future(bounded(raw))
                tasks.add(task)  # keep a reference until it is done
                task.add_done_callback(tasks.discard)
        else:
            callback = handle

        sub = await nc.subscribe(subject, queue=queue or "", cb=callback, **options)
        if self._connected:  # else nats-py sends the SUB when it reconnects
            with contextlib.suppress(nats.errors.Error, asyncio.TimeoutError):
                await self.flush(self.cfg.connect_timeout)
        return sub

    async def flush(self, timeout: float | None = None) -> None:
        """Return once the server has processed everything sent so far (subscriptions, publishes)."""
        nc = self.client
        timeout = timeout or self.cfg.request_timeout
        # nats-py 2.16 writes flush()'s PING straight to the socket, ahead of commands still queued
        # for its flusher task (a SUB, a PUB), so one flush() can return before the server has them.
        # The first PONG cannot arrive before the flusher task has run, so the second PING follows them.
        await nc.flush(timeout=timeout)
        await nc.flush(timeout=timeout)

    # -- JetStream KV ---------------------------------------------------------------------------

    @property
    def cluster_size(self) -> int:
        """The servers of the NATS cluster: those its INFO names (their client URLs, its own among
        them; none on a lone server), or the servers this service was given, if more (a cluster just
        started may not have gossiped them all yet)."""
        return max(1, len(self.client._server_info.get("connect_urls") or ()), len(set(self.cfg.servers)))

    async def kv_bucket(self, name: str, ttl: float | None = None, history: int = 1) -> KeyValue:
        """The JetStream KV bucket `name`, created (with entries expiring after `ttl` s) if missing.

        Several replicas may call this at once: the loser of a creation race opens the winner's bucket.
        On a NATS cluster the bucket is kept on min(3, cluster size) servers, so it survives one dying.
        """
        js = self.client.jetstream(timeout=self.cfg.request_timeout)
        try:
            try:
                return await js.key_value(name)
            except nats.js.errors.BucketNotFoundError:
                pass
            config = KeyValueConfig(bucket=name, ttl=ttl, history=history, replicas=min(3, self.cluster_size))
            try:
                return await js.create_key_value(config)
            except nats.js.errors.BadRequestError:
                return await js.key_value(name)
        except (nats.errors.NoRespondersError, nats.js.errors.ServiceUnavailableError):
            raise ServiceUnavailable("JetStream is not enabled on the NATS server (start it with -js)") from None
        except nats.errors.TimeoutError:
            raise ServiceUnavailable(f"JetStream did not answer within {self.cfg.request_timeout:g}s") from None

    # -- shutdown -------------------------------------------------------------------------------

    async def drain(self) -> None:
        """Finish delivering what subscriptions hold, flush what is published, then close."""
        nc = self.nc
        if nc is None or nc.is_closed:
            return
        self._closing = True
        try:
            await nc.drain()
        except Exception as e:
            self._log.warning("nats_drain_failed", error=repr(e))
            await self.close()

    async def close(self) -> None:
        nc = self.nc
        self._closing = True
        if nc is not None and not nc.is_closed:
            await nc.close()
        await self._set_connected(False)

    async def __aenter__(self) -> NatsConnection:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.drain()


async def _discard(nc: Client) -> None:
    with contextlib.suppress(Exception):
        await nc.close()


async def connect_nats(cfg: NatsConfig, name: str, on_state: StateCallback | None = None, *,
                       wait: float | None = None, bad_messages: DecodeCounter | None = None) -> NatsConnection:
    """Connect to NATS, waiting up to `wait` seconds (None: forever) for the server to come up.

    Raises ServiceUnavailable when the deadline passes first.
    """
    conn = NatsConnection(cfg, name, on_state=on_state, bad_messages=bad_messages)
    await conn.open(wait=wait)
    return conn
