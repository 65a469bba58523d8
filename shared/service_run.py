"""The life of a NATS service process: connect (forever, but a signal still ends it), start, wait for
SIGTERM/SIGINT, stop (drain), close the connection."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable
from typing import Protocol

from shared.config import NatsConfig
from shared.logging import get_logger
from shared.nats_client import NatsConnection, connect_nats

log = get_logger(__name__)


class Service(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...


async def run_service(nats_cfg: NatsConfig, name: str, make: Callable[[NatsConnection], Service]) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    connecting = asyncio.create_task(connect_nats(nats_cfg, name=name))
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({connecting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if not connecting.done():
        # Said first: a connect being retried may take its time to unwind once cancelled (a SIGTERMed
        # scheduler took > 15 s under a full test run's load, and its stop went unlogged).
        log.info("stopped_before_connecting", service=name)
        connecting.cancel()
        with contextlib.suppress(asyncio.CancelledError, asyncio.TimeoutError):
            await asyncio.wait_for(connecting, timeout=2.0)
        return 0
    conn = connecting.result()
    service = make(conn)
    await service.start()
    await stopping
    log.info("draining", service=name)
    await service.stop()
    await conn.drain()
    return 0
