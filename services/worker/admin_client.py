"""A worker's admin subjects from code (AdminClient) and from the command line:

  inferno load-model   --worker ID --model-dir DIR [--model-name NAME] [--mode drain|abort|add] [--memory-share F]
  inferno unload-model --worker ID [--mode drain|abort]
  inferno worker-status --worker ID

Each prints the worker's reply as JSON (what it serves afterwards; a load's breakdown) and exits 0
when it succeeded, 1 when the worker refused or failed, 2 when no worker answered.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys

from shared import subjects
from shared.admin_messages import (FINISH_MODES, LOAD_MODES, LoadModelRequest, UnloadModelRequest, WorkerAdminReply,
                                   WorkerStatusRequest)
from shared.config import NatsConfig, add_nats_tls_flags, env_default, nats_tls_settings
from shared.errors import ServiceError
from shared.logging import setup_logging
from shared.nats_client import NatsConnection, connect_nats

LOAD_TIMEOUT = 600.0  # seconds: a 70B model read from a cold drive takes minutes


class AdminClient:
    """Load, replace, unload and ask about the models of workers (request/reply on NATS)."""

    def __init__(self, conn: NatsConnection, prefix: str = subjects.DEFAULT_PREFIX):
        self.conn, self.prefix = conn, prefix

    async def load(self, worker_id: str, model_dir: str, model_name: str = "", *, mode: str = "drain",
                   drain_timeout: float = 30.0, dtype: str = "", max_model_len: int = 0, load_format: str = "",
                   memory_share: float = 0.0, timeout: float = LOAD_TIMEOUT) -> WorkerAdminReply:
        """Answered once the model serves (or with the error that stopped it). Mode "add": beside the
        worker's models, in a slot of its own (the reply's worker_id)."""
        req = LoadModelRequest(model_dir=model_dir, model_name=model_name, dtype=dtype, max_model_len=max_model_len,
                               load_format=load_format, mode=mode, drain_timeout=drain_timeout,
                               memory_share=memory_share)
        return await self._call(worker_id, "load", req, timeout + drain_timeout)

    async def unload(self, worker_id: str, *, mode: str = "drain", drain_timeout: float = 30.0,
                     timeout: float = 60.0) -> WorkerAdminReply:
        req = UnloadModelRequest(mode=mode, drain_timeout=drain_timeout)
        return await self._call(worker_id, "unload", req, timeout + drain_timeout)

    async def status(self, worker_id: str, timeout: float = 5.0) -> WorkerAdminReply:
        return await self._call(worker_id, "status", WorkerStatusRequest(), timeout)

    async def _call(self, worker_id: str, verb: str, req, timeout: float) -> WorkerAdminReply:
        subject = subjects.worker_admin(self.prefix, worker_id, verb)
        return await self.conn.request(subject, req, WorkerAdminReply, timeout=timeout)


def reply_json(reply: WorkerAdminReply) -> str:
    return json.dumps(dataclasses.asdict(reply), indent=1)


def parse_args(verb: str, argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=f"inferno {verb}", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", required=True, help="the worker's id (--worker-id; `inferno up` names them "
                                                    "worker-0, worker-1, ...)")
    ap.add_argument("--nats-url", default=env_default("INFERNO_NATS_URL", "nats://127.0.0.1:4222"))
    add_nats_tls_flags(ap)
    ap.add_argument("--subject-prefix", default=env_default("INFERNO_SUBJECT_PREFIX", subjects.DEFAULT_PREFIX))
    if verb in ("load-model", "unload-model"):
        ap.add_argument("--mode", choices=LOAD_MODES if verb == "load-model" else FINISH_MODES, default="drain",
                        help="the requests of the model in place: let them finish (up to --drain-timeout, then "
                             "abort the rest) or abort them at once; aborted requests end with an error; load-model "
                             "--mode add: keep them, and serve the new model beside them on the same GPU")
        ap.add_argument("--drain-timeout", type=float, default=30.0)
    if verb == "load-model":
        ap.add_argument("--model-dir", required=True, help="a Hugging Face directory or .gguf file, as the worker "
                                                           "sees its file system")
        ap.add_argument("--model-name", default="", help="the served id (default: the directory's name)")
        ap.add_argument("--dtype", default="", choices=["", "auto", "float32", "float16", "bfloat16"])
        ap.add_argument("--max-model-len", type=int, default=0)
        ap.add_argument("--load-format", default="", choices=["", "auto", "dummy"])
        ap.add_argument("--memory-share", type=float, default=0.0,
                        help="--mode add: the GPU's fraction the model may hold (default: an equal split); idle "
                             "models are evicted to make room")
        ap.add_argument("--timeout", type=float, default=LOAD_TIMEOUT, help="seconds to wait for the model to serve")
    return ap.parse_args(argv)


async def run(verb: str, args: argparse.Namespace) -> int:
    nats_cfg = NatsConfig(url=args.nats_url, subject_prefix=args.subject_prefix, **nats_tls_settings(args))
    conn = await connect_nats(nats_cfg, "inferno-admin", wait=5.0)
    try:
        client = AdminClient(conn, args.subject_prefix)
        if verb == "load-model":
            reply = await client.load(args.worker, args.model_dir, args.model_name, mode=args.mode,
                                      drain_timeout=args.drain_timeout, dtype=args.dtype,
                                      max_model_len=args.max_model_len, load_format=args.load_format,
                                      memory_share=args.memory_share, timeout=args.timeout)
        elif verb == "unload-model":
            reply = await client.unload(args.worker, mode=args.mode, drain_timeout=args.drain_timeout)
        else:
            reply = await client.status(args.worker)
    except ServiceError as e:
        print(f"inferno {verb}: worker {args.worker!r}: {e.message}", file=sys.stderr)
        return 2
    finally:
        await conn.close()
    print(reply_json(reply))
    if not reply.ok:
        print(f"inferno {verb}: {reply.code}: {reply.error}", file=sys.stderr)
    return 0 if reply.ok else 1


def main(verb: str, argv: list[str]) -> int:
    args = parse_args(verb, argv)
    setup_logging("inferno-admin", json=False, level="WARNING")  # stdout is the reply's alone
    return asyncio.run(run(verb, args))
