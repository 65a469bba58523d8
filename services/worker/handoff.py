"""The prefill → decode hand-off, the prefill worker's end. Control on NATS, pages over UCXX.

Prefill side: the first token has streamed to the gateway already (TTFT never waits for the
transfer). Usually the decode worker the scheduler chose has reserved the blocks while the
prompt was prefilled (the scheduler's prepare) and said so (KvHandoffReady: its UCXX address, the
pages it caches already), so the pages go straight there with the offer in the frame's header:
one UCXX message, no NATS round trip. Otherwise the KV is offered over NATS (offer → reply with
the address) and then pushed. After a refusal or a failed transfer the decode worker is asked to
compute the prompt's KV itself and go on from the first token (a "recompute" offer); only when it
cannot either does the request end with a clean error.
Between two GPU workers of one host the frame carries no pages. Usually the ready notice names a
receive slot of the decode worker's hand-off buffer, and the prefill worker writes the pages into it
over CUDA IPC (cuda_ipc.py) before it sends the frame: the decode worker's handler only queues the
import. Otherwise the frame says where the pages lie in the prefill worker's hand-off buffer, the
decode worker copies them, and its reply says so, so the buffer's slot is free again.
The decode side is handoff_receiver.py.
"""

from __future__ import annotations

import asyncio
from collections import deque
import time
import uuid

import structlog

from services.worker.engine.cuda_ipc import REFUSED, IpcError, IpcExporter, IpcImporter
from services.worker.handoff_receiver import PUSH_GRACE
from services.worker.host_staging import HostStaging, copy_pages, flat_bytes, should_stage
from shared import subjects
from shared.errors import ServiceError
from shared.handoff_messages import KvHandoffOffer, KvHandoffReady, KvHandoffReply
from shared.kv_transfer import TransferClient, TransferError, nbytes_of
from shared.messages import AbortRequest, GenerateRequest, TokenBatch, TokenDelta
from shared.wire import encode

log = structlog.get_logger("worker.handoff")

FORWARD_ABORTS_FOR = 600.0  # seconds a prefill worker forwards a handed-off request's aborts
READY_KEPT_FOR = 60.0  # seconds a decode worker's ready notice waits for its request's first token
RECOMPUTE_TIMEOUT = 5.0  # seconds a decode worker has to take a failed hand-off's request to recompute


class HandoffSender:
    """The prefill worker's side: owns the requests it must hand on, and their transfers."""

    def __init__(self, conn, prefix: str, worker_id: str, layout: str, page_bytes: int,
                 transfer: TransferClient, timeout: float = 10.0, ipc: IpcExporter | None = None,
                 host_id: str = "", pusher: IpcImporter | None = None, staging: HostStaging | None = None,
                 staging_mode: str = "auto"):
        self.conn, self.prefix, self.worker_id = conn, prefix, worker_id
        self.layout, self.page_bytes, self.timeout = layout, page_bytes, timeout
        self.transfer = transfer
        self.ipc, self.host_id = ipc, host_id  # a GPU worker's CUDA IPC exports, and its host
        self.pusher = pusher  # ... and its mappings of decode workers' receive buffers (pushes)
        self.staging, self.staging_mode = staging, staging_mode  # pages through host memory (host_staging.py)
        self._staging_turns: dict[str, asyncio.Lock] = {}  # decode worker's address → its staged frames' turn
        self._no_ipc: set[str] = set()  # decode workers that refused a descriptor: bytes from now on
        self.pending: dict[str, GenerateRequest] = {}  # request id → its request, until handed off
        self.handed: dict[str, tuple[str, float]] = {}  # request id → (decode worker, when)
        self.ready: dict[str, tuple[KvHandoffReady, float]] = {}  # request id → decode worker's blocks wait
        self.stats = {"handoffs": 0, "failed": 0, "bytes": 0, "direct": 0, "ipc": 0, "pushed": 0, "staged": 0,
                      "recomputed": 0}
        self.recent_seconds: deque[float] = deque(maxlen=256)  # the latest hand-offs' times (their p50 in heartbeats)

    async def on_ready(self, msg: KvHandoffReady) -> None:
        now = time.monotonic()
        if len(self.ready) > 4096:  # notices for requests that ended here without a hand-off
            self.ready = {rid: v for rid, v in self.ready.items() if now - v[1] < READY_KEPT_FOR}
        self.ready[msg.request_id] = (msg, now)

    def remember(self, msg: GenerateRequest) -> None:
        self.pending[msg.request_id] = msg

    def decode_worker_of(self, request_id: str) -> str | None:
        entry = self.handed.get(request_id)
        return entry[0] if entry else None

    async def forward_aborts(self, request_ids: list[str]) -> None:
        """An abort that reaches the prefill worker after the hand-off belongs to the decode worker."""
        now = time.monotonic()
        for rid, (_, at) in list(self.handed.items()):
            if now - at > FORWARD_ABORTS_FOR:
                del self.handed[rid]
        by_worker: dict[str, list[str]] = {}
        for rid in request_ids:
            self.pending.pop(rid, None)
            if (wid := self.decode_worker_of(rid)) is not None:
                by_worker.setdefault(wid, []).append(rid)
        for wid, rids in by_worker.items():
            await self.conn.publish(subjects.worker_abort(self.prefix, wid), AbortRequest(request_ids=rids))

    async def finished_here(self, request_ids: list[str]) -> None:
        """Requests that ended with their first token (EOS, max_tokens 1, an error): the decode
        worker reserved blocks for them when the scheduler paired us; release those now."""
        by_worker: dict[str, list[str]] = {}
        for rid in request_ids:
            msg = self.pending.pop(rid, None)
            if msg is not None:
                by_worker.setdefault(msg.decode_worker_id, []).append(rid)
        for wid, rids in by_worker.items():
            await self.conn.publish(subjects.worker_abort(self.prefix, wid), AbortRequest(request_ids=rids))

    async def send(self, output) -> None:
        """Hand one request on; never raises (a failure ends the request with an error). Its pages'
        buffer is free again when this returns."""
        try:
            await self._send(output)
        finally:
            output.handoff.done()

    async def _send(self, output) -> None:
        msg = self.pending.pop(output.request_id, None)
        if msg is None:
            return  # aborted meanwhile
        t0 = time.perf_counter()
        handoff = output.handoff
        ready = self.ready.pop(msg.request_id, (None, 0.0))[0]
        direct = via_ipc = False
        push_copy_s = 0.0
        try:
            if not handoff.copied():  # usually it is, by the time the event loop gets here
                await asyncio.to_thread(handoff.ready)
            t_ready = time.perf_counter()
            offer = KvHandoffOffer(request=msg, first_token=output.new_token_ids[0], seed=handoff.seed,
                                   num_cached_tokens=handoff.num_cached_tokens, layout=self.layout,
                                   page_bytes=self.page_bytes, num_pages=handoff.pages.shape[0],
                                   prefill_worker_id=self.worker_id, transfer_id=uuid.uuid4().hex)
            if ready is not None and self._fits(ready, offer):
                direct, via_ipc, push_copy_s = await self._push_direct(ready, offer, handoff)
            if direct:
                skip, t_offer = ready.skip_pages, t_ready
            else:
                reply = await self.conn.request(subjects.worker_handoff(self.prefix, msg.decode_worker_id), offer,
                                                KvHandoffReply, timeout=self.timeout)
                if not reply.accepted:
                    raise HandoffRefused(reply.reason)
                t_offer = time.perf_counter()
                skip = reply.skip_pages
                _, via_ipc = await self._deliver(reply.address, {"op": "kv_handoff", "transfer_id": offer.transfer_id},
                                                 handoff, skip, reply.host_id)
            pages = handoff.pages[skip:]
        except (ServiceError, TransferError, HandoffRefused, asyncio.TimeoutError) as e:
            self.stats["failed"] += 1
            log.warning("handoff_failed", request_id=msg.request_id, decode_worker=msg.decode_worker_id, error=str(e))
            if await self._recompute_there(msg, output.new_token_ids[0], handoff.seed):
                await self._now_on_decode(msg)
            else:
                await self.conn.publish(msg.reply_to, TokenBatch.of(self.worker_id, [TokenDelta(
                    request_id=msg.request_id, finish_reason="error",
                    error=f"the decode worker could not take the request: {e}")]))
            return
        await self._now_on_decode(msg)
        t_end = time.perf_counter()
        self.recent_seconds.append(t_end - t0)
        self.stats["handoffs"] += 1
        self.stats["direct"] += direct
        self.stats["bytes"] += nbytes_of(pages)
        # One line per hand-off at debug level: the benchmark's timeline (copy, offer, push).
        log.debug("handoff_done", request_id=msg.request_id, pages=int(pages.shape[0]), bytes=nbytes_of(pages),
                  skipped=skip, direct=direct, ipc=via_ipc, export_s=t_ready - t0, offer_s=t_offer - t_ready,
                  push_s=t_end - t_offer, push_copy_s=push_copy_s, total_s=t_end - t0)

    async def _now_on_decode(self, msg: GenerateRequest) -> None:
        """Tell the gateway the request lives on the decode worker now (before that worker's first
        tokens), so it notices if that worker dies and sends aborts there; ours go there too."""
        self.handed[msg.request_id] = (msg.decode_worker_id, time.monotonic())
        await self.conn.publish(msg.reply_to, TokenBatch.of(msg.decode_worker_id, [TokenDelta(request_id=msg.request_id)]))

    async def _recompute_there(self, msg: GenerateRequest, first_token: int, seed: int) -> bool:
        """After a failed hand-off: whether the decode worker took the request to compute its KV
        itself (from the prompt and the first token, which the gateway has), so that a refused or
        timed-out transfer costs the request time, not its answer."""
        offer = KvHandoffOffer(request=msg, first_token=first_token, seed=seed, num_cached_tokens=0,
                               layout=self.layout, page_bytes=self.page_bytes, num_pages=1,
                               prefill_worker_id=self.worker_id, transfer_id=uuid.uuid4().hex, recompute=True)
        try:
            reply = await self.conn.request(subjects.worker_handoff(self.prefix, msg.decode_worker_id), offer,
                                            KvHandoffReply, timeout=RECOMPUTE_TIMEOUT)
        except (ServiceError, asyncio.TimeoutError) as e:
            log.warning("handoff_recompute_failed", request_id=msg.request_id, error=str(e))
            return False
        if reply.accepted:
            self.stats["recomputed"] += 1
        return reply.accepted

    def _fits(self, ready: KvHandoffReady, offer: KvHandoffOffer) -> bool:
        return (ready.decode_worker_id == offer.request.decode_worker_id and ready.layout == self.layout
                and ready.page_bytes == self.page_bytes and ready.num_pages == offer.num_pages)

    async def _push_direct(self, ready: KvHandoffReady, offer: KvHandoffOffer, handoff) -> tuple[bool, bool, float]:
        """The pages and the offer in one UCXX frame to the blocks waiting for them: (delivered,
        over CUDA IPC, seconds the pages took to write into the decode worker's slot). Not
        delivered when the decode worker no longer holds them (expired, aborted): the offer round
        trip decides then."""
        header = {"op": "kv_handoff_direct", "request_id": offer.request.request_id, "offer": encode(offer)}
        try:
            copy_s = await self._write_slot(ready, handoff)
            if copy_s is not None:
                reply, _ = await self.transfer.call(ready.address, self._stamp(header, pushed=ready.push.nbytes),
                                                    None, timeout=self.timeout)
                self.stats["ipc"] += 1
                self.stats["pushed"] += 1
                return bool(reply.get("ok")), True, copy_s
            reply, via_ipc = await self._deliver(ready.address, header, handoff, ready.skip_pages, ready.host_id)
        except TransferError as e:
            log.info("direct hand-off failed; offering instead", request_id=offer.request.request_id, error=str(e))
            return False, False, 0.0
        return bool(reply.get("ok")), via_ipc, 0.0

    async def _write_slot(self, ready: KvHandoffReady, handoff) -> float | None:
        """Write pages[skip_pages:] into the receive slot the decode worker announced, over CUDA IPC,
        and wait for the write: its seconds, or None when there is no slot to write (none announced,
        another host, its time is up, no IPC here) and the frame must carry or describe the pages."""
        target, pages = ready.push, handoff.pages[ready.skip_pages:]
        if (target is None or self.pusher is None or not pages.shape[0]
                or ready.host_id != self.host_id or ready.address in self._no_ipc or time.time() >= target.until):
            return None
        t0 = time.perf_counter()
        try:
            _, written = self.pusher.copy_to(pages, target.descriptor(), after=handoff.event,
                                             owner=ready.decode_worker_id)
            if not written.query():
                await asyncio.to_thread(written.synchronize)
        except RuntimeError as e:  # IpcError, or CUDA refusing the peer's memory: describe or send instead
            log.info("cuda ipc push refused; the decode worker copies from now on", decode_address=ready.address,
                     error=str(e))
            self.pusher = None
            return None
        if time.time() > target.until + PUSH_GRACE:  # the slot may have gone to another request meanwhile
            raise TransferError(f"the write into the decode worker's slot ended {PUSH_GRACE} s past its time")
        return time.perf_counter() - t0

    def _stamp(self, header: dict, **more) -> dict:
        """sent_at: the decode side's timeline (one host, one clock); prefill_worker_id: whose buffer
        a descriptor names (the decode side keeps one mapping per prefill worker)."""
        return {**header, **more, "sent_at": time.time(), "prefill_worker_id": self.worker_id}

    async def _deliver(self, address: str, header: dict, handoff, skip: int, peer_host: str) -> tuple[dict, bool]:
        """One frame with pages[skip:]: their place in the hand-off buffer when the decode worker
        can copy them over CUDA IPC, else the bytes. Returns the reply header and whether IPC
        carried them."""
        pages = handoff.pages[skip:]
        header = self._stamp(header)
        desc = self._describe(pages, handoff, address, peer_host)
        if desc is not None:
            try:
                reply, _ = await self.transfer.call(address, {**header, "ipc": desc}, None, timeout=self.timeout)
                self.stats["ipc"] += 1
                return reply, True
            except TransferError as e:
                if REFUSED not in str(e):
                    raise
                log.info("cuda ipc refused; sending the bytes from now on", decode_address=address, error=str(e))
                self._no_ipc.add(address)
        if not pages.shape[0]:
            reply, _ = await self.transfer.call(address, header, None, timeout=self.timeout)
            return reply, False
        if self.staging is None or not should_stage(self.staging_mode, self.host_id, peer_host):
            reply, _ = await self.transfer.call(address, header, pages, timeout=self.timeout)
            return reply, False
        # One staged frame at a time to a decode worker: its endpoint sends one frame at a time anyway,
        # and a frame waiting for its turn holds no host buffer (each waiting frame made its own).
        async with self._staging_turns.setdefault(address, asyncio.Lock()):
            staged = self.staging.take(nbytes_of(pages))
            try:
                await asyncio.to_thread(copy_pages, staged, flat_bytes(pages))
                reply, _ = await self.transfer.call(address, {**header, "staged": True}, staged, timeout=self.timeout)
            finally:
                self.staging.give(staged)
        self.stats["staged"] += 1
        return reply, False

    def _describe(self, pages, handoff, address: str, peer_host: str) -> dict | None:
        """The IPC descriptor of pages in the hand-off buffer (it lives as long as the worker, so a
        mapping of it stays valid), when the decode worker shares our host; None otherwise."""
        if (self.ipc is None or not handoff.in_buffer or not pages.shape[0] or not peer_host
                or peer_host != self.host_id or address in self._no_ipc):
            return None
        try:
            return self.ipc.describe(pages)
        except IpcError as e:
            log.warning("cuda ipc unavailable here; hand-offs send bytes", error=str(e))
            self.ipc = None
            return None


class HandoffRefused(RuntimeError):
    pass
