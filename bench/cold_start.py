"""W5b: `inferno worker --model-dir DIR` from process start → ready → first token.

The clock starts just before the worker process is spawned (a nats-server is up already); ready is
its first heartbeat in state "ready"; the first token is that of a 128-token prompt (16 new tokens)
sent straight to the worker. The worker's own breakdown (imports, device, weights, KV, graphs, first token) comes
from its log. --drop-caches empties the page cache first (root): the weights come from the drive.

  python bench/cold_start.py MODEL_DIR [--max-num-seqs 256] [--drop-caches] [worker flags ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.worker_probe import Probe  # noqa: E402


def drop_caches() -> None:
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


async def measure(args, extra: list[str]) -> dict:
    probe = Probe(Path(tempfile.mkdtemp(prefix="w5b-")))
    try:
        await probe.connect()
        if args.drop_caches:
            drop_caches()
        t0 = time.time()
        probe.start_worker("cold", "--model-dir", args.model_dir, "--device", args.device,
                           "--max-num-seqs", str(args.max_num_seqs), *extra)
        t_ready = await probe.wait_state("cold", "ready", timeout=600)
        # 16 tokens, not 1: with overlapped steps the first token is read after the second step
        # (a decode) is launched, whose kernels a one-token request would never load.
        t_first, _ = await probe.first_token("cold", max_tokens=16)
        await asyncio.sleep(0.2)  # the breakdown line is written at the first token
        lines = probe.log_lines("cold", ("model load breakdown", "kv pool sized from memory"))
    finally:
        await probe.close()
    breakdown = next((r for r in lines if r["event"] == "model load breakdown"), {})
    memory = next((r for r in lines if r["event"] == "kv pool sized from memory"), {})
    return {
        "start_to_ready_s": t_ready - t0, "start_to_first_token_s": t_first - t0,
        "imports_s": breakdown.get("imports_s"), "device_s": breakdown.get("device_s"),
        "load_weights_s": breakdown.get("weights_s"), "kv_s": breakdown.get("kv_s"),
        "graph_capture_s": breakdown.get("graphs_s"), "graphs_deferred": breakdown.get("graphs_deferred"),
        "prefetch_s": breakdown.get("prefetch_s"), "page_cache": "dropped" if args.drop_caches else "warm",
        "max_num_seqs": args.max_num_seqs,
        "memory": {k: memory[k] for k in ("kv_gib", "kv_tokens", "in_use_gib", "activation_peak_gib", "dry_forward_s",
                                          "dry_head_s") if k in memory},
        "breakdown": breakdown,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--drop-caches", action="store_true")
    args, extra = ap.parse_known_args()
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    print(json.dumps(asyncio.run(measure(args, extra))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
