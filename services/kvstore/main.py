"""kvstore entry point: flags → config → logging → NATS (waiting for it) → serve → drain on SIGTERM."""

from __future__ import annotations

import argparse
import asyncio

from services.kvstore.config import GIB, KvStoreConfig
from shared.config import NatsConfig, env_default
from shared.logging import get_logger, setup_logging
from shared.service_run import run_service

log = get_logger("kvstore")

PIN_CHOICES = {"auto": None, "on": True, "off": False}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    d = KvStoreConfig.__dataclass_fields__
    ap = argparse.ArgumentParser(prog="inferno kvstore",
                                 description="Run the KV page store (one per subject prefix).")
    ap.add_argument("--nats-url", default=env_default("INFERNO_NATS_URL", "nats://127.0.0.1:4222"))
    ap.add_argument("--subject-prefix", default=env_default("INFERNO_SUBJECT_PREFIX", "inferno"))
    ap.add_argument("--capacity-gb", type=float, default=d["capacity_bytes"].default / GIB,
                    help="host memory for pages, in GiB")
    ap.add_argument("--lease-ttl", type=float, default=d["lease_ttl"].default,
                    help="seconds a put's reservation or a get's pins live without commit or release")
    ap.add_argument("--max-lease-ttl", type=float, default=d["max_lease_ttl"].default,
                    help="the longest lease a client may ask for")
    ap.add_argument("--ucx-host", default=d["ucx_host"].default,
                    help="the address workers dial for page data (the listener takes every interface)")
    ap.add_argument("--ucx-port", type=int, default=d["ucx_port"].default, help="0: any free port")
    ap.add_argument("--http-host", default=d["http_host"].default)
    ap.add_argument("--http-port", type=int, default=d["http_port"].default,
                    help="/health and /metrics; 0: no HTTP server")
    ap.add_argument("--pin-memory", choices=list(PIN_CHOICES), default="auto",
                    help="pinned host pages (auto: when a CUDA device is present)")
    ap.add_argument("--log-format", choices=["console", "json"], default=env_default("INFERNO_LOG_FORMAT", "console"))
    ap.add_argument("--log-level", default=env_default("INFERNO_LOG_LEVEL", "INFO"))
    return ap.parse_args(argv)


async def serve(cfg: KvStoreConfig, nats_cfg: NatsConfig) -> int:
    from services.kvstore.service import KvStore

    return await run_service(nats_cfg, "kvstore", lambda conn: KvStore(cfg, conn))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging("kvstore", json=args.log_format == "json", level=args.log_level)
    try:
        if not args.capacity_gb > 0:
            raise ValueError(f"--capacity-gb must be positive, got {args.capacity_gb}")
        cfg = KvStoreConfig(capacity_bytes=int(args.capacity_gb * GIB), lease_ttl=args.lease_ttl,
                            max_lease_ttl=args.max_lease_ttl, ucx_host=args.ucx_host, ucx_port=args.ucx_port,
                            http_host=args.http_host, http_port=args.http_port,
                            pin_memory=PIN_CHOICES[args.pin_memory])
        nats_cfg = NatsConfig(url=args.nats_url, subject_prefix=args.subject_prefix)
    except ValueError as e:
        log.error("bad_config", error=str(e))
        return 2
    return asyncio.run(serve(cfg, nats_cfg))
