"""The gateway's state, whatever the transport: served models, inbox router, worker table, metrics, keys,
NATS connection. HTTP (app.py) and the NATS API (nats_api.py) both serve requests through it."""

from __future__ import annotations

import asyncio
import contextlib
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Coroutine, Sequence

from services.gateway.auth import ApiKeys
from services.gateway.catalogue import Catalogue, ServedModel
from services.gateway.tenancy import Tenancy
from services.gateway.tenants import TenantsFile
from services.gateway.errors import invalid
from services.gateway.logprobs import TokenTexts
from services.gateway.metrics import GatewayMetrics
from services.gateway.model_discovery import ModelDiscovery
from services.gateway.schemas import GenerationSpec, Limits, TokenizeSpec
from services.gateway.token_router import RequestStream, StreamFailed, TokenRouter
from services.gateway.worker_health import HEARTBEAT_TTL, WorkerHealth
from shared.chat_template import ChatTemplateError
from shared.config import GatewayConfig
from shared.logging import get_logger
from shared.messages import AbortRequest, GatewayHeartbeat, TokenBatch, WorkerHeartbeat
from shared.nats_client import NatsConnection
from shared.subjects import DEFAULT_PREFIX, Subjects
from shared.tokenizer import Tokenizer

WATCH_INTERVAL = 0.25  # how often in-flight requests are checked against worker heartbeats

log = get_logger("gateway")


class Gateway:
    """Everything one gateway process owns: the served models, the inbox router, the worker table,
    the metrics, the API keys and (once connected) the NATS connection.

    `models`: every model served from the start, the default first. Without them, the one model
    cfg.model_name names, from `tokenizer` and its sizes (the one-model form)."""

    def __init__(self, cfg: GatewayConfig, tokenizer: Tokenizer | None = None, *, max_model_len: int = 0,
                 vocab_size: int = 0, models: Sequence[ServedModel] = (), subject_prefix: str = DEFAULT_PREFIX,
                 heartbeat_ttl: float = HEARTBEAT_TTL, tenants: TenantsFile | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.cfg = cfg
        if not models:
            if tokenizer is None:
                raise ValueError("a Gateway needs its models, or the one model's tokenizer")
            models = [ServedModel.of(cfg.model_name, cfg.model_dir, tokenizer, max_model_len=max_model_len,
                                     vocab_size=vocab_size, max_n=cfg.max_n, tool_call_parser=cfg.tool_call_parser)]
        self.catalogue = Catalogue(models)
        self.keys = ApiKeys(cfg.api_keys, tenants)
        self.subjects = Subjects(subject_prefix)
        self.inbox = self.subjects.gateway_inbox(cfg.gateway_id)
        self.router = TokenRouter()
        self.health = WorkerHealth(ttl=heartbeat_ttl)
        self.metrics = GatewayMetrics(self.health)
        self.tenancy = Tenancy(self.keys, cfg.share_prefix_cache, self.metrics.registry, clock)
        self.created = int(time.time())
        self.conn: NatsConnection | None = None  # set once the inbox and heartbeats are subscribed
        self._bus_lost = False  # the NATS connection went down: requests in flight then may have lost tokens
        self.draining = False
        # Tokenization and chat templates run here, never on the event loop.
        self.executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="gateway-tokenize")
        self._tasks: set[asyncio.Task] = set()
        self._subscriptions: list[Any] = []
        self.discovery = ModelDiscovery(self.catalogue, self.executor, self.spawn, max_n=cfg.max_n,
                                        tool_call_parser=cfg.tool_call_parser)

    # The default model's parts, for code that serves one model (and the tests written for it).

    @property
    def tokenizer(self) -> Tokenizer:
        return self.catalogue.default.tokenizer

    @property
    def limits(self) -> Limits:
        return self.catalogue.default.limits

    @property
    def texts(self) -> TokenTexts:
        return self.catalogue.default.texts

    @property
    def tool_parser(self) -> str:
        return self.catalogue.default.tool_parser

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        self.health.on_restart = self._worker_restarted
        self.spawn(self._watch_workers())

    async def attach(self, conn: NatsConnection) -> None:
        """Subscribe to this gateway's inbox and to heartbeats, then accept generation requests."""
        self._subscriptions.append(await conn.subscribe(self.inbox, TokenBatch, self.router.on_batch,
                                                        pending_msgs_limit=1 << 20))
        self._subscriptions.append(await conn.subscribe(self.subjects.heartbeat, WorkerHeartbeat,
                                                        self._on_heartbeat))
        self.conn = conn
        self.spawn(self._beat(conn))
        log.info("gateway_attached", inbox=self.inbox)

    async def close(self) -> None:
        for sub in self._subscriptions:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subscriptions.clear()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.executor.shutdown(wait=False, cancel_futures=True)

    def spawn(self, coro: Coroutine) -> asyncio.Task:
        """A background task that is kept referenced until it ends, and cancelled on close."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def publish_abort(self, worker_id: str, msg: AbortRequest) -> None:
        conn = self.conn
        if conn is None:
            return
        try:
            await conn.publish(self.subjects.worker_abort(worker_id), msg)
        except Exception as e:  # the worker's own TTL-based cleanup is the fallback
            log.warning("abort_publish_failed", worker_id=worker_id, error=repr(e))

    async def _beat(self, conn: NatsConnection) -> None:
        """Tell the workers, every cfg.heartbeat_interval, that this gateway still reads its inbox (they
        end the requests of one gone silent: services/worker/gateway_watch.py)."""
        while True:
            try:
                await conn.publish(self.subjects.gateway_heartbeat, GatewayHeartbeat(
                    gateway_id=self.cfg.gateway_id, inbox=self.inbox, in_flight=len(self.router.streams())))
            except Exception as e:  # NATS away: the next beat goes after the reconnect
                log.debug("gateway_beat_failed", error=repr(e))
            await asyncio.sleep(self.cfg.heartbeat_interval)

    async def _watch_workers(self) -> None:
        """Requests of workers that went silent: their tokens are not coming, so a request that has
        no token yet is sent to another worker (Generation decides) and any other fails."""
        while True:
            await asyncio.sleep(WATCH_INTERVAL)
            # One set lookup per request in the common case (every worker fresh): this sweep runs
            # over every request in flight, four times a second.
            fresh = self.health.heard_within_ttl()
            for stream in self.router.streams():
                if stream.failed:
                    continue
                silent = [(rid, worker) for rid, worker in stream.workers.items()
                          if worker not in fresh and self.health.is_silent(worker, stream.started)]
                if silent:
                    log.warning("worker_silent", worker_ids=sorted({w for _, w in silent}))
                    self._lost(stream, silent, "stopped responding")

    def on_bus_state(self, connected: bool) -> None:
        """The NATS connection's state. Core NATS drops what is published to a subscriber while it is
        away, so after a reconnect every request in flight may have lost tokens on the way here,
        its last one included (then it would wait forever: 15 of 32 streams did when a server of
        three died under them, 2026-11-29). Each ends with a clean 503 now, its worker told to stop:
        a retry goes through the reconnected bus. Requests that began after the reconnect are whole."""
        if not connected:
            self._bus_lost = True
            return
        if not self._bus_lost:
            return  # the first connection
        self._bus_lost = False
        failed = 0
        for stream in self.router.streams():
            if not stream.failed:
                self.router.fail(stream, StreamFailed(
                    503, "the gateway's connection to NATS was interrupted and tokens of this request may "
                         "have been lost on the way; retry it"))
                failed += 1
        log.warning("nats_interrupted_requests_ended", requests=failed)

    def _on_heartbeat(self, hb: WorkerHeartbeat) -> None:
        self.health.on_heartbeat(hb)
        self.discovery.on_heartbeat(hb)

    def _worker_restarted(self, worker: str) -> None:
        """A worker came back as a new process: what the old one was running is gone."""
        log.warning("worker_restarted", worker_id=worker)
        for stream in self.router.streams():
            if not stream.failed:
                lost = [(rid, w) for rid, w in stream.workers.items() if w == worker]
                if lost:
                    self._lost(stream, lost, "restarted")

    def _lost(self, stream: RequestStream, lost: list[tuple[str, str]], why: str) -> None:
        """Requests whose worker is gone: each is sent elsewhere if it can be (no token shown yet),
        else the whole API request fails."""
        for rid, worker in lost:
            if stream.migrate is not None and stream.migrate(rid, worker):
                continue
            self.router.fail(stream, StreamFailed(503, f"worker {worker} {why}; the request was not completed"))
            return

    # -- answers every transport gives ------------------------------------------------------------

    def models(self) -> dict:
        """The body of GET /v1/models: every served model; `resident` when a live worker holds it on
        its GPU now (a model in standby is served too, after its worker has loaded it)."""
        resident = self.health.resident_models()
        return {"object": "list", "data": [
            {"id": m.name, "object": "model", "created": self.created, "owned_by": "inferno", "root": m.name,
             "max_model_len": m.limits.max_model_len, "resident": m.name in resident} for m in self.catalogue]}

    # -- tokenization ---------------------------------------------------------------------------

    async def tokenize(self, spec: GenerationSpec | TokenizeSpec, model: ServedModel | None = None) -> list[int]:
        """The prompt's ids under `model`'s tokenizer and chat template (default: the default model)."""
        if isinstance(spec.prompt, list):
            return spec.prompt
        loop = asyncio.get_running_loop()
        tok = (model or self.catalogue.default).tokenizer
        tools = spec.tools if isinstance(spec, TokenizeSpec) else (list(spec.tool_spec.tools) or None)

        # encode_batch, not encode: only the batch call releases the GIL while the Rust code runs,
        # so a long prompt never stalls the event loop (a 1 MB prompt takes a second or two).
        def chat() -> list[int]:
            text = tok.apply_chat_template(spec.messages, spec.add_generation_prompt, tools)
            return tok.encode_batch([text], add_special_tokens=False)[0]  # the template wrote bos

        def plain() -> list[int]:
            return tok.encode_batch([spec.prompt])[0]

        try:
            ids = await loop.run_in_executor(self.executor, chat if spec.messages is not None else plain)
        except ChatTemplateError as e:
            raise invalid(str(e), param="messages") from None
        if not ids:
            raise invalid("the prompt is empty after tokenization", param="messages" if spec.is_chat else "prompt")
        return ids
