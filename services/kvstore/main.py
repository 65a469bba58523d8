"""kvstore entry point: flags → config → logging → NATS (waiting for it) → serve → drain on SIGTERM."""

from __future__ import annotations

import argparse
import asyncio

from services.kvstore.config import GIB, KvStoreConfig
from shared.config import CONFIG_ERROR_EXIT, NatsConfig, add_nats_tls_flags, env_default, nats_tls_settings
from shared.kv_transfer import init_ucx
from shared.logging import get_logger, setup_logging
from shared.service_run import run_service

log = get_logger("kvstore")

PIN_CHOICES = {"auto": None, "on": True, "off": False}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    d = KvStoreConfig.__dataclass_fields__
    ap = argparse.ArgumentParser(prog="inferno kvstore",
                                 description="Run the KV page store (one per subject prefix).")
    ap.add_argument("--nats-url", default=env_default("INFERNO_NATS_URL", "nats://127.0.0.1:4222"))
    add_nats_tls_flags(ap)
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
    # Pinned pages need a CUDA context (518 MiB of GPU 0 on an H200) and moved no faster: put and get,
    # host and GPU pages, 16-376 MiB, two H200s, 2026-11-28 (bench/kvstore_bench.py).
    ap.add_argument("--pin-memory", choices=list(PIN_CHOICES), default="off",
                    help="page-locked host pages (auto: when a CUDA device is present); they cost a CUDA context")
    ap.add_argument("--log-format", choices=["console", "json"], default=env_default("INFERNO_LOG_FORMAT", "console"))
    ap.add_argument("--log-level", default=env_default("INFERNO_LOG_LEVEL", "INFO"))
    return ap.parse_args(argv)


async def serve(cfg: KvStoreConfig, nats_cfg: NatsConfig) -> int:
    from services.kvstore.service import KvStore

    # The kvstore computes on no GPU: its UCX progress thread makes no CUDA context on GPU 0 (it
    # must still see the GPUs: with none visible UCX found no protocol for a worker's GPU pages).
    init_ucx(cuda_context=False)
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
        nats_cfg = NatsConfig(url=args.nats_url, subject_prefix=args.subject_prefix, **nats_tls_settings(args))
    except ValueError as e:
        log.error("bad_config", error=str(e))
        return CONFIG_ERROR_EXIT
    return asyncio.run(serve(cfg, nats_cfg))
