"""Scheduler entry point: flags → config → logging → NATS (waiting for it) → serve → drain on SIGTERM."""

from __future__ import annotations

import argparse
import asyncio

from shared import hop_trace
from shared.config import (CONFIG_ERROR_EXIT, NatsConfig, RouterConfig, add_nats_tls_flags, env_default,
                           nats_tls_settings)
from shared.logging import get_logger, setup_logging
from shared.service_run import run_service

log = get_logger("scheduler")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    d = RouterConfig.__dataclass_fields__
    ap = argparse.ArgumentParser(prog="inferno scheduler",
                                 description="Run one Inferno scheduler replica (several may share a NATS server).")
    ap.add_argument("--nats-url", default=env_default("INFERNO_NATS_URL", "nats://127.0.0.1:4222"))
    add_nats_tls_flags(ap)
    ap.add_argument("--subject-prefix", default=env_default("INFERNO_SUBJECT_PREFIX", "inferno"))
    ap.add_argument("--heartbeat-ttl", type=float, default=d["heartbeat_ttl"].default,
                    help="seconds without a heartbeat before a worker is dropped")
    ap.add_argument("--max-waiting", type=int, default=d["max_waiting"].default,
                    help="requests waiting per worker before new ones get 429")
    ap.add_argument("--overload-kv-usage", type=float, default=d["overload_kv_usage"].default,
                    help="KV usage above which a worker is passed over (and loses its sessions)")
    ap.add_argument("--affinity-bucket", default=d["affinity_bucket"].default,
                    help="JetStream KV bucket of session → worker")
    ap.add_argument("--affinity-ttl", type=float, default=d["affinity_ttl"].default,
                    help="seconds a session mapping lives after its last write")
    ap.add_argument("--disagg-min-prefill-tokens", type=int, default=d["disagg_min_prefill_tokens"].default,
                    help="with prefill workers present, prompts with fewer uncached tokens are prefilled by "
                         "their decode worker")
    ap.add_argument("--disagg-max-prefill-queue-tokens", type=int,
                    default=d["disagg_max_prefill_queue_tokens"].default,
                    help="a decode worker prefills a prompt itself while every prefill worker has more tokens "
                         "than this queued (0: no bound)")
    ap.add_argument("--disagg-by-time", action=argparse.BooleanOptionalAction, default=d["disagg_by_time"].default,
                    help="a decode worker also prefills a prompt itself when its first token comes sooner that "
                         "way by a margin (both sides' queues and reported prompt rates, the recent hand-off time); "
                         "for hand-offs over a slow link")
    ap.add_argument("--max-queue-seconds", type=float, default=d["max_queue_seconds"].default,
                    help="answer 429 at once when a request's estimated queueing time passes this (0: no bound)")
    ap.add_argument("--admission-tokens-per-second", type=float, default=d["admission_tokens_per_second"].default,
                    help="prompt tokens per second a worker's queue drains, until learnt from its heartbeats")
    ap.add_argument("--scheduler-id", default=None)
    ap.add_argument("--log-format", choices=["console", "json"], default=env_default("INFERNO_LOG_FORMAT", "console"))
    ap.add_argument("--log-level", default=env_default("INFERNO_LOG_LEVEL", "INFO"))
    return ap.parse_args(argv)


async def serve(cfg: RouterConfig, nats_cfg: NatsConfig) -> int:
    from services.scheduler.service import Scheduler

    return await run_service(nats_cfg, cfg.scheduler_id, lambda conn: Scheduler(cfg, conn))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging("scheduler", json=args.log_format == "json", level=args.log_level)
    hop_trace.enable("scheduler")
    kwargs = dict(heartbeat_ttl=args.heartbeat_ttl, max_waiting=args.max_waiting,
                  overload_kv_usage=args.overload_kv_usage, affinity_bucket=args.affinity_bucket,
                  affinity_ttl=args.affinity_ttl, disagg_min_prefill_tokens=args.disagg_min_prefill_tokens,
                  disagg_max_prefill_queue_tokens=args.disagg_max_prefill_queue_tokens,
                  disagg_by_time=args.disagg_by_time,
                  max_queue_seconds=args.max_queue_seconds,
                  admission_tokens_per_second=args.admission_tokens_per_second)
    if args.scheduler_id:
        kwargs["scheduler_id"] = args.scheduler_id
    try:
        cfg = RouterConfig(**kwargs)
        nats_cfg = NatsConfig(url=args.nats_url, subject_prefix=args.subject_prefix, **nats_tls_settings(args))
    except ValueError as e:
        log.error("bad_config", error=str(e))
        return CONFIG_ERROR_EXIT
    return asyncio.run(serve(cfg, nats_cfg))
