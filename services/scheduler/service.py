"""The scheduler service: NATS subscriptions around the registry, the router and session affinity."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable

from nats.aio.subscription import Subscription

from services.scheduler.admission import Rejection
from services.scheduler.affinity import SessionAffinity
from services.scheduler.registry import Registry, WorkerState
from services.scheduler.disagg import choose_prefill
from services.scheduler.kv_snapshots import read_snapshots
from services.scheduler.router import Choice, Router
from shared import hop_trace
from shared.config import RouterConfig
from shared.errors import ServiceError, ServiceUnavailable
from shared.logging import get_logger
from shared.messages import AbortRequest, GenerateRequest, KvEvents, RouteReply, WorkerHeartbeat
from shared.nats_client import NatsConnection
from shared.subjects import SCHEDULER_QUEUE, Subjects

FORWARD_RETRY_PAUSES = (0.0, 0.25, 0.5, 1.0)  # seconds before each routing attempt

log = get_logger(__name__)

BUCKET_RETRY_S = 5.0


@dataclass(slots=True)
class SchedulerStats:
    """Counters of this replica (tests and the periodic summary read them)."""

    routed: int = 0
    sticky: int = 0  # of routed: sent to the session's worker
    cached_tokens: int = 0  # of routed: prompt tokens found cached on the chosen worker
    disaggregated: int = 0  # of routed: prefilled by a prefill worker, then handed to a decode worker
    prompt_tokens: int = 0
    rejected: dict[int, int] = field(default_factory=dict)  # HTTP status → count
    errors: int = 0  # handler failures answered with 500


class Scheduler:
    """One scheduler replica. Several may share a NATS server: the generate subject is a queue group.

    Each GenerateRequest is handled to the end before the next (nats-py delivers one subscription's
    messages in order), so a decision always sees the load of every decision before it.
    """

    def __init__(self, cfg: RouterConfig, conn: NatsConnection, subjects: Subjects | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.cfg = cfg
        self.conn = conn
        self.subjects = subjects or Subjects(conn.cfg.subject_prefix)
        self.clock = clock
        self.registry = Registry(cfg.heartbeat_ttl)
        self.router = Router(cfg, self.registry)
        self.affinity = SessionAffinity(clock=clock)
        self.stats = SchedulerStats()
        self._subs: list[Subscription] = []
        self._generate_sub: Subscription | None = None
        self._sweeper: asyncio.Task | None = None

    # -- lifecycle --------------------------------------------------------------------------------

    async def start(self) -> None:
        """Open the affinity bucket, listen to workers, then take requests."""
        await self._open_bucket()
        self._subs.append(await self.conn.subscribe(self.subjects.heartbeat, WorkerHeartbeat, self.on_heartbeat))
        self._subs.append(await self.conn.subscribe(self.subjects.kv_events, KvEvents, self.on_kv_events))
        await self._load_kv_snapshots()
        # Concurrent handlers: each decision is made at once, but the hand-off waits for a worker ack.
        self._generate_sub = await self.conn.subscribe(self.subjects.generate, GenerateRequest, self.handle,
                                                       queue=SCHEDULER_QUEUE, concurrency=1024)
        self._sweeper = asyncio.create_task(self._sweep_loop(), name="scheduler-sweep")
        log.info("scheduler_ready", scheduler_id=self.cfg.scheduler_id, subject=self.subjects.generate,
                 affinity=self.affinity.kv is not None)

    async def stop(self) -> None:
        """Stop taking requests (those already delivered are answered), then stop listening."""
        if self._generate_sub is not None:
            with contextlib.suppress(Exception):
                await self._generate_sub.drain()
            self._generate_sub = None
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subs.clear()
        s = self.stats
        log.info("scheduler_stopped", scheduler_id=self.cfg.scheduler_id, routed=s.routed, sticky=s.sticky,
                 rejected=s.rejected, errors=s.errors, bad_messages=self.conn.bad_messages.total)

    async def _load_kv_snapshots(self) -> None:
        """The workers' whole prefix caches from JetStream, for a scheduler that starts after them (a
        replica, a restart): else it would know only the blocks stored from now on. Read after the
        live events are subscribed, so no report falls between the two."""
        try:
            loaded = await read_snapshots(self.conn, self.subjects.prefix, self.conn.bad_messages)
        except Exception as e:  # no JetStream: the live events alone, as before
            log.warning("kv_snapshots_unavailable", error=str(e))
            return
        now = self.clock()
        taken = [wid for wid, (seq, blocks) in loaded.items() if self.registry.on_kv_snapshot(wid, seq, blocks, now)]
        if taken:
            log.info("kv_snapshots_loaded", workers=len(taken), blocks=sum(len(loaded[w][1]) for w in taken))

    async def _open_bucket(self) -> None:
        try:
            self.affinity.kv = await self.conn.kv_bucket(self.cfg.affinity_bucket, ttl=self.cfg.affinity_ttl)
        except ServiceError as e:
            log.warning("affinity_bucket_unavailable", bucket=self.cfg.affinity_bucket, error=str(e),
                        retry_in=BUCKET_RETRY_S)

    async def _sweep_loop(self) -> None:
        period = min(1.0, self.cfg.heartbeat_ttl / 3)
        next_bucket_try = self.clock() + BUCKET_RETRY_S
        while True:
            await asyncio.sleep(period)
            now = self.clock()
            self.registry.sweep(now)
            if self.affinity.kv is None and now >= next_bucket_try:
                next_bucket_try = now + BUCKET_RETRY_S
                await self._open_bucket()

    # -- worker reports -----------------------------------------------------------------------------

    def on_heartbeat(self, hb: WorkerHeartbeat) -> None:
        now = self.clock()
        self.router.wait.observe(self.registry.workers.get(hb.worker_id), hb, now)  # before the state resets
        self.registry.on_heartbeat(hb, now)

    def on_kv_events(self, ev: KvEvents) -> None:
        self.registry.on_kv_events(ev, self.clock())

    # -- requests -------------------------------------------------------------------------------------

    async def handle(self, req: GenerateRequest) -> RouteReply:
        """Route one request, hand it to its worker (which acknowledges), answer the gateway;
        never raises. A worker that does not acknowledge (between reconnects, or just died) is
        suspended until its next heartbeat and the request is routed again; for a moment
        after a NATS restart every worker can be in that state, hence the short pauses."""
        if hop_trace.TRACE is not None:
            hop_trace.TRACE.mark(req.request_id, "sc_in")
        try:
            for attempt, pause in enumerate(FORWARD_RETRY_PAUSES):
                if pause:
                    await asyncio.sleep(pause)
                result = await self.route(req)
                if isinstance(result, Rejection):
                    if result.status == 503 and attempt + 1 < len(FORWARD_RETRY_PAUSES):
                        continue  # suspended workers come back with their next heartbeat
                    self.stats.rejected[result.status] = self.stats.rejected.get(result.status, 0) + 1
                    return result.to_reply()
                worker = result.worker
                prefill = choose_prefill(self.registry.live(self.clock()), result, req,
                                         self.cfg.disagg_min_prefill_tokens, self.cfg.disagg_max_prefill_queue_tokens,
                                         self.registry.store_kv, self.cfg.disagg_by_time)
                target, forwarded = worker, req.forwarded_to(worker.worker_id, store_cached_tokens=result.store_tokens)
                if prefill is None and worker.role == "decode":
                    worker.local_prefill_tokens += max(req.num_prompt_tokens - result.cached_tokens, 0)
                if prefill is not None:  # the prefill worker takes it and hands it to `worker`
                    prefill.worker.note_routed(req.num_prompt_tokens)
                    target, forwarded = prefill.worker, req.forwarded_to(prefill.worker.worker_id, worker.worker_id,
                                                                         prefill.store_tokens)
                    # The decode worker reserves the blocks while the prompt is prefilled.
                    await self.conn.publish(self.subjects.worker_handoff_prepare(worker.worker_id), forwarded)
                try:
                    ack = await self.conn.request(target.heartbeat.generate_subject, forwarded,
                                                  RouteReply, timeout=self.cfg.forward_timeout)
                except ServiceUnavailable:
                    ack = None
                if ack is not None and ack.ok:
                    break
                if ack is None:  # no answer in time: it may yet take it, beside the next worker
                    await self._withdraw(target.worker_id, req.request_id)
                self.registry.suspend(target.worker_id)
            else:
                return RouteReply.rejected(503, "service_unavailable", "no worker took the request", self.cfg.retry_after)
        except ServiceError as e:  # e.g. the NATS connection went down between decision and forward
            self.stats.rejected[e.status] = self.stats.rejected.get(e.status, 0) + 1
            return RouteReply.rejected(e.status, e.error_type, e.message, self.cfg.retry_after)
        except Exception:
            self.stats.errors += 1
            log.exception("route_failed", request_id=req.request_id)
            return RouteReply.rejected(500, "internal_error", "the scheduler failed to route the request")
        if hop_trace.TRACE is not None:
            hop_trace.TRACE.mark(req.request_id, "sc_out")
        s = self.stats
        s.routed += 1
        s.sticky += result.sticky
        s.cached_tokens += result.cached_tokens
        s.prompt_tokens += req.num_prompt_tokens
        s.disaggregated += prefill is not None
        return RouteReply.accepted(target.worker_id)

    async def _withdraw(self, worker_id: str, request_id: str) -> None:
        """Abort a request at a worker that did not acknowledge it in time: a slow worker that takes
        it late would otherwise run it beside the worker that takes it next, both streaming its tokens.
        (One connection delivers its messages in order: the abort comes after the request.)"""
        with contextlib.suppress(ServiceError):
            await self.conn.publish(self.subjects.worker_abort(worker_id),
                                    AbortRequest(request_ids=[request_id], reason="not acknowledged"))

    async def route(self, req: GenerateRequest) -> Choice | Rejection:
        """Admission, then the session's worker if it can take the request, else the least-cost one."""
        open_ = self.router.admit(req, self.clock())
        if isinstance(open_, Rejection):
            return open_
        if req.session_id:
            choice = await self._route_session(req, open_)
        else:
            choice = self.router.best(open_, req)
        self.router.commit(choice, req)
        return choice

    async def _route_session(self, req: GenerateRequest, open_: list[WorkerState]) -> Choice:
        sid = req.session_id
        assert sid
        aff = self.affinity
        mapping = aff.cached(sid)
        if mapping is not None:
            choice = self.router.sticky(mapping.worker_id, open_, req)
            if choice is not None:
                return choice
        # A miss, or a worker that cannot take it: the bucket may know better (another replica).
        mapping = await aff.lookup(sid)
        if mapping is not None:
            choice = self.router.sticky(mapping.worker_id, open_, req)
            if choice is not None:
                return choice
        choice = self.router.best(open_, req)
        wid = choice.worker.worker_id
        in_force = await aff.assign(sid, wid, mapping.revision if mapping is not None else None)
        if in_force.worker_id != wid:
            # Another replica mapped the session meanwhile: follow it if it can, else overwrite.
            winner = self.router.sticky(in_force.worker_id, open_, req)
            if winner is not None:
                return winner
            await aff.force(sid, wid)
        return choice
