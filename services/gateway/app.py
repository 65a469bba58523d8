"""The HTTP transport: the aiohttp application (routes, middlewares) over the gateway's request path."""

from __future__ import annotations

import functools
import json
import time
from typing import Awaitable, Callable

from aiohttp import web

from services.gateway.auth import check_bearer
from services.gateway.errors import ApiError, too_large, unavailable
from services.gateway.gateway import Gateway
from services.gateway.openapi import RouteDoc, document
from services.gateway.serving import CHAT, COMPLETIONS, Call, Endpoint, generate
from services.gateway.sse import SseWriter
from services.gateway.tenants import Tenant
from services.gateway.tokenize import detokenize, tokenize
from shared.logging import get_logger
from shared.nats_api import REQUEST_ID, SESSION_AFFINITY, TIMEOUT
from shared.nats_client import NatsConnection

log = get_logger("gateway.http")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
GENERATION_ERRORS = (400, 401, 404, 413, 429, 503, 504)
TENANT = web.RequestKey("tenant", Tenant)  # set by authentication


def error_response(err: ApiError) -> web.Response:
    return web.Response(status=err.status, headers=err.headers(), content_type="application/json",
                        body=err.json())


class HttpApi:
    """The route handlers of one gateway."""

    def __init__(self, gw: Gateway):
        self.gw = gw
        self.routes: list[tuple[RouteDoc, Handler]] = [
            (RouteDoc("GET", "/health", "health", "Liveness.", answer="Status", errors=(), open=True), self.health),
            # Open as /health: an orchestrator's readiness probe holds no key (Kubernetes' cannot read a Secret).
            (RouteDoc("GET", "/ready", "ready", "Readiness: NATS connected and a worker ready (or holding a model "
                      "in standby).", answer="Status",
                      errors=(503,), open=True), self.ready),
            (RouteDoc("GET", "/metrics", "metrics", "Prometheus metrics."), self.metrics),
            (RouteDoc("GET", "/openapi.json", "openapi", "This document.", answer="OpenApi", errors=(), open=True),
             self.openapi),
            (RouteDoc("GET", "/v1/models", "listModels", "The served models.", answer="ModelList"), self.models),
            (RouteDoc("POST", "/v1/completions", "createCompletion", "OpenAI completions.", body="CompletionRequest",
                      answer="Completion", streams=True, errors=GENERATION_ERRORS), self.completions),
            (RouteDoc("POST", "/v1/chat/completions", "createChatCompletion", "OpenAI chat completions.",
                      body="ChatCompletionRequest", answer="ChatCompletion", streams=True, errors=GENERATION_ERRORS),
             self.chat),
            (RouteDoc("POST", "/tokenize", "tokenize", "vLLM's /tokenize: the ids the model would see.",
                      body="TokenizeRequest", answer="Tokenized", errors=(400, 401, 404, 413)), self.tokenize),
            (RouteDoc("POST", "/detokenize", "detokenize", "vLLM's /detokenize: ids to text.",
                      body="DetokenizeRequest", answer="Detokenized", errors=(400, 401, 404, 413)), self.detokenize),
        ]
        self.open_paths = frozenset(doc.path for doc, _ in self.routes if doc.open)
        self._openapi: bytes | None = None
        self._openapi_models = 0  # the catalogue's size when the document was written

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        # Answered here rather than raised, so that probes do not count as request errors.
        gw = self.gw
        if gw.draining:
            return error_response(unavailable("the gateway is shutting down"))
        if gw.conn is None or not gw.conn.connected:
            return error_response(unavailable("the gateway is not connected to NATS"))
        serving = gw.health.serving()
        if not serving:
            return error_response(unavailable("no worker is ready"))
        return web.json_response({"status": "ready", "workers": len(serving)})

    async def metrics(self, request: web.Request) -> web.Response:
        body, content_type = self.gw.metrics.render()
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def openapi(self, request: web.Request) -> web.Response:
        models = self.gw.catalogue
        if self._openapi is None or self._openapi_models != len(models):  # written again when a model was added
            self._openapi = json.dumps(document([doc for doc, _ in self.routes], models.doc_limits())).encode()
            self._openapi_models = len(models)
        return web.Response(body=self._openapi, content_type="application/json")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(self.gw.models())

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(COMPLETIONS, request)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(CHAT, request)

    async def _generate(self, endpoint: Endpoint, request: web.Request) -> web.StreamResponse:
        arrival = time.monotonic()
        if self.gw.draining:
            raise unavailable("the gateway is shutting down")
        headers = request.headers
        call = Call(await request.read(), headers.get(SESSION_AFFINITY), headers.get(TIMEOUT),
                    headers.get(REQUEST_ID), arrival, request.get(TENANT))
        answer = await generate(self.gw, endpoint, call, functools.partial(SseWriter, request))
        if isinstance(answer, SseWriter):
            return answer.response
        return web.Response(body=answer, content_type="application/json", headers=call.rate_headers)

    async def tokenize(self, request: web.Request) -> web.Response:
        return web.json_response(await tokenize(self.gw, await request.read()))

    async def detokenize(self, request: web.Request) -> web.Response:
        return web.json_response(await detokenize(self.gw, await request.read()))

    # -- middlewares ----------------------------------------------------------------------------

    @web.middleware
    async def errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every error becomes an OpenAI-shaped JSON body; nothing escapes to aiohttp's HTML pages."""
        try:
            return await handler(request)
        except ApiError as e:
            err = e
        except web.HTTPException as e:
            if e.status < 400:
                raise
            err = self._from_http(e, request)
        except Exception:
            log.exception("handler_failed", path=request.path)
            err = ApiError(500, "internal error", type="server_error")
        self.gw.metrics.request_errors.labels(status=str(err.status)).inc()
        return error_response(err)

    @web.middleware
    async def authenticate(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        token = self.gw.cfg.metrics_token
        if token and request.path == "/metrics":  # its own token, not a tenant's key
            check_bearer(request.headers.get("Authorization"), token)
        elif request.path not in self.open_paths:  # liveness probes and the schema carry no credentials
            request[TENANT] = self.gw.keys.check(request.headers.get("Authorization"))
        return await handler(request)

    def _from_http(self, e: web.HTTPException, request: web.Request) -> ApiError:
        if e.status == 413:
            return too_large(self.gw.cfg.max_body_bytes)
        if e.status in (404, 405):
            return ApiError(e.status, f"{e.reason}: {request.method} {request.path[:256]}", code="not_found")
        return ApiError(e.status, e.reason or "HTTP error")


def build_app(gw: Gateway, conn: NatsConnection | None = None) -> web.Application:
    """The gateway's aiohttp app. Starting it starts the gateway (and attaches `conn`, when given;
    the entry point attaches one later, from the background); cleaning it up closes the gateway."""
    api = HttpApi(gw)
    app = web.Application(client_max_size=gw.cfg.max_body_bytes, middlewares=[api.errors, api.authenticate])
    for doc, handler in api.routes:
        app.router.add_route(doc.method, doc.path, handler)

    async def on_startup(app: web.Application) -> None:
        gw.start()
        if conn is not None:
            await gw.attach(conn)

    async def on_cleanup(app: web.Application) -> None:
        await gw.close()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


# The listen queue: a burst of connections (W2 opens 2,000 at once) that finds it full is not refused
# but has its handshakes resent after 1, 2, 4, 8, 16 s, and fails after ~60 s. aiohttp's default of 128
# did that on a four-GPU host whose gateway was busy for a moment: 207 of 2,000 requests failed, the
# p99 first token was 55 s. The kernel caps it at net.core.somaxconn (4,096 on current kernels).
LISTEN_BACKLOG = 4096


async def start_server(app: web.Application, host: str, port: int, shutdown_timeout: float = 30.0,
                       reuse_port: bool = False) -> tuple[web.AppRunner, web.TCPSite]:
    """Serve `app`; handlers are cancelled when their client disconnects (that is how an abandoned
    request is noticed and aborted on its worker at once). reuse_port: several gateway processes
    listen on the one port (SO_REUSEPORT), the kernel spreading the connections over them."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=shutdown_timeout)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_port=reuse_port or None, backlog=LISTEN_BACKLOG)
    await site.start()
    return runner, site


def bound_port(runner: web.AppRunner) -> int:
    """The port actually bound (for port 0)."""
    for addr in runner.addresses:
        if isinstance(addr, tuple):
            return addr[1]
    raise RuntimeError("the server is not listening on a TCP port")
