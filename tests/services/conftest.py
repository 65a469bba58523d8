"""Fixtures for service tests against a real nats-server (the server itself: tests/conftest.py)."""

from __future__ import annotations

import uuid

import pytest

from shared.config import NatsConfig
from shared.nats_client import connect_nats


@pytest.fixture
def nats_config(nats_server) -> NatsConfig:
    """Settings for the test's server, with a unique subject prefix and fast reconnects."""
    return NatsConfig(url=nats_server.url, subject_prefix=f"t{uuid.uuid4().hex[:8]}", connect_timeout=1.0,
                      request_timeout=2.0, reconnect_time_wait=0.05, reconnect_jitter=0.1, drain_timeout=2.0)


@pytest.fixture
async def nats_conn(nats_config):
    """A connected NatsConnection, drained at the end of the test."""
    conn = await connect_nats(nats_config, "test", wait=10.0)
    try:
        yield conn
    finally:
        await conn.close()
