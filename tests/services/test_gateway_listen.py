"""The gateway's listening socket takes a whole burst of connections: its accept queue (what `ss`
shows as a listener's Send-Q) is the kernel's limit, not aiohttp's 128. A burst that overflows it
has its handshakes resent after 1, 2, 4, 8 s, so a busy moment of the gateway's event loop became
first tokens 55 s late and failed requests on a four-GPU host (services/gateway/app.py)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from aiohttp import web

from services.gateway.app import LISTEN_BACKLOG, bound_port, start_server


def listen_queue(port: int) -> int:
    """The accept-queue limit of the listener on `port` (ss's Send-Q column for a LISTEN socket)."""
    out = subprocess.run(["ss", "-Hltn", f"sport = :{port}"], capture_output=True, text=True, check=True).stdout
    return int(out.split()[2])


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2)")
async def test_the_gateway_listens_with_the_kernels_whole_accept_queue():
    runner, _ = await start_server(web.Application(), "127.0.0.1", 0)
    try:
        somaxconn = int(Path("/proc/sys/net/core/somaxconn").read_text())
        assert listen_queue(bound_port(runner)) == min(LISTEN_BACKLOG, somaxconn) > 128
    finally:
        await runner.cleanup()
