"""structlog setup shared by every service: JSON lines in production, readable lines in a terminal.

Our own loggers (`get_logger`) go straight through structlog, filtered at `level`; records from
libraries that use the standard `logging` module (nats, aiohttp, asyncio) are rendered by the same
processors, at WARNING and above. Values bound with `structlog.contextvars.bind_contextvars`
(request_id, ...) appear in every line logged in that context.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

_HANDLER_FLAG = "_inferno_handler"


class _NamedWriteLogger(structlog.WriteLogger):
    """structlog's WriteLogger with the name given to get_logger(), for add_logger_name."""

    def __init__(self, file: Any, name: str | None):
        super().__init__(file)
        self.name = name


def _add_logger_name(logger: Any, method_name: str, event_dict: dict) -> dict:
    name = getattr(logger, "name", None)
    if name:
        event_dict.setdefault("logger", name)
    return event_dict


def _add_service(service: str):
    def add_service(logger: Any, method_name: str, event_dict: dict) -> dict:
        event_dict.setdefault("service", service)
        return event_dict
    return add_service


def setup_logging(service: str, json: bool | None = None, level: str | int = "INFO",
                  library_level: str | int = "WARNING", stream: Any = None) -> None:
    """Configure structlog and stdlib logging for one service process (safe to call again).

    json=None picks JSON unless stderr is a terminal.
    """
    stream = stream if stream is not None else sys.stderr
    if json is None:
        json = not (hasattr(stream, "isatty") and stream.isatty())
    level_no = logging.getLevelName(level.upper()) if isinstance(level, str) else level
    if not isinstance(level_no, int):
        raise ValueError(f"unknown log level {level!r}")

    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        _add_service(service),
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if json:
        renderer: Any = structlog.processors.JSONRenderer()
        tail: list[Any] = [structlog.processors.format_exc_info, renderer]
    else:
        # plain_traceback: no local variables in terminal logs (they can hold prompts).
        renderer = structlog.dev.ConsoleRenderer(colors=hasattr(stream, "isatty") and stream.isatty(),
                                                 exception_formatter=structlog.dev.plain_traceback)
        tail = [renderer]

    structlog.configure(
        processors=[*shared, _add_logger_name, structlog.processors.StackInfoRenderer(), *tail],
        wrapper_class=structlog.make_filtering_bound_logger(level_no),
        logger_factory=lambda *args: _NamedWriteLogger(stream, args[0] if args else None),
        # Not cached: a later setup_logging() (tests, reconfiguration) reaches loggers made earlier.
        cache_logger_on_first_use=False,
    )

    # Library records (stdlib logging) through the same processors.
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *tail],
    )
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    handler.addFilter(_not_tls_close_noise)
    setattr(handler, _HANDLER_FLAG, True)
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, _HANDLER_FLAG, False)]:
        root.removeHandler(old)
    root.addHandler(handler)
    lib_level = logging.getLevelName(library_level.upper()) if isinstance(library_level, str) else library_level
    root.setLevel(lib_level)
    logging.captureWarnings(True)


def _not_tls_close_noise(record: logging.LogRecord) -> bool:
    """False for asyncio's warning at every close of nats-py's TLS connection (its protocol's
    eof_received returns True, which asyncio's SSL transport cannot honour): nothing is wrong, and
    each service would say it at every stop on a bus with TLS."""
    return not (record.name == "asyncio" and record.getMessage().startswith("returning true from eof_received()"))


def get_logger(name: str | None = None, **initial_values: Any) -> Any:
    """A lazy structlog logger (usable before setup_logging); `name` appears as the `logger` key."""
    if name is None:
        return structlog.get_logger(**initial_values)
    return structlog.get_logger(name, **initial_values)
