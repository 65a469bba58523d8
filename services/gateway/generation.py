"""One API request on the cluster: its n GenerateRequests, their routing, timers and aborts."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import TYPE_CHECKING

from services.gateway.catalogue import ServedModel
from services.gateway.choice import ChoiceState
from services.gateway.errors import ApiError, from_service_error, unavailable
from services.gateway.schemas import GenerationSpec
from services.gateway.token_router import RequestStream, StreamFailed
from shared import hop_trace
from shared.errors import NoResponders, ServiceError
from shared.logging import get_logger
from shared.messages import AbortRequest, GenerateRequest, RouteReply, WireSamplingParams
from shared.wire import pack_ids

if TYPE_CHECKING:
    from services.gateway.gateway import Gateway

_SEED_SPACE = 1 << 64

log = get_logger("gateway.generation")


NO_RESPONDER_RETRIES = (0.05, 0.1, 0.2, 0.4, 0.8)  # seconds: rides out a scheduler's reconnect
MAX_MIGRATIONS = 2  # times one choice is sent again after its worker went silent before its first token


async def route(conn, subject: str, msg: GenerateRequest) -> RouteReply:
    """Ask a scheduler to place one choice. "No responders" means the message reached nobody, so
    it is retried for a moment (schedulers resubscribe after a NATS restart); else it is final."""
    for pause in NO_RESPONDER_RETRIES:
        try:
            return await conn.request(subject, msg, RouteReply)
        except NoResponders:
            await asyncio.sleep(pause)
    return await conn.request(subject, msg, RouteReply)


class Generation:
    """Owns the RequestStream of one API request from routing to the end, including its aborts."""

    def __init__(self, gw: Gateway, response_id: str, spec: GenerationSpec, prompt_ids: list[int],
                 session_id: str | None, arrival: float, timeout: float | None = None,
                 model: ServedModel | None = None):
        self.gw = gw
        self.model = gw.catalogue.get(spec.model) if model is None else model  # whose tokenizer decodes
        self.timeout = gw.cfg.request_timeout if timeout is None else timeout  # seconds from arrival
        self.response_id = response_id
        self.spec = spec
        self.prompt_ids = prompt_ids
        self._packed = pack_ids(prompt_ids)
        self.session_id = session_id
        self.arrival = arrival  # time.monotonic() at receipt
        self._arrival_wall = time.time() - (time.monotonic() - arrival)
        self.request_ids = [f"{response_id}-{i}" for i in range(spec.n)]
        tail = prompt_ids[-5:]
        want = spec.logprobs is not None
        self.choices = [ChoiceState(i, rid, self.model.tokenizer, tail, spec.stop, want, spec.skip_special_tokens)
                        for i, rid in enumerate(self.request_ids)]
        self.by_id = {c.request_id: c for c in self.choices}
        self.stream: RequestStream | None = None
        self.unfinished = spec.n
        self.first_token_at: float | None = None
        self.migrations = 0
        self.closed = False
        self._timers: list[asyncio.TimerHandle] = []

    # -- routing --------------------------------------------------------------------------------

    def _message(self, i: int) -> GenerateRequest:
        params = self.spec.params
        if params.seed is not None and i:
            params = dataclasses.replace(params, seed=(params.seed + i) % _SEED_SPACE)
        gw = self.gw
        return GenerateRequest(request_id=self.request_ids[i], model=self.model.name,
                               prompt_ids=self._packed, sampling=WireSamplingParams.from_params(params),
                               reply_to=gw.inbox, session_id=self.session_id, cache_salt=self.spec.cache_salt,
                               arrival_time=self._arrival_wall, gateway_id=gw.cfg.gateway_id)

    async def start(self) -> None:
        """Route every choice; raise ApiError (and leave nothing running) when any is refused."""
        gw = self.gw
        conn = gw.conn
        if conn is None or not conn.connected:
            raise unavailable("the gateway is not connected to NATS")
        self.stream = gw.router.open(self.request_ids)
        self.stream.migrate = self._migrate
        messages = [self._message(i) for i in range(self.spec.n)]
        if hop_trace.TRACE is not None:
            for rid in self.request_ids:
                hop_trace.TRACE.mark(rid, "gw_in", time.monotonic() - self.arrival)  # the HTTP request's arrival
                hop_trace.TRACE.mark(rid, "gw_route")
        routing = asyncio.ensure_future(asyncio.gather(
            *(route(conn, gw.subjects.generate, m) for m in messages), return_exceptions=True))
        try:
            # Shielded: a client that leaves while we wait must still have its accepted choices aborted.
            results = await asyncio.shield(routing)
        except asyncio.CancelledError:
            gw.spawn(self._abort_when_routed(routing))
            raise
        failure = self._record_routes(results)
        if hop_trace.TRACE is not None:
            for rid in self.request_ids:
                hop_trace.TRACE.mark(rid, "gw_routed")
        if failure is not None:
            self.abort("routing failed for a sibling choice")
            self.close()
            raise failure
        loop = asyncio.get_running_loop()
        elapsed = time.monotonic() - self.arrival
        gw.metrics.request_queue_time.observe(elapsed)
        timeout, first = self.timeout, gw.cfg.first_token_timeout
        self._timers.append(loop.call_later(timeout - elapsed, self._expire,
                                            f"the request did not finish within {timeout:g} s"))
        if first < timeout:
            self._timers.append(loop.call_later(first - elapsed, self._expire_first, f"no token within {first:g} s"))

    def _record_routes(self, results: list) -> ApiError | None:
        failure: ApiError | None = None
        for rid, res in zip(self.request_ids, results):
            try:
                if isinstance(res, BaseException):
                    raise res
                res.raise_for_error()
                self.gw.router.assign(self.stream, rid, res.worker_id)
            except ServiceError as e:
                failure = failure or from_service_error(e)
            except Exception as e:  # an unexpected failure of one request must not leak its siblings
                failure = failure or ApiError(500, f"routing failed: {e}", type="internal_error")
        return failure

    async def _abort_when_routed(self, routing: asyncio.Future) -> None:
        try:
            results = await routing
        except Exception:
            results = []
        for rid, res in zip(self.request_ids, results):
            if isinstance(res, RouteReply) and res.ok:
                self.gw.router.assign(self.stream, rid, res.worker_id)
        self.abort("client disconnected")
        self.close()

    # -- migration ------------------------------------------------------------------------------

    def _migrate(self, request_id: str, worker: str) -> bool:
        """The worker of `request_id` went silent. Before its first token nothing was shown to the
        client, so the same GenerateRequest goes through the scheduler again (which by now drops
        or suspends the silent worker); after it, the stream ends with an error (False)."""
        choice = self.by_id.get(request_id)
        if choice is None or choice.finished or choice.num_tokens or self.migrations >= MAX_MIGRATIONS:
            return False
        self.migrations += 1
        self.gw.metrics.request_migrations.inc()
        stream = self.stream
        assert stream is not None
        del stream.workers[request_id]  # the watch leaves it alone while it is routed again
        # Should the worker only be stalled, not dead, it must not compute a second copy later; and a
        # decode worker that reserved blocks for it (paired with that prefill worker) lets them go
        # before the request comes again. The aborts are published before the new route request.
        abort = AbortRequest(request_ids=[request_id], reason="migrated")
        for target in {worker} | {hb.worker_id for hb in self.gw.health.live() if hb.role == "decode"}:
            self.gw.spawn(self.gw.publish_abort(target, abort))
        self.gw.spawn(self._reroute(self.request_ids.index(request_id), worker))
        return True

    async def _reroute(self, i: int, silent: str) -> None:
        gw, stream, rid = self.gw, self.stream, self.request_ids[i]
        log.warning("request_migrating", request_id=rid, from_worker=silent, attempt=self.migrations)
        conn = gw.conn
        try:
            if conn is None or not conn.connected:
                raise unavailable("the gateway is not connected to NATS")
            reply = await route(conn, gw.subjects.generate, self._message(i))
            reply.raise_for_error()
        except ServiceError as e:
            gw.router.fail(stream, StreamFailed(e.status, f"worker {silent} stopped responding and the request "
                                                          f"could not be placed again: {e.message}"))
            return
        except ApiError as e:
            gw.router.fail(stream, StreamFailed(e.status, e.message))
            return
        except Exception as e:  # a failure here must end the request, not leave it waiting
            gw.router.fail(stream, StreamFailed(500, f"re-routing failed: {e}", "internal_error"))
            return
        gw.router.assign(stream, rid, reply.worker_id)
        if self.closed or stream.failed:  # ended meanwhile: the new worker must not run it for nobody
            self.abort("request ended while it was re-routed", [rid])
            return
        log.info("request_migrated", request_id=rid, worker_id=reply.worker_id)

    # -- timers ---------------------------------------------------------------------------------

    def _expire(self, message: str) -> None:
        if self.stream is not None:
            self.gw.router.fail(self.stream, StreamFailed(504, message, "timeout"))

    def _expire_first(self, message: str) -> None:
        if self.first_token_at is None:
            self._expire(message)

    # -- the end --------------------------------------------------------------------------------

    def finish_choice(self, choice: ChoiceState) -> None:
        """A choice ended here: stop routing its deltas; tell its worker when a stop string ended it."""
        self.unfinished -= 1
        if choice.stopped_here:
            self.abort("stop string", [choice.request_id])
        if self.stream is not None:
            self.gw.router.release(choice.request_id)
            self.stream.workers.pop(choice.request_id, None)

    def abort(self, reason: str, request_ids: list[str] | None = None) -> None:
        """Tell the workers of these (default: all unfinished) choices to stop and free their KV."""
        if self.stream is None:
            return
        if request_ids is None:
            request_ids = [c.request_id for c in self.choices if not c.finished]
        by_worker: dict[str, list[str]] = {}
        for rid in request_ids:
            worker = self.stream.workers.get(rid)
            if worker is not None:
                by_worker.setdefault(worker, []).append(rid)
        for worker, rids in by_worker.items():
            self.gw.spawn(self.gw.publish_abort(worker, AbortRequest(request_ids=rids, reason=reason)))

    def close(self) -> None:
        self.closed = True
        for t in self._timers:
            t.cancel()
        self._timers.clear()
        if self.stream is not None:
            self.gw.router.close(self.stream)
