"""Logging setup: JSON lines with the service, level and bound context; library records at WARNING."""

from __future__ import annotations

import io
import json
import logging

import structlog

from shared.logging import get_logger, setup_logging


def lines(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_json_lines_carry_service_level_logger_and_context():
    out = io.StringIO()
    setup_logging("gateway", json=True, level="INFO", stream=out)
    log = get_logger("services.gateway.app")
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(request_id="chatcmpl-1")
    try:
        log.info("request_done", tokens=12)
        log.debug("hidden")
    finally:
        structlog.contextvars.clear_contextvars()
    log.warning("after")
    (first, second) = lines(out)
    assert first["event"] == "request_done" and first["tokens"] == 12
    assert first["service"] == "gateway" and first["level"] == "info"
    assert first["request_id"] == "chatcmpl-1" and first["logger"] == "services.gateway.app"
    assert "timestamp" in first
    assert second["event"] == "after" and "request_id" not in second


def test_library_records_go_through_the_same_renderer_at_warning():
    out = io.StringIO()
    setup_logging("worker", json=True, stream=out)
    lib = logging.getLogger("nats.aio.client")
    lib.info("chatter")
    lib.warning("slow consumer on %s", "x.y")
    (record,) = lines(out)
    assert record["event"] == "slow consumer on x.y"
    assert record["level"] == "warning" and record["logger"] == "nats.aio.client" and record["service"] == "worker"


def test_asyncio_s_warning_at_each_close_of_a_tls_connection_is_dropped():
    out = io.StringIO()
    setup_logging("gateway", json=True, stream=out)
    asyncio_log = logging.getLogger("asyncio")
    asyncio_log.warning("returning true from eof_received() has no effect when using ssl")
    asyncio_log.warning("Executing <Task> took 0.2 seconds")
    (record,) = lines(out)
    assert record["event"] == "Executing <Task> took 0.2 seconds"


def test_exceptions_are_rendered_in_json():
    out = io.StringIO()
    setup_logging("scheduler", json=True, stream=out)
    try:
        1 / 0
    except ZeroDivisionError:
        get_logger("x").exception("boom")
    (record,) = lines(out)
    assert record["level"] == "error" and "ZeroDivisionError" in record["exception"]


def test_console_mode_and_reconfiguration():
    out = io.StringIO()
    setup_logging("gateway", json=False, stream=out)
    get_logger("x").info("hello", n=1)
    text = out.getvalue()
    assert "hello" in text and "n=1" in text and not text.startswith("{")
    assert sum(1 for h in logging.getLogger().handlers if getattr(h, "_inferno_handler", False)) == 1
    setup_logging("gateway", json=False, stream=out)  # again: still one handler
    assert sum(1 for h in logging.getLogger().handlers if getattr(h, "_inferno_handler", False)) == 1
