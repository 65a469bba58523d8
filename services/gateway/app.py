"""The gateway's state and its aiohttp application: routes, middlewares, NATS subscriptions."""

from __future__ import annotations

import asyncio
import contextlib
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Awaitable, Callable, Coroutine

from aiohttp import web

from services.gateway.auth import auth_middleware
from services.gateway.chat import handle_chat
from services.gateway.completions import handle_completions
from services.gateway.errors import ApiError, invalid, unavailable
from services.gateway.logprobs import TokenTexts
from services.gateway.metrics import GatewayMetrics
from services.gateway.schemas import GenerationSpec, Limits
from services.gateway.serving import GATEWAY
from services.gateway.tokenize import handle_detokenize, handle_tokenize
from services.gateway.token_router import StreamFailed, TokenRouter
from services.gateway.worker_health import HEARTBEAT_TTL, WorkerHealth
from services.worker.engine.model_config import ModelConfig
from shared.chat_template import ChatTemplateError
from shared.config import GatewayConfig
from shared.logging import get_logger
from shared.messages import AbortRequest, TokenBatch, WorkerHeartbeat
from shared.nats_client import NatsConnection
from shared.subjects import DEFAULT_PREFIX, Subjects
from shared.tokenizer import Tokenizer

WATCH_INTERVAL = 0.25  # how often in-flight requests are checked against worker heartbeats

log = get_logger("gateway.app")


class Gateway:
    """Everything one gateway process owns: the tokenizer, the inbox router, the worker table,
    the metrics and (once connected) the NATS connection."""

    def __init__(self, cfg: GatewayConfig, tokenizer: Tokenizer, *, max_model_len: int, vocab_size: int,
                 subject_prefix: str = DEFAULT_PREFIX, heartbeat_ttl: float = HEARTBEAT_TTL):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.limits = Limits(cfg.model_name, max_model_len, vocab_size, cfg.max_n)
        self.subjects = Subjects(subject_prefix)
        self.inbox = self.subjects.gateway_inbox(cfg.gateway_id)
        self.router = TokenRouter()
        self.health = WorkerHealth(ttl=heartbeat_ttl)
        self.metrics = GatewayMetrics(self.health)
        self.texts = TokenTexts(tokenizer)
        self.created = int(time.time())
        self.conn: NatsConnection | None = None  # set once the inbox and heartbeats are subscribed
        self.draining = False
        # Tokenization and chat templates run here, never on the event loop.
        self.executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="gateway-tokenize")
        self._tasks: set[asyncio.Task] = set()
        self._subscriptions: list[Any] = []

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        self.spawn(self._watch_workers())

    async def attach(self, conn: NatsConnection) -> None:
        """Subscribe to this gateway's inbox and to heartbeats, then accept generation requests."""
        self._subscriptions.append(await conn.subscribe(self.inbox, TokenBatch, self.router.on_batch,
                                                        pending_msgs_limit=1 << 20))
        self._subscriptions.append(await conn.subscribe(self.subjects.heartbeat, WorkerHeartbeat,
                                                        self.health.on_heartbeat))
        self.conn = conn
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

    async def _watch_workers(self) -> None:
        """Fail the requests of workers that went silent: their tokens are not coming."""
        while True:
            await asyncio.sleep(WATCH_INTERVAL)
            # One set lookup per request in the common case (every worker fresh): this sweep runs
            # over every request in flight, four times a second.
            fresh = self.health.heard_within_ttl()
            for stream in self.router.streams():
                if stream.failed:
                    continue
                for worker in stream.workers.values():
                    if worker not in fresh and self.health.is_silent(worker, stream.started):
                        log.warning("worker_silent", worker_id=worker)
                        self.router.fail(stream, StreamFailed(
                            503, f"worker {worker} stopped responding; the request was not completed"))
                        break

    # -- tokenization ---------------------------------------------------------------------------

    async def tokenize(self, spec: GenerationSpec) -> list[int]:
        if isinstance(spec.prompt, list):
            return spec.prompt
        loop = asyncio.get_running_loop()
        tok = self.tokenizer

        # encode_batch, not encode: only the batch call releases the GIL while the Rust code runs,
        # so a long prompt never stalls the event loop (a 1 MB prompt takes a second or two).
        def chat() -> list[int]:
            text = tok.apply_chat_template(spec.messages, spec.add_generation_prompt, spec.tools)
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


# ---------------------------------------------------------------------------------------------
# Small routes and middlewares.

async def handle_health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def handle_ready(request: web.Request) -> web.Response:
    # Answered here rather than raised, so that probes do not count as request errors.
    gw: Gateway = request.app[GATEWAY]
    if gw.draining:
        return unavailable("the gateway is shutting down").response()
    if gw.conn is None or not gw.conn.connected:
        return unavailable("the gateway is not connected to NATS").response()
    ready = gw.health.ready()
    if not ready:
        return unavailable("no worker is ready").response()
    return web.json_response({"status": "ready", "workers": len(ready)})


async def handle_models(request: web.Request) -> web.Response:
    gw: Gateway = request.app[GATEWAY]
    card = {"id": gw.limits.model_name, "object": "model", "created": gw.created, "owned_by": "inferno",
            "root": gw.limits.model_name, "max_model_len": gw.limits.max_model_len}
    return web.json_response({"object": "list", "data": [card]})


async def handle_metrics(request: web.Request) -> web.Response:
    gw: Gateway = request.app[GATEWAY]
    body, content_type = gw.metrics.render()
    return web.Response(body=body, headers={"Content-Type": content_type})


def _from_http(e: web.HTTPException, request: web.Request, max_body_bytes: int) -> ApiError:
    if e.status == 413:
        return ApiError(413, f"The request body exceeds the limit of {max_body_bytes} bytes.",
                        code="request_too_large")
    if e.status in (404, 405):
        return ApiError(e.status, f"{e.reason}: {request.method} {request.path[:256]}", code="not_found")
    return ApiError(e.status, e.reason or "HTTP error")


def error_middleware(gw: Gateway) -> Callable:
    """Every error becomes an OpenAI-shaped JSON body; nothing escapes to aiohttp's HTML pages."""

    @web.middleware
    async def errors(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        try:
            return await handler(request)
        except ApiError as e:
            err = e
        except web.HTTPException as e:
            if e.status < 400:
                raise
            err = _from_http(e, request, gw.cfg.max_body_bytes)
        except Exception:
            log.exception("handler_failed", path=request.path)
            err = ApiError(500, "internal error", type="server_error")
        gw.metrics.request_errors.labels(status=str(err.status)).inc()
        return err.response()

    return errors


def build_app(cfg: GatewayConfig, conn: NatsConnection | None, tokenizer: Tokenizer, *,
              subject_prefix: str | None = None, model_config: ModelConfig | None = None,
              heartbeat_ttl: float = HEARTBEAT_TTL) -> web.Application:
    """The gateway's aiohttp app. `conn` may be None and attached later with
    `app[GATEWAY].attach(conn)` (the entry point connects in the background)."""
    mc = model_config or ModelConfig.from_path(cfg.model_dir)
    prefix = subject_prefix or (conn.cfg.subject_prefix if conn is not None else DEFAULT_PREFIX)
    gw = Gateway(cfg, tokenizer, max_model_len=mc.max_model_len, vocab_size=mc.vocab_size,
                 subject_prefix=prefix, heartbeat_ttl=heartbeat_ttl)
    app = web.Application(client_max_size=cfg.max_body_bytes,
                          middlewares=[error_middleware(gw), auth_middleware(cfg.api_keys)])
    app[GATEWAY] = gw

    def generation(handler: Callable) -> Callable:
        async def refuse_while_draining(request: web.Request) -> web.StreamResponse:
            if gw.draining:
                raise unavailable("the gateway is shutting down")
            return await handler(request)
        return refuse_while_draining

    app.router.add_get("/health", handle_health)
    app.router.add_get("/ready", handle_ready)
    app.router.add_get("/metrics", handle_metrics)
    app.router.add_get("/v1/models", handle_models)
    app.router.add_post("/v1/completions", generation(handle_completions))
    app.router.add_post("/v1/chat/completions", generation(handle_chat))
    app.router.add_post("/tokenize", handle_tokenize)
    app.router.add_post("/detokenize", handle_detokenize)

    async def on_startup(app: web.Application) -> None:
        gw.start()
        if conn is not None:
            await gw.attach(conn)

    async def on_cleanup(app: web.Application) -> None:
        await gw.close()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


async def start_server(app: web.Application, host: str, port: int,
                       shutdown_timeout: float = 30.0) -> tuple[web.AppRunner, web.TCPSite]:
    """Serve `app`; handlers are cancelled when their client disconnects (that is how an abandoned
    request is noticed and aborted on its worker at once)."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=shutdown_timeout)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner, site


def bound_port(runner: web.AppRunner) -> int:
    """The port actually bound (for port 0)."""
    for addr in runner.addresses:
        if isinstance(addr, tuple):
            return addr[1]
    raise RuntimeError("the server is not listening on a TCP port")
