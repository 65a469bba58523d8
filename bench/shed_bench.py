"""Load shedding on the CPU: the tiny model's stack with the scheduler's queue bound, driven by
`inferno bench` at a Poisson rate on the W2 shape; prints the loadgen's report (TTFT of the admitted
requests, the 429s) and the latency of the 429 answers measured by a probe during the run.

    python bench/shed_bench.py --rate 12 --num-requests 400 --max-queue-seconds 2 [--no-bound]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from services.launcher import Stack, StackConfig, free_port
from inferno.tools.make_model import write_model


async def probe(url: str, until: float) -> list[float]:
    """Seconds to each 429 of a small request sent every 100 ms (max_tokens 1, so an admitted one adds little load) while the bench runs."""
    body = json.dumps({"model": "tiny", "prompt": list(range(10, 230)), "max_tokens": 1,
                       "ignore_eos": True}).encode()
    out = []
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < until:
            t0 = time.perf_counter()
            async with http.post(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"},
                                 timeout=aiohttp.ClientTimeout(total=0.5)) as r:
                if r.status == 429:
                    out.append(time.perf_counter() - t0)
            await asyncio.sleep(0.1)
    return out


async def probe_safe(url: str, until: float) -> list[float]:
    try:
        return await probe(url, until)
    except (asyncio.TimeoutError, aiohttp.ClientError):
        return await probe_safe(url, until) if time.monotonic() < until else []


def report(path: str, bound: float) -> None:
    """The 429s' latency (request sent → error answer) and the admitted requests' TTFT against the bound."""
    records = json.loads(Path(path).read_text())["requests"]
    shed = sorted(r["e2e"] for r in records if r.get("error") == "http-429")
    ttft = sorted(r["ttft"] for r in records if r.get("error") is None and r.get("ttft") is not None)
    if shed:
        print(f"429: {len(shed)} answers, p50 {statistics.median(shed) * 1000:.1f} ms, "
              f"p99 {shed[int(0.99 * (len(shed) - 1))] * 1000:.1f} ms, max {shed[-1] * 1000:.1f} ms")
    if ttft:
        over = sum(t > bound for t in ttft)
        print(f"admitted: {len(ttft)}, TTFT over the {bound:g} s bound: {over} ({100 * over / len(ttft):.1f}%)")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, required=True)
    ap.add_argument("--num-requests", type=int, default=400)
    ap.add_argument("--max-queue-seconds", type=float, default=2.0)
    ap.add_argument("--tokens-per-second", type=float, default=4096.0)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--no-bound", action="store_true")
    ap.add_argument("--probe-seconds", type=float, default=0.0, help="probe the 429 latency this long")
    ap.add_argument("--out", default=None)
    ap.add_argument("--scheduler-log-level", default="INFO")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="shed-"))
    model = write_model(tmp / "tiny", preset="tiny", seed=0, dtype="float32")
    sched = () if args.no_bound else ("--max-queue-seconds", str(args.max_queue_seconds),
                                      "--admission-tokens-per-second", str(args.tokens_per_second),
                                      "--log-level", args.scheduler_log_level)
    cfg = StackConfig(model_dir=model, model_name="tiny", port=free_port(), nats_port=free_port(), workers=1,
                      run_dir=tmp / "run", log_format="json", kvstore_capacity_gb=0,
                      worker_args=("--max-num-seqs", str(args.max_num_seqs), "--num-blocks", "4096"),
                      scheduler_args=sched)
    stack = Stack(cfg).start()
    try:
        stack.wait_ready(timeout=120)
        out = args.out or str(tmp / "bench.json")
        cmd = [str(Path(sys.executable).with_name("inferno")), "bench", "--base-url", stack.url,
               "--request-rate", str(args.rate), "--num-requests", str(args.num_requests),
               "--input-len", "100:340", "--output-len", "100:300", "--timeout", "120", "--out", out, "--save-requests"]
        bench = subprocess.Popen(cmd)
        latencies = asyncio.run(probe_safe(stack.url, time.monotonic() + args.probe_seconds)) \
            if args.probe_seconds else []
        bench.wait()
        if latencies:
            latencies.sort()
            print(f"429 probe: {len(latencies)} answers, p50 {statistics.median(latencies) * 1000:.1f} ms, "
                  f"p99 {latencies[int(0.99 * (len(latencies) - 1))] * 1000:.1f} ms, "
                  f"max {latencies[-1] * 1000:.1f} ms")
        report(out, args.max_queue_seconds)
    finally:
        stack.stop()
        print(f"logs: {tmp / 'run'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
