"""The worker service: NATS in and out around the step thread that owns the engine of the model it
serves (services/worker/model_manager.py attaches and detaches that model)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import defaultdict
from typing import Callable

import structlog

from services.worker.compile_watch import CompileWatch
from services.worker.engine.cuda_device import bind_thread
from services.worker.engine.cuda_ipc import IpcExporter, IpcImporter, host_id
from services.worker.engine.step_outputs import StepOutputs
from services.worker.grammar import GrammarError, Grammars
from services.worker.handoff import HandoffSender
from services.worker.handoff_receiver import HandoffReceiver
from services.worker.heartbeat import heartbeat_period, worker_heartbeat
from services.worker.host_staging import HostStaging
from services.worker.kv_snapshot import SNAPSHOT_TTL, KvMirror
from services.worker.step_loop import AbortCommand, AddCommand, InsertCachedCommand, Rejected, StepLoop
from services.worker.token_batches import token_batches
from shared import hop_trace, subjects
from shared.config import WorkerServiceConfig
from shared.handoff_messages import KvHandoffOffer, KvHandoffReady, KvHandoffReply
from shared.kv_transfer import TransferClient
from shared.messages import AbortRequest, GenerateRequest, KvEvents, RouteReply, TokenBatch, TokenDelta
from shared.wire import encode

log = structlog.get_logger("worker")

# The scheduler routes by what each worker holds and how busy it is. An agent sends its next turn
# the moment the last one ends, so a step that finishes requests sends its new KV blocks and load
# before the final tokens (NATS keeps one connection's messages in order): the scheduler knows
# them before the client can send again. At most one such update per window; KV events of other
# steps go out within the window too, rather than at the next periodic heartbeat.
PROMPT_UPDATE_WINDOW = 0.01  # seconds

# A request taken this recently may still be on its way into the queue (a grammar compiling, a
# prefix fetch): the model counts as busy, so an eviction never takes it from under that request.
ADMIT_WINDOW = 1.0  # seconds
STORE_WARM_S = 5.0  # seconds a model's readiness waits for the cluster store's warm-up at most

_NOT_SERVING = {"no_model": "the worker has no model loaded", "loading": "the worker is loading its model",
                "unloading": "the worker is unloading its model"}


class WorkerService:
    def __init__(self, cfg: WorkerServiceConfig, conn, prefix: str):
        self.cfg = cfg
        self.conn = conn
        self.prefix = prefix
        self.block_size = cfg.block_size
        self.generate_subject = subjects.worker_generate(prefix, cfg.worker_id)
        self.abort_subject = subjects.worker_abort(prefix, cfg.worker_id)
        self.handoff_subject = subjects.worker_handoff(prefix, cfg.worker_id)
        # What the worker serves: set by the model manager through set_state/attach/detach.
        self.state = "no_model"
        self.model_name = ""
        self.model_dir = ""  # where the model came from (heartbeats: a gateway may read its tokenizer there)
        self.host = ""  # the worker process's id when this is one of its model slots (model_host.py)
        self.max_model_len = 0
        # A standby model's requests, taken and held while the host brings the model back (on_wake);
        # released into the queue once it serves, failed if it cannot be loaded.
        self.parked: dict[str, GenerateRequest] = {}
        self.on_wake: Callable[[], None] | None = None
        self.last_used = time.monotonic()  # the last request taken: the host evicts the least recent
        self.loop_thread: StepLoop | None = None  # the attached model's step thread
        # Triton compiles while serving (a step waits for each) are warnings: the warm-up missed them.
        self.compile_watch = CompileWatch(serving=self._settled)
        self.sender: HandoffSender | None = None  # prefill role
        self.receiver: HandoffReceiver | None = None  # decode role
        self.transfer_server = None
        self._transfer_client: TransferClient | None = None
        self.cluster_cache = None  # the cluster KV store's client side, when one is used
        self.grammars: Grammars | None = None  # structured outputs' compiler, of the attached model
        self.on_first_token: Callable[[], None] | None = None  # once, after a model is attached
        self.draining = False
        self.gateways = None  # a GatewayWatch: this worker's requests of a gateway gone silent are ended
        self._orphans: set[str] = set()  # requests already ended for that (their abort on its way)
        self.seq = 0
        self.kv_seq = 0
        self.kv_mirror = KvMirror()  # what the KV events announced, for the JetStream snapshots
        self._snapshots = None  # their bucket, opened at the first put
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task] = []
        self._pending_events: tuple[list, list] = ([], [])
        self._events_flush: asyncio.TimerHandle | None = None
        self._load_update: asyncio.TimerHandle | None = None
        self._load_update_at = 0.0

    # -- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self.conn.subscribe(self.generate_subject, GenerateRequest, self._on_generate)
        await self.conn.subscribe(self.abort_subject, AbortRequest, self._on_abort)
        if self.cfg.role == "decode":
            await self.conn.subscribe(self.handoff_subject, KvHandoffOffer, self._on_offer, concurrency=64)
            await self.conn.subscribe(subjects.worker_handoff_prepare(self.prefix, self.cfg.worker_id),
                                      GenerateRequest, self._on_prepare)
        elif self.cfg.role == "prefill":
            await self.conn.subscribe(subjects.worker_handoff_ready(self.prefix, self.cfg.worker_id),
                                      KvHandoffReady, self._on_ready)
        self._tasks.append(asyncio.create_task(self._heartbeats()))
        log.info("worker started", worker_id=self.cfg.worker_id, subject=self.generate_subject, state=self.state)

    async def drain(self, timeout: float) -> None:
        """Stop taking work, let in-flight requests finish, abort what is left at the deadline."""
        self.draining = True
        await self._publish_heartbeat()
        await self.finish_requests(timeout, "the worker is shutting down")
        await self.detach()
        for task in self._tasks:
            task.cancel()
        if self._transfer_client is not None:
            await self._transfer_client.close()

    # -- the model (called by the model manager, on the event loop) ------------------------------
    async def set_state(self, state: str, model_name: str) -> None:
        """What the heartbeats say; the change goes out at once, so no request is routed here
        while no model serves, and the first one comes as soon as one does."""
        changed = (state, model_name) != (self.state, self.model_name)
        self.state, self.model_name = state, model_name
        if changed:
            log.info("worker state", state=state, model=model_name)
            await self._publish_load()

    def attach(self, engine, eos_token_ids, max_model_len: int, model_name: str,
               background: Callable[[], bool] | None = None, tokenizer_source: str = "") -> None:
        """Serve `engine` from a new step thread; `background` runs there between steps until it
        returns False (the CUDA graphs left to capture). `tokenizer_source`: the model directory or
        GGUF file whose vocabulary structured outputs' grammars are compiled against."""
        self.model_name, self.max_model_len = model_name, max_model_len
        if self.grammars is not None:
            self.grammars.close()
        # The model-free emitter (--emit-only) has no model config, and no structured outputs.
        model_config = getattr(engine, "model_config", None)
        self.grammars = (Grammars(tokenizer_source, model_config.vocab_size, eos_token_ids,
                                  self.cfg.grammar_compile_timeout) if tokenizer_source and model_config else None)
        self.loop_thread = StepLoop(engine, self._on_outputs, eos_token_ids, self._on_kv_events, self._on_handoff)
        self.loop_thread.background = background
        if self.cfg.device.startswith("cuda"):  # Triton compiles on the GPU only (the CPU path runs torch)
            self.compile_watch.install()
        # UCX moves the KV pages from this thread: the GPU it works on must be the engine's.
        bind_thread(getattr(engine, "device", None))
        self._start_handoff()
        self._start_cluster_cache()
        self.loop_thread.start()
        asyncio.ensure_future(self._clear_kv_index())  # the scheduler's view of this worker's cache

    def busy(self) -> bool:
        """Requests taken and not ended (running, queued, waiting for the model): an eviction waits."""
        lt = self.loop_thread
        if self.parked or time.monotonic() - self.last_used < ADMIT_WINDOW:
            return True
        return lt is not None and (bool(lt.reply_to) or not lt.commands.empty())

    def _settled(self) -> bool:
        """Serving with nothing left to warm: a model attached, its deferred graphs captured and its
        sampler's kernels compiled."""
        loop_thread = self.loop_thread
        if loop_thread is None or loop_thread.background is not None or self.state != "ready":
            return False
        sampler = getattr(loop_thread.engine, "sampler", None)
        return sampler is None or sampler.kernels_ready

    async def finish_requests(self, timeout: float, reason: str) -> None:
        """Let the model's requests run up to `timeout` seconds (0: none), then end the rest with
        an error the gateway turns into an OpenAI error for the client."""
        loop_thread = self.loop_thread
        if loop_thread is None:
            return
        if self.receiver is not None:
            self.receiver.accepting = False
        deadline = time.monotonic() + timeout
        while loop_thread.engine.has_unfinished() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = list(loop_thread.reply_to)
        if not left:
            return
        log.warning("aborting requests", count=len(left), reason=reason)
        inboxes = {rid: loop_thread.reply_to.get(rid, "") for rid in left}
        loop_thread.submit(AbortCommand(left))
        if self.sender is not None:
            await self.sender.forward_aborts(left)
        await self._send_ends(inboxes, reason)

    async def _send_ends(self, inboxes: dict[str, str], error: str) -> None:
        """Each request's end, aborted with `error`, to its gateway's inbox (one batch an inbox)."""
        batches = defaultdict(list)
        for rid, inbox in inboxes.items():
            if inbox:
                batches[inbox].append(TokenDelta(request_id=rid, finish_reason="abort", error=error))
        for inbox, deltas in batches.items():
            await self.conn.publish(inbox, TokenBatch.of(self.cfg.worker_id, deltas))

    async def detach(self) -> None:
        """Stop the model's step thread and everything built around it; its engine is the
        caller's to free."""
        loop_thread, self.loop_thread = self.loop_thread, None
        if loop_thread is None:
            return
        loop_thread.stop()
        await asyncio.to_thread(loop_thread.join)
        if self.transfer_server is not None:
            await self.transfer_server.close()
        if self.receiver is not None and self.receiver.ipc is not None:
            self.receiver.ipc.close()  # the prefill workers' buffers it mapped
        if self.sender is not None and self.sender.pusher is not None:
            self.sender.pusher.close()  # the decode workers' receive buffers it mapped
        if self.cluster_cache is not None:
            await self.cluster_cache.close()
        self.sender = self.receiver = self.transfer_server = self.cluster_cache = None
        self.max_model_len = 0
        await self._clear_kv_index()

    def _page_layout(self) -> tuple[str, int]:
        from services.worker.engine.kv_pages import page_bytes, page_layout

        engine = self.loop_thread.engine
        return (page_layout(self.model_name, engine.model_config, self.block_size, engine.kv_dtype),
                page_bytes(engine.model_config, self.block_size, engine.kv_dtype))

    def _transfer(self) -> TransferClient:
        if self._transfer_client is None:
            self._transfer_client = TransferClient()
        return self._transfer_client

    def _start_cluster_cache(self) -> None:
        """Prompt blocks to the cluster KV store and prefixes from it (auto: a GPU worker fetches
        when one answers and that pays, a CPU worker leaves it alone; `on`: every worker fetches and
        writes back)."""
        engine = self.loop_thread.engine
        on_gpu = self.cfg.device.startswith("cuda")
        # A CPU worker's steps and the store's machinery share the host's cores, a cost the fetch
        # and put estimates cannot see. On the 2-core VM, W4's later turns waited 65 ms (p50 of 4
        # runs) against 30-36 without the store, with nothing written to it: the endpoint, UCX's
        # threads and the probes alone slowed every event loop of the stack (issue 42).
        if (self.cfg.kvstore == "off" or (self.cfg.kvstore == "auto" and not on_gpu)
                or not hasattr(engine, "kv_cache")
                or not getattr(engine, "holds_whole_kv", True)):  # a parallel group's ranks each hold a part
            return
        from services.worker.cluster_cache import ClusterCache
        from shared.kvstore_client import KvStoreClient

        layout, size = self._page_layout()
        self.cluster_cache = ClusterCache(KvStoreClient(self.conn, self._transfer(), self.prefix), layout, size,
                                          self.block_size, self.model_name,
                                          write_back="off" if self.cfg.kvstore == "auto" else "on",
                                          on_gpu=on_gpu)
        self.cluster_cache.start()
        if self.cluster_cache.write_back != "off":  # else the steps need not look at first tokens at all
            engine.prompt_sink = self.cluster_cache
        self.loop_thread.on_step = self.cluster_cache.note_step

    async def store_warm(self, timeout: float = STORE_WARM_S) -> None:
        """Wait (bounded) for the cluster store's warm-up: UCXX's import holds the GIL for ~0.5 s and
        the probe times the first get; a model that says it is ready then serves its first requests
        without either beside their steps."""
        warming = self.cluster_cache.warming if self.cluster_cache is not None else None
        if warming is not None:
            await asyncio.wait([warming], timeout=timeout)

    def _start_handoff(self) -> None:
        """The prefill role pushes KV pages, the decode role listens for them (UCXX)."""
        role = self.cfg.role
        if role == "mixed" or not hasattr(self.loop_thread.engine, "kv_cache"):
            return
        from shared.kv_transfer import TransferServer

        layout, size = self._page_layout()
        # CUDA IPC between this host's GPU workers, unless told to move bytes as between hosts.
        ipc = self.loop_thread.engine.kv_cache.pool.is_cuda and self.cfg.handoff_ipc
        staging = HostStaging()  # pageable: never pinned while serving (host_staging.py)
        if role == "prefill":
            self.sender = HandoffSender(self.conn, self.prefix, self.cfg.worker_id, layout, size,
                                        self._transfer(), self.cfg.handoff_timeout,
                                        IpcExporter() if ipc else None, host_id(),
                                        IpcImporter() if ipc else None, staging, self.cfg.handoff_staging)
        else:
            self.receiver = HandoffReceiver(self.loop_thread, layout, size, "", self.cfg.handoff_timeout,
                                            self.conn.publish, self.prefix, self.cfg.worker_id,
                                            IpcImporter() if ipc else None, host_id(),
                                            IpcExporter() if ipc and self.cfg.handoff_push else None,
                                            grammars=lambda: self.grammars, staging=staging)
            self.transfer_server = TransferServer(self.receiver.on_frame, self.receiver.allocate,
                                                  host=self.cfg.transfer_host).start()
            self.receiver.address = self.transfer_server.address

    # -- NATS handlers (event loop) ---------------------------------------------------------------
    def _on_generate(self, msg: GenerateRequest) -> RouteReply:
        """Acknowledge at once (the scheduler waits for it); the step thread does the rest."""
        if hop_trace.TRACE is not None:
            hop_trace.TRACE.mark(msg.request_id, "wk_in")
        if self.draining:
            return RouteReply.rejected(503, "service_unavailable", "the worker is draining", 1.0)
        self.last_used = time.monotonic()
        loop_thread = self.loop_thread
        if self.state == "standby" and self.on_wake is not None and msg.model in ("", self.model_name):
            self.parked[msg.request_id] = msg  # it waits here, not in a step, while the model loads
            self.on_wake()
            return RouteReply.accepted(self.cfg.worker_id)
        if self.state != "ready" or loop_thread is None:
            return RouteReply.rejected(503, "service_unavailable", _NOT_SERVING.get(self.state, "not ready"), 1.0)
        if msg.model and msg.model != self.model_name:  # routed just before a replace: the scheduler retries
            return RouteReply.rejected(503, "service_unavailable",
                                       f"the worker serves {self.model_name!r}, not {msg.model!r}", 1.0)
        handoff = bool(msg.decode_worker_id) and self.sender is not None
        if handoff:
            self.sender.remember(msg)
        add = AddCommand(msg.request_id, msg.prompt_token_ids, msg.sampling.to_params(), msg.reply_to,
                         msg.cache_salt.encode(), handoff)
        if msg.sampling.grammar_kind:
            asyncio.ensure_future(self._add_after_compile(loop_thread, add, msg))
        else:
            self._admit(loop_thread, add, msg)
        return RouteReply.accepted(self.cfg.worker_id)

    def release_parked(self) -> None:
        """The model serves again: the requests that waited for it join its queue, in arrival order."""
        parked, self.parked = self.parked, {}
        for msg in parked.values():
            reply = self._on_generate(msg)
            if not reply.ok:
                self._fail(msg, reply.error_message or "the model could not take the request")

    def fail_parked(self, reason: str) -> None:
        """The model could not be brought back: its waiting requests end with `reason`."""
        parked, self.parked = self.parked, {}
        for msg in parked.values():
            self._fail(msg, reason)

    def _fail(self, msg: GenerateRequest, reason: str) -> None:
        if msg.reply_to:
            delta = TokenDelta(request_id=msg.request_id, finish_reason="abort", error=reason)
            asyncio.ensure_future(self.conn.publish(msg.reply_to, TokenBatch.of(self.cfg.worker_id, [delta])))

    def _admit(self, loop_thread: StepLoop, add: AddCommand, msg: GenerateRequest) -> None:
        cache = self.cluster_cache
        held = msg.store_cached_tokens  # by the scheduler's index of the store; -1: unknown
        bs = self.block_size
        if (cache is not None and cache.worth_asking and msg.num_prompt_tokens > 2 * bs
                and (held < 0 or held >= 2 * bs)):
            # Decided here, not in the fetch's task: a request whose worker already holds what the
            # store has goes to the step queue now, not an event-loop turn later (when it may miss
            # the next step and wait a whole one).
            hashes = cache.prompt_hashes(add.prompt_token_ids, msg.cache_salt)
            local = loop_thread.engine.block_manager.num_cached_prefix(hashes)
            held_blocks = None if held < 0 else held // bs
            want = (len(hashes) if held_blocks is None else held_blocks) - local
            if want > 0 and cache.pays(want, ask=held_blocks is None):
                asyncio.ensure_future(self._add_after_fetch(loop_thread, cache, add, hashes, local, held_blocks))
                return
        self._queue(loop_thread, add)  # the store holds nothing more of it (or nothing that pays): no round trip

    @staticmethod
    def _queue(loop_thread: StepLoop, add: AddCommand) -> None:
        if hop_trace.TRACE is not None:
            hop_trace.TRACE.mark(add.request_id, "wk_queued")
        loop_thread.submit(add)

    async def _add_after_compile(self, loop_thread: StepLoop, add: AddCommand, msg: GenerateRequest) -> None:
        """A structured output's grammar, compiled on a thread (cached by its text), then the request
        is queued with its matcher; a grammar that does not compile fails this request alone."""
        try:
            if self.grammars is None:
                raise GrammarError("this worker has no vocabulary to compile grammars against")
            add.matcher = await self.grammars.matcher(msg.sampling.grammar_kind, msg.sampling.grammar)
        except GrammarError as e:
            self._publish_outputs([Rejected(add.request_id, add.reply_to, str(e), e.param)], [add.reply_to], False)
            return
        self._admit(loop_thread, add, msg)

    async def _add_after_fetch(self, loop_thread: StepLoop, cache, add: AddCommand, hashes: list[bytes],
                               local: int, held: int | None) -> None:
        """Fetch the part of the prompt's prefix that the cluster store holds and this worker does
        not (`local` blocks of `hashes` it has), then queue the request."""
        try:
            fetched = await cache.fetch(hashes, local, held)
            if fetched is not None:
                loop_thread.submit(InsertCachedCommand(*fetched))
        except Exception:  # the store is an optimisation: the request goes on without it
            log.exception("prefix fetch failed", request_id=add.request_id)
        finally:
            self._queue(loop_thread, add)

    async def _on_abort(self, msg: AbortRequest) -> None:
        rids = list(msg.request_ids)
        for rid in rids:
            self.parked.pop(rid, None)
        if self.loop_thread is not None:
            self.loop_thread.submit(AbortCommand(rids))
        if self.receiver is not None:
            self.receiver.abort(rids)
        if self.sender is not None:
            await self.sender.forward_aborts(rids)

    async def _on_offer(self, offer: KvHandoffOffer) -> KvHandoffReply:
        if self.receiver is None:
            return KvHandoffReply(accepted=False, reason=_NOT_SERVING.get(self.state, "the decode worker is not ready"))
        return await self.receiver.on_offer(offer)

    def _on_prepare(self, msg: GenerateRequest) -> None:
        if self.receiver is not None:
            self.receiver.on_prepare(msg)

    async def _on_ready(self, msg: KvHandoffReady) -> None:
        if self.sender is not None:
            await self.sender.on_ready(msg)

    # -- outputs (called on the step thread) ------------------------------------------------------
    def _on_outputs(self, outputs, routes: list[str], finished: bool) -> None:
        """`finished`: some request ended this step, freeing load the scheduler should know of."""
        # Packed on the event loop: it runs while the step thread waits on the GPU (GIL released).
        self._loop.call_soon_threadsafe(self._publish_outputs, outputs, routes, finished)

    def _on_handoff(self, output) -> None:
        """A prefill finished: its first token is in this step's outputs; hand the rest on."""
        sender = self.sender
        if sender is not None:
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(sender.send(output)))
        else:
            output.handoff.done()

    def _on_kv_events(self, stored: list, removed: list) -> None:
        self._loop.call_soon_threadsafe(self._queue_kv_events, stored, removed)

    def _publish_outputs(self, outputs, routes: list[str], finished: bool) -> None:
        """`outputs`: a step's StepOutputs, or a list of Rejected adds; `routes`: each row's inbox."""
        if self.on_first_token is not None and isinstance(outputs, StepOutputs) and outputs.any_tokens:
            self.on_first_token, first = None, self.on_first_token
            first()
        if finished:
            self._load_changed()
            if self.sender is not None and self.sender.pending:
                done = [o.request_id for o in outputs.ended() if o.finished]
                if done:
                    asyncio.ensure_future(self.sender.finished_here(done))
        if hop_trace.TRACE is not None and isinstance(outputs, StepOutputs):
            for rid in outputs.request_ids:
                hop_trace.TRACE.mark_first(rid, "wk_out")  # its first token, not every one
        for subject, batch in token_batches(self.cfg.worker_id, outputs, routes):
            asyncio.ensure_future(self.conn.publish_encoded(subject, encode(batch), TokenBatch.TYPE))

    def _load_changed(self) -> None:
        wait = self._load_update_at + PROMPT_UPDATE_WINDOW - time.monotonic()
        if wait <= 0:
            self._send_load_update()
        elif self._load_update is None:
            self._load_update = self._loop.call_later(wait, self._send_load_update)

    def _send_load_update(self) -> None:
        if self._load_update is not None:
            self._load_update.cancel()
            self._load_update = None
        self._load_update_at = time.monotonic()
        asyncio.ensure_future(self._publish_load())

    def _queue_kv_events(self, stored, removed) -> None:
        self._pending_events[0].extend(stored)
        self._pending_events[1].extend(removed)
        if len(self._pending_events[0]) + len(self._pending_events[1]) >= 256:
            asyncio.ensure_future(self._flush_kv_events())
        elif self._events_flush is None:
            self._events_flush = self._loop.call_later(
                PROMPT_UPDATE_WINDOW, lambda: asyncio.ensure_future(self._flush_kv_events()))

    async def _flush_kv_events(self, cleared: bool = False) -> None:
        if self._events_flush is not None:
            self._events_flush.cancel()
            self._events_flush = None
        stored, removed = self._pending_events
        if not stored and not removed and not cleared:
            return
        self._pending_events = ([], [])
        self.kv_seq += 1
        self.kv_mirror.apply(self.kv_seq, stored, removed, cleared)
        await self.conn.publish(subjects.kv_events(self.prefix), KvEvents(
            worker_id=self.cfg.worker_id, seq=self.kv_seq, stored=stored, removed=removed, cleared=cleared))

    async def _clear_kv_index(self) -> None:
        """A model came or went: the prefix cache here starts empty (events of the old one still
        queued go out first, then the clear)."""
        try:
            await self._flush_kv_events()
            await self._flush_kv_events(cleared=True)
        except Exception:  # NATS down: the scheduler resyncs at the next seq gap
            log.debug("kv clear not sent", exc_info=True)

    # -- heartbeats -------------------------------------------------------------------------------
    async def _heartbeats(self) -> None:
        snapshot: asyncio.Future | None = None
        manifest_due = bool(self.cfg.kernel_manifest) and self.cfg.device.startswith("cuda")
        while True:
            await self._publish_load()
            self._end_orphans()
            if manifest_due and self._settled():  # every start-up compile is done: what a fresh start needs
                manifest_due = False
                from services.worker.kernel_manifest import save
                held = await asyncio.to_thread(save, self.cfg.kernel_manifest)
                log.info("kernel manifest written", manifest=self.cfg.kernel_manifest, kernels=held)
            # Beside the beats, never in their way: a put waits for JetStream's ack (seconds while NATS is away).
            if (snapshot is None or snapshot.done()) and self.kv_mirror.due(time.monotonic()) and self.conn.connected:
                snapshot = asyncio.ensure_future(self._put_kv_snapshot())
            await asyncio.sleep(heartbeat_period(self.cfg))

    def _end_orphans(self) -> None:
        """End the requests whose gateway went silent (gateway_watch.py): no one reads their tokens."""
        silent = self.gateways.silent() if self.gateways is not None else None
        if not silent:
            return
        lt = self.loop_thread
        routes = list(lt.reply_to.items()) if lt is not None else []
        routes += [(rid, msg.reply_to) for rid, msg in list(self.parked.items())]
        orphans = {rid for rid, inbox in routes if inbox in silent}
        new = orphans - self._orphans
        self._orphans = orphans  # those still here next time are not ended twice
        if new:
            log.warning("gateway silent, its requests ended", requests=len(new), gateways=sorted(silent))
            asyncio.ensure_future(self._end_orphans_now(sorted(new), {rid: inbox for rid, inbox in routes}))

    async def _end_orphans_now(self, rids: list[str], inboxes: dict[str, str]) -> None:
        """Abort them here, and tell their inboxes: a gateway that was only slow to beat then ends its
        streams with an error instead of waiting for tokens that will not come."""
        await self._on_abort(AbortRequest(request_ids=rids, reason="gateway silent"))
        with contextlib.suppress(Exception):  # NATS away: nobody reads them anyway
            await self._send_ends({rid: inboxes[rid] for rid in rids}, "its gateway stopped sending heartbeats")

    async def _put_kv_snapshot(self) -> None:
        """The announced prefix-cache blocks into JetStream every few seconds while they change (and
        at half the bucket's TTL while they do not); a failed put is tried again a minute later."""
        now = time.monotonic()
        try:
            if self._snapshots is None:
                self._snapshots = await self.conn.kv_bucket(subjects.kv_snapshot_bucket(self.prefix), ttl=SNAPSHOT_TTL)
            await self.kv_mirror.put(self._snapshots, self.cfg.worker_id, now)
        except Exception:
            self.kv_mirror.put_at = now + SNAPSHOT_TTL  # retried later; routing only loses a late scheduler's view
            log.debug("kv snapshot not put", exc_info=True)

    async def _publish_load(self) -> None:
        """KV events, then the heartbeat: the load never arrives without the blocks behind it."""
        try:
            await self._flush_kv_events()
            await self._publish_heartbeat()
        except Exception:  # NATS down: the connection reconnects by itself; the next beat tries again
            log.debug("heartbeat not sent", exc_info=True)

    async def _publish_heartbeat(self) -> None:
        self.seq += 1
        await self.conn.publish(subjects.heartbeat(self.prefix), worker_heartbeat(self))
