"""The prefill → decode hand-off, the decode worker's end: the reservation made at the scheduler's
prepare (announced to the prefill worker, with a receive slot it may write over CUDA IPC), the
receive buffer the pages land in, the import into the step loop, an expiry for offers whose pages
never come, and the take-over of a request whose hand-off failed (computed here from its prompt and
first token). The prefill worker's end is handoff.py.
"""

from __future__ import annotations

import asyncio
from collections import deque
import time

import structlog

from services.worker.engine.cuda_ipc import REFUSED, IpcError, IpcExporter, IpcImporter
from services.worker.grammar import GrammarError
from services.worker.host_staging import HostStaging, copy_pages, flat_bytes
from services.worker.step_loop import AbortCommand, AddCommand, ImportCommand, ReserveCommand
from shared import subjects
from shared.errors import ServiceError
from shared.handoff_messages import KvHandoffOffer, KvHandoffReady, KvHandoffReply, KvPushTarget
from shared.kv_transfer import nbytes_of
from shared.messages import GenerateRequest
from shared.wire import decode

log = structlog.get_logger("worker.handoff")

# Seconds a receive slot stays held past the last moment a prefill worker may start writing it (the
# write itself takes milliseconds): a dropped request's slot is never handed on under a late write.
PUSH_GRACE = 5.0


class HandoffReceiver:
    """The decode worker's side: reservations by request (made when the scheduler announces the
    pairing, so an offer finds its blocks ready) and by transfer, and the UCXX handler pages hit."""

    def __init__(self, step_loop, layout: str, page_bytes: int, address: str, ttl: float = 10.0,
                 publish=None, prefix: str = "", worker_id: str = "", ipc: IpcImporter | None = None,
                 host_id: str = "", slots: IpcExporter | None = None, grammars=lambda: None,
                 staging: HostStaging | None = None):
        self.step_loop, self.layout, self.page_bytes = step_loop, layout, page_bytes
        self.staging = staging  # host buffers that "staged" frames land in before their copy onto the GPU
        self.grammars = grammars  # () -> the attached model's Grammars (structured outputs), or None
        self.address, self.ttl = address, ttl
        # A GPU worker's CUDA IPC mappings; the host it announces (prefill workers there send descriptors).
        self.ipc, self.host_id = ipc, host_id if ipc is not None else ""
        # ... and its receive slots' descriptors, announced so that prefill workers write them (None: they do not).
        self.slots = slots if ipc is not None else None
        # publish(subject, message): tells a prefill worker its request's blocks are reserved here.
        self.publish, self.prefix, self.worker_id = publish, prefix, worker_id
        self.accepting = True
        self.prepared: dict[str, tuple[asyncio.Future, asyncio.TimerHandle]] = {}
        self.waiting: dict[str, tuple[KvHandoffOffer, object, asyncio.TimerHandle]] = {}
        self.stats = {"imports": 0, "refused": 0, "expired": 0, "bytes": 0, "prepared": 0, "direct": 0, "ipc": 0,
                      "pushed": 0, "staged": 0, "recomputed": 0}
        # Requests whose pages landed lately: a prefill worker that gave up on such a hand-off (its
        # reply lost or late) and asks for a recompute finds the request running here already.
        self.imported: deque[str] = deque(maxlen=4096)

    def on_prepare(self, msg: GenerateRequest) -> None:
        """The scheduler paired this worker with a prefill worker for `msg`: reserve its blocks now,
        while the prompt is prefilled elsewhere."""
        if not self.accepting or msg.request_id in self.prepared:
            return
        loop = asyncio.get_running_loop()
        expiry = loop.call_later(self.ttl, self._expire_prepared, msg.request_id)
        done = self._reserve(msg)
        self.prepared[msg.request_id] = (done, expiry)
        self.stats["prepared"] += 1
        if self.publish is not None and msg.worker_id:
            done.add_done_callback(lambda f: self._announce(msg, f))

    def _announce(self, msg: GenerateRequest, done: asyncio.Future) -> None:
        """The blocks are reserved: tell the prefill worker where to push (best effort: without the
        notice it offers over NATS as before)."""
        result = done.result()
        if result is None or isinstance(result, str) or msg.request_id not in self.prepared:
            return
        ready = KvHandoffReady(request_id=msg.request_id, decode_worker_id=self.worker_id,
                               skip_pages=result.skip_blocks, num_pages=result.skip_blocks + result.buffer.shape[0],
                               address=self.address, layout=self.layout, page_bytes=self.page_bytes,
                               host_id=self.host_id, push=self._push_target(result))
        asyncio.ensure_future(self._publish_ready(msg.worker_id, ready))

    def _push_target(self, reservation) -> KvPushTarget | None:
        """The reservation's receive slot for the prefill worker to write, when it is a run of the
        hand-off buffer (shared once; a fresh allocation would need a mapping per hand-off). From
        now on the slot outlives a dropped request by the write window and PUSH_GRACE."""
        if self.slots is None or reservation.release is None or not reservation.buffer.shape[0]:
            return None
        try:
            desc = self.slots.describe(reservation.buffer)
        except IpcError as e:
            log.warning("cuda ipc unavailable for receive slots; prefill workers copy nothing here", error=str(e))
            self.slots = None
            return None
        reservation.hold_until = time.monotonic() + self.ttl + PUSH_GRACE
        return KvPushTarget.of(desc, time.time() + self.ttl)

    async def _publish_ready(self, prefill_worker_id: str, ready: KvHandoffReady) -> None:
        try:
            await self.publish(subjects.worker_handoff_ready(self.prefix, prefill_worker_id), ready)
        except ServiceError:
            pass

    def _reserve(self, req: GenerateRequest) -> asyncio.Future:
        """The reservation's future: an ImportReservation, None (no room in time) or a refusal."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def submit(matcher=None) -> None:
            self.step_loop.submit(ReserveCommand(
                req.request_id, req.prompt_token_ids, req.sampling.to_params(), req.cache_salt.encode(),
                time.monotonic() + self.ttl, lambda result: loop.call_soon_threadsafe(_resolve, done, result),
                matcher))

        if req.sampling.grammar_kind:
            asyncio.ensure_future(self._reserve_constrained(req, done, submit))
        else:
            submit()
        return done

    async def _reserve_constrained(self, req: GenerateRequest, done: asyncio.Future, submit) -> None:
        """A structured output goes on here from the prefill worker's first token: its grammar is
        compiled (cached by text) while the prompt is prefilled there, and the fresh matcher takes
        that token at the import (engine.complete_import)."""
        try:
            matcher = await self._matcher(req)
        except GrammarError as e:
            _resolve(done, str(e))
            return
        submit(matcher)

    async def _matcher(self, req: GenerateRequest):
        """A fresh matcher of the request's grammar (compiled once per text); GrammarError when none."""
        grammars = self.grammars()
        if grammars is None:
            raise GrammarError("this worker has no vocabulary to compile grammars against")
        return await grammars.matcher(req.sampling.grammar_kind, req.sampling.grammar)

    def _expire_prepared(self, request_id: str) -> None:
        """No offer came (the prompt ended on the prefill side, or that worker died)."""
        if self.prepared.pop(request_id, None) is not None:
            self.stats["expired"] += 1
            self.step_loop.submit(AbortCommand([request_id]))

    async def on_offer(self, offer: KvHandoffOffer) -> KvHandoffReply:
        if offer.recompute:
            return await self._take_over(offer)
        refusal = self._check(offer)
        req = offer.request
        entry = self.prepared.pop(req.request_id, None)
        if refusal:
            if entry is not None:
                entry[1].cancel()
                self.step_loop.submit(AbortCommand([req.request_id]))
            self.stats["refused"] += 1
            return KvHandoffReply(accepted=False, reason=refusal)
        if entry is not None:
            entry[1].cancel()
            done = entry[0]
        else:
            done = self._reserve(req)
        try:
            result = await asyncio.wait_for(asyncio.shield(done), self.ttl)
        except asyncio.TimeoutError:
            result = None
        if result is None or isinstance(result, str):
            self.step_loop.submit(AbortCommand([req.request_id]))
            self.stats["refused"] += 1
            return KvHandoffReply(accepted=False, reason=result or "no free KV blocks on the decode worker in time")
        if result.skip_blocks + result.buffer.shape[0] != offer.num_pages:
            self.step_loop.submit(AbortCommand([req.request_id]))
            return KvHandoffReply(accepted=False, reason="page count disagrees with the prompt length")
        expiry = asyncio.get_running_loop().call_later(self.ttl, self._expire, offer.transfer_id)
        self.waiting[offer.transfer_id] = (offer, result, expiry)
        return KvHandoffReply(accepted=True, skip_pages=result.skip_blocks, address=self.address,
                              host_id=self.host_id)

    async def _take_over(self, offer: KvHandoffOffer) -> KvHandoffReply:
        """The prefill worker could not hand the KV over: drop what waits for its pages, and queue the
        request to be computed here from its prompt and first token (nothing lost but the time)."""
        req = offer.request
        rid = req.request_id
        if rid in self.imported:
            return KvHandoffReply(accepted=True)  # its pages came after all: it runs here
        if not self.accepting:
            return KvHandoffReply(accepted=False, reason="the decode worker is draining")
        matcher = None
        if req.sampling.grammar_kind:
            try:
                matcher = await self._matcher(req)
            except GrammarError as e:
                return KvHandoffReply(accepted=False, reason=str(e))
            if rid in self.imported:  # landed while the grammar compiled
                return KvHandoffReply(accepted=True)
        self.abort([rid])
        # In the step loop's order: the reservation's blocks freed, then the request added.
        self.step_loop.submit(AbortCommand([rid]))
        self.step_loop.submit(AddCommand(rid, req.prompt_token_ids, req.sampling.to_params(), req.reply_to,
                                         req.cache_salt.encode(), matcher=matcher,
                                         resume=(offer.first_token, offer.seed)))
        self.stats["recomputed"] += 1
        log.info("handoff_recomputed", request_id=rid, prefill_worker=offer.prefill_worker_id)
        return KvHandoffReply(accepted=True)

    def _check(self, offer: KvHandoffOffer) -> str:
        if not self.accepting:
            return "the decode worker is draining"
        if offer.layout != self.layout or offer.page_bytes != self.page_bytes:
            return f"KV layout {offer.layout!r} differs from this worker's {self.layout!r}"
        return ""

    def _expire(self, transfer_id: str) -> None:
        entry = self.waiting.pop(transfer_id, None)
        if entry is not None:
            self.stats["expired"] += 1
            self.step_loop.submit(AbortCommand([entry[0].request.request_id]))

    def allocate(self, header: dict):
        """Where a pushed frame's pages land: the reservation's buffer (on the GPU when there is one)."""
        if header.get("op") == "kv_handoff_direct":
            reservation = self._prepared_reservation(header.get("request_id"))
            buffer = None if reservation is None else reservation.buffer
        else:
            entry = self.waiting.get(header.get("transfer_id"))
            buffer = None if entry is None else entry[1].buffer
        if buffer is None or nbytes_of(buffer) != header["nbytes"]:
            return None  # unknown or expired: kv_transfer drains the bytes and refuses them
        if header.get("staged") and self.staging is not None:
            return self.staging.take(header["nbytes"])  # on_frame copies it into `buffer`, then gives it back
        return buffer

    def _prepared_reservation(self, request_id):
        entry = self.prepared.get(request_id) if isinstance(request_id, str) else None
        if entry is None or not entry[0].done():
            return None
        result = entry[0].result()
        return None if result is None or isinstance(result, str) else result

    async def on_frame(self, header: dict, payload) -> tuple[dict, None]:
        arrived = time.perf_counter()
        staged = payload if header.get("staged") and self.staging is not None else None
        try:
            reply = await self._on_frame(header, staged)
        finally:
            if staged is not None:
                self.staging.give(staged)
        sent_at = header.get("sent_at")
        if reply.get("ok") and isinstance(sent_at, float):
            # One line per landed hand-off at debug level: with the prefill side's handoff_done, a
            # hand-off's timeline (frame in flight, copy, reply).
            log.debug("handoff_landed", request_id=header.get("request_id") or header.get("transfer_id"),
                      ipc="ipc" in header, wire_s=time.time() - sent_at - (time.perf_counter() - arrived),
                      handler_s=time.perf_counter() - arrived, copy_s=header.get("copy_s", 0.0),
                      copy_gpu_s=header.get("copy_gpu_s", 0.0))
        return reply, None

    async def _on_frame(self, header: dict, staged) -> dict:
        if header.get("op") == "kv_handoff_direct":
            return await self._on_direct(header, staged)
        if header.get("op") != "kv_handoff":
            return {"error": f"unknown op {header.get('op')!r}"}
        tid = header.get("transfer_id")
        entry = self.waiting.get(tid) if isinstance(tid, str) else None
        if entry is None:
            return {"error": "no reservation for this transfer (expired or aborted)"}
        offer, reservation, expiry = entry
        refused = await self._copy_in(header, reservation, staged)
        if refused:
            return {"error": refused}
        if self.waiting.pop(tid, None) is None:
            return {"error": "the reservation ended while its pages were copied"}
        expiry.cancel()
        self._import(offer, reservation)
        return {"ok": True}

    async def _copy_in(self, header: dict, reservation, staged=None) -> str | None:
        """Pages described by an "ipc" header: copy them out of the prefill worker's buffer on a
        stream of ours and wait for the copy (the step stream never waits for it, and the reply
        frees the prefill worker's slot). Pages of a "staged" frame: from the host buffer they
        landed in into the reservation's. An error text refuses the descriptor when they cannot be
        copied so; None when they are in the buffer (or came as the frame's bytes)."""
        if header.get("staged"):
            if staged is None:
                return "staged pages but no host buffer took them"
            t0 = time.perf_counter()
            # Behind the buffer's allocation, as a pull's copy is.
            await asyncio.to_thread(copy_pages, flat_bytes(reservation.buffer), staged, reservation.allocated)
            header["copy_s"] = time.perf_counter() - t0
            self.stats["staged"] += 1
            return None
        if "ipc" not in header:
            return None
        buffer = reservation.buffer
        try:
            if self.ipc is None or not buffer.is_cuda:
                raise IpcError("this worker takes no CUDA IPC")
            # Behind the buffer's allocation (what used its memory before is done), not the steps since.
            start, copied = self.ipc.copy_into(buffer, header["ipc"], reservation.allocated, timing=True,
                                               owner=str(header.get("prefill_worker_id", "")))
        except RuntimeError as e:  # IpcError, or CUDA refusing the peer's memory: the bytes come instead
            return f"{REFUSED}: {e}"
        t0 = time.perf_counter()
        await asyncio.to_thread(copied.synchronize)
        header["copy_s"] = time.perf_counter() - t0  # for the timeline's log line
        header["copy_gpu_s"] = start.elapsed_time(copied) / 1e3
        self.stats["ipc"] += 1
        return None

    def _import(self, offer: KvHandoffOffer, reservation, pushed: bool = False) -> None:
        """The pages are in the reservation's buffer: the step loop writes them into its blocks."""
        self.stats["imports"] += 1
        self.stats["ipc"] += pushed  # (_copy_in counted the pulls)
        self.stats["pushed"] += pushed
        self.stats["bytes"] += nbytes_of(reservation.buffer)
        req = offer.request
        self.imported.append(req.request_id)
        self.step_loop.submit(ImportCommand(req.request_id, req.reply_to, offer.first_token, offer.seed,
                                            offer.num_cached_tokens))

    async def _on_direct(self, header: dict, staged=None) -> dict:
        """Pages and offer in one frame, into blocks reserved at the scheduler's prepare."""
        rid = header.get("request_id")
        reservation = self._prepared_reservation(rid)
        if reservation is None:
            return {"error": "no reserved blocks for this request (expired or aborted)"}
        try:
            offer = decode(KvHandoffOffer, header.get("offer") or b"")
        except Exception as e:  # a malformed header refuses this frame only
            return {"error": f"bad offer: {e}"}
        pages = reservation.skip_blocks + reservation.buffer.shape[0]
        if offer.request.request_id != rid or offer.num_pages != pages or self._check(offer):
            return {"error": self._check(offer) or "the pages do not fit the reserved blocks"}
        pushed = "pushed" in header
        if pushed and (not reservation.hold_until or header["pushed"] != nbytes_of(reservation.buffer)):
            return {"error": "pages pushed into a slot this reservation never announced"}
        refused = await self._copy_in(header, reservation, staged)
        if refused:
            return {"error": refused}
        if self._prepared_reservation(rid) is not reservation:
            return {"error": "the reservation ended while its pages were copied"}
        _, expiry = self.prepared.pop(rid)
        expiry.cancel()
        self.stats["direct"] += 1
        self._import(offer, reservation, pushed)
        return {"ok": True}

    def abort(self, request_ids: list[str]) -> None:
        """Aborts of requests still waiting for their pages drop the reservation at once (the step
        loop's AbortCommand frees the blocks)."""
        wanted = set(request_ids)
        for rid in wanted & self.prepared.keys():
            self.prepared.pop(rid)[1].cancel()
        for tid, (offer, _, expiry) in list(self.waiting.items()):
            if offer.request.request_id in wanted:
                expiry.cancel()
                del self.waiting[tid]


def _resolve(future: asyncio.Future, result) -> None:
    if not future.done():
        future.set_result(result)
