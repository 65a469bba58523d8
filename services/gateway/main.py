"""The gateway's entry point: flags and environment → config → logging → models → serve → drain."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import time

from services.gateway.app import build_app, start_server
from services.gateway.catalogue import ServedModel, default_name
from services.gateway.gateway import Gateway
from services.gateway.nats_api import NatsApi
from services.gateway.tenants import TenantsFile
from shared import hop_trace
from shared.config import (CONFIG_ERROR_EXIT, GatewayConfig, NatsConfig, add_nats_tls_flags, env_default,
                           nats_tls_settings, parse_bool, parse_csv)
from shared.gc_tuning import tune_gc
from shared.logging import get_logger, setup_logging
from shared.nats_client import connect_nats
from shared.subjects import DEFAULT_PREFIX

DEFAULT_MAX_BODY_BYTES = 1 << 20
# Allocations between young collections (CPython's default: 700). The per-token path makes
# short-lived objects by the thousand per step; most die before a collection at this threshold.

log = get_logger("gateway.main")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="inferno gateway",
                                description="OpenAI-compatible gateway of Inferno: HTTP, and the same API over NATS.")
    p.add_argument("--nats-url", default=env_default("INFERNO_NATS_URL", "nats://127.0.0.1:4222"),
                   help="NATS server(s), comma-separated (env INFERNO_NATS_URL)")
    add_nats_tls_flags(p)
    p.add_argument("--subject-prefix", default=DEFAULT_PREFIX)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model-dir", action="append", required=True,
                   help="a model directory (tokenizer files and config.json) or .gguf file; repeatable, one per "
                        "served model, the first being the default (more are learnt from workers' heartbeats)")
    p.add_argument("--model-name", action="append", default=[],
                   help="the served id of the --model-dir in the same position (default: the directory's name, "
                        "a .gguf file's without .gguf)")
    p.add_argument("--api-key", action="append", default=[],
                   help="an accepted API key (repeatable; also env INFERNO_API_KEYS, comma-separated)")
    p.add_argument("--api-keys-file", default=env_default("INFERNO_API_KEYS_FILE", None),
                   help="JSON or YAML file of tenants (limits, prefix-cache sharing) and their keys "
                        "(services/gateway/tenants.py; env INFERNO_API_KEYS_FILE)")
    p.add_argument("--share-prefix-cache", action="store_true",
                   help="with --api-keys-file: let all tenants share prefix-cache blocks (default: each its own)")
    p.add_argument("--metrics-token", default=env_default("INFERNO_METRICS_TOKEN", ""),
                   help="/metrics answers to 'Authorization: Bearer <this token>' only, not to the API keys "
                        "(a Prometheus scrape needs no tenant key; env INFERNO_METRICS_TOKEN)")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds for a whole request (a request's x-timeout header may ask for less)")
    p.add_argument("--first-token-timeout", type=float, default=120.0)
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds that in-flight requests get to finish on SIGTERM")
    p.add_argument("--log-requests", action="store_true",
                   default=env_default("INFERNO_LOG_REQUESTS", False, parse_bool),
                   help="log one line per finished request (its tokens and seconds); off by default: at a "
                        "thousand requests a second the lines cost the gateway more than the requests' metrics")
    p.add_argument("--heartbeat-ttl", type=float, default=3.0,
                   help="seconds without a worker's heartbeat after which its requests move to another worker "
                        "(no token yet) or fail; as the scheduler's --heartbeat-ttl")
    p.add_argument("--heartbeat-interval", type=float, default=1.0,
                   help="seconds between this gateway's heartbeats; a worker that misses them for its "
                        "--gateway-ttl ends this gateway's requests")
    p.add_argument("--tool-call-parser", choices=["auto", "hermes", "llama3_json", "mistral"],
                   default=env_default("INFERNO_TOOL_CALL_PARSER", "auto"),
                   help="how the served model writes tool calls (vLLM's names); auto: from its chat template")
    p.add_argument("--stream-interval", type=int, default=env_default("INFERNO_STREAM_INTERVAL", 1, int),
                   help="streamed tokens per server-sent event (default 1, as SGLang's --stream-interval): "
                        "N > 1 writes each stream once per N tokens, for less gateway CPU per token; the first "
                        "token and the end still go out at once")
    p.add_argument("--reuse-port", action="store_true", default=env_default("INFERNO_REUSE_PORT", False, parse_bool),
                   help="share --port with other gateway processes (SO_REUSEPORT: the kernel spreads the "
                        "connections over them; `inferno up --api-server-count N` starts N so)")
    p.add_argument("--gateway-id", default=None, help="this gateway's id on NATS (default: random)")
    p.add_argument("--log-format", choices=("console", "json"), default=env_default("INFERNO_LOG_FORMAT", None),
                   help="default: console on a terminal, else json")
    p.add_argument("--log-level", default=env_default("INFERNO_LOG_LEVEL", "INFO"))
    return p.parse_args(argv)


def load_tenants(args: argparse.Namespace) -> TenantsFile | None:
    if not args.api_keys_file:
        return None
    try:
        return TenantsFile.load(args.api_keys_file)
    except (OSError, ValueError) as e:
        raise ValueError(f"--api-keys-file: {e}") from None


def served_models(dirs: list[str], names: list[str]) -> list[tuple[str, str]]:
    """(name, dir) per --model-dir: the i-th --model-name names the i-th directory."""
    if len(names) > len(dirs):
        raise ValueError(f"{len(names)} --model-name for {len(dirs)} --model-dir: each name names the "
                         "directory in its position")
    return [(names[i] if i < len(names) else default_name(d), d) for i, d in enumerate(dirs)]


def make_config(args: argparse.Namespace) -> tuple[GatewayConfig, NatsConfig]:
    keys = tuple(args.api_key) + env_default("INFERNO_API_KEYS", (), parse_csv)
    extra = {"gateway_id": args.gateway_id} if args.gateway_id else {}
    (name, model_dir), *more = served_models(args.model_dir, args.model_name)
    cfg = GatewayConfig(model_name=name, model_dir=model_dir, more_models=tuple(more), host=args.host, port=args.port,
                        api_keys=tuple(dict.fromkeys(keys)), metrics_token=args.metrics_token,
                        max_body_bytes=args.max_body_bytes,
                        request_timeout=args.request_timeout, first_token_timeout=args.first_token_timeout,
                        share_prefix_cache=args.share_prefix_cache, log_requests=args.log_requests,
                        heartbeat_ttl=args.heartbeat_ttl, heartbeat_interval=args.heartbeat_interval,
                        stream_interval=args.stream_interval,
                        tool_call_parser=args.tool_call_parser, reuse_port=args.reuse_port, **extra)
    return cfg, NatsConfig(url=args.nats_url, subject_prefix=args.subject_prefix, **nats_tls_settings(args))


async def _connect_forever(gw: Gateway, nats_api: NatsApi, nats_cfg: NatsConfig) -> None:
    # Waits for the server forever; a reconnect ends the requests in flight (Gateway.on_bus_state).
    conn = await connect_nats(nats_cfg, f"gateway-{gw.cfg.gateway_id}", on_state=gw.on_bus_state)
    await gw.attach(conn)
    await nats_api.start(conn)


async def serve(cfg: GatewayConfig, nats_cfg: NatsConfig, models: list[ServedModel], drain_timeout: float,
                tenants: TenantsFile | None = None) -> None:
    gw = Gateway(cfg, models=models, subject_prefix=nats_cfg.subject_prefix, heartbeat_ttl=cfg.heartbeat_ttl,
                 tenants=tenants)
    app = build_app(gw)
    nats_api = NatsApi(gw)
    # HTTP first: /health answers at once, /ready says 503 until NATS and a worker are there.
    runner, site = await start_server(app, cfg.host, cfg.port, shutdown_timeout=drain_timeout,
                                      reuse_port=cfg.reuse_port)
    tune_gc()
    log.info("gateway_listening", host=cfg.host, port=cfg.port, models=[m.name for m in models],
             gateway_id=cfg.gateway_id,
             auth=bool(gw.keys), tenants=len(gw.keys.tenants))
    connecting = gw.spawn(_connect_forever(gw, nats_api, nats_cfg))

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()

    log.info("gateway_draining", in_flight=gw.router.in_flight)
    gw.draining = True
    await nats_api.stop_accepting()  # the other replicas take new NATS requests
    await site.stop()  # no new connections
    deadline = time.monotonic() + drain_timeout
    while gw.router.in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if gw.router.in_flight:
        log.warning("gateway_drain_timeout", in_flight=gw.router.in_flight)
    connecting.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await connecting
    conn = gw.conn
    await nats_api.close()
    await runner.cleanup()
    if conn is not None:
        await conn.drain()
    log.info("gateway_stopped")


def _run(coro) -> None:
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
        return
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(coro)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    hop_trace.enable("gateway")
    json_logs = None if args.log_format is None else args.log_format == "json"
    try:
        cfg, nats_cfg = make_config(args)
        tenants = load_tenants(args)
    except ValueError as e:
        print(f"inferno gateway: {e}")
        return CONFIG_ERROR_EXIT
    setup_logging("gateway", json=json_logs, level=args.log_level)
    models = []
    for name, model_dir in cfg.models:
        try:
            models.append(ServedModel.load(name, model_dir, max_n=cfg.max_n, tool_call_parser=cfg.tool_call_parser))
        except (OSError, ValueError) as e:
            log.error("model_dir_unusable", model=name, model_dir=model_dir, error=str(e))
            return CONFIG_ERROR_EXIT
    _run(serve(cfg, nats_cfg, models, args.drain_timeout, tenants))
    return 0
