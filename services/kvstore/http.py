"""The kvstore's HTTP side: /health (liveness, with the figures an operator looks at first) and /metrics."""

from __future__ import annotations

from typing import Callable

from aiohttp import web

from services.kvstore.metrics import KvStoreMetrics


async def start_http(host: str, port: int, metrics: KvStoreMetrics, health: Callable[[], dict]) -> web.AppRunner:
    async def get_health(request: web.Request) -> web.Response:
        return web.json_response(health())

    async def get_metrics(request: web.Request) -> web.Response:
        body, content_type = metrics.render()
        return web.Response(body=body, headers={"Content-Type": content_type})

    app = web.Application()
    app.router.add_get("/health", get_health)
    app.router.add_get("/metrics", get_metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner

