"""W5a: a running worker with no model is told to load one → ready → first token; then told to
replace it by the same directory under another name (its KV pool and graph memory are reused, the
requests of the first are aborted) → first token again.

The worker starts without --model-dir and warms up (torch, CUDA, cuBLAS, pinned staging) before
the clock starts; the load request goes over its admin subject (as `inferno load-model` sends it);
the first token is that of a 128-token prompt sent straight to the worker once the load is answered.
Prints one JSON object: first_token_s (the W5a figure), ready_s, the worker's breakdown of each load.
--drop-caches empties the page cache (root) once the worker is warm, just before the first load:
its weights then come from the drive (W5a's second figure, against the drive's floor).

  python bench/hot_load.py MODEL_DIR [--device cuda] [--drop-caches] [worker flags ...]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cold_start import drop_caches  # noqa: E402
from bench.worker_probe import Probe  # noqa: E402
from services.worker.admin_client import AdminClient  # noqa: E402


async def load_and_serve(probe: Probe, admin: AdminClient, model_dir: str, name: str, mode: str = "drain") -> dict:
    t0 = time.time()
    reply = await admin.load("hot", model_dir, name, mode=mode)
    t_ready = time.time()
    if not reply.ok:
        raise RuntimeError(f"load failed: {reply.code}: {reply.error}")
    await probe.wait_state("hot", "ready", timeout=10)  # the heartbeat names the new model
    while probe.heartbeats["hot"].model != name:
        await asyncio.sleep(0.001)
    t_first, t_last = await probe.first_token("hot", max_tokens=32)
    return {"ready_s": t_ready - t0, "first_token_s": t_first - t0, "decode_31_tokens_s": t_last - t_first,
            "load": dataclasses.asdict(reply.load) if reply.load is not None else None}


async def measure(args, extra: list[str]) -> dict:
    probe = Probe(Path(tempfile.mkdtemp(prefix="w5a-")))
    try:
        await probe.connect()
        t_spawn = time.time()
        probe.start_worker("hot", "--device", args.device, *extra)
        admin = AdminClient(probe.conn)
        while True:  # until it answers, warmed up
            try:
                status = await admin.status("hot", timeout=1.0)
                if status.warm:
                    break
            except Exception:
                pass
            await asyncio.sleep(0.05)
        warm_s = time.time() - t_spawn
        if args.drop_caches:
            drop_caches()
        first = await load_and_serve(probe, admin, args.model_dir, "first")
        await asyncio.sleep(args.settle)  # the graphs left after ready are captured meanwhile
        t_first, t_last = await probe.first_token("hot", max_tokens=32)
        first["settled_decode_31_tokens_s"] = t_last - t_first  # replaying graphs by now
        replace = await load_and_serve(probe, admin, args.model_dir, "replaced", mode="abort")
        await asyncio.sleep(0.5)
        lines = probe.log_lines("hot", ("model load breakdown", "graphs captured", "kv pool sized from memory",
                                        "model unloaded"))
    finally:
        await probe.close()
    return {"first_token_s": first["first_token_s"], "ready_s": first["ready_s"],
            "replace_first_token_s": replace["first_token_s"], "replace_ready_s": replace["ready_s"],
            "worker_warm_s": warm_s, "page_cache": "dropped" if args.drop_caches else "warm", "first": first, "replace": replace, "log": lines}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--settle", type=float, default=5.0, help="seconds between the load and the replace")
    ap.add_argument("--drop-caches", action="store_true", help="the first load reads the drive (root)")
    args, extra = ap.parse_known_args()
    print(json.dumps(asyncio.run(measure(args, extra))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
