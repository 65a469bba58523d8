"""kvstore loopback benchmark: put/get GB/s through the real service (NATS control, UCXX data), host or GPU pages.

Starts a nats-server and `python -m services.kvstore` (pinned pages when a GPU is present), then
through KvStoreClient puts and gets buffers of several sizes made of 2 MiB pages (one block of the
Llama-3.1-8B shape in bf16: 16 tokens × 32 layers × K and V × 8 heads × 128 × 2 bytes), from numpy
and, with a GPU, from CUDA tensors. Reports the UCXX call alone (client.last_put / last_get) and
the whole call with its NATS round trips, medians of warm repeats, and the lookup round trip.
Usage: python bench/kvstore_bench.py [--sizes-mib 16 64 375] [--reps 5] [--capacity-gb 4]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.launcher import find_nats_server, free_port  # noqa: E402
from shared.config import NatsConfig  # noqa: E402
from shared.kv_transfer import TransferClient  # noqa: E402
from shared.kvstore_client import KvStoreClient, KvStoreError  # noqa: E402
from shared.nats_client import connect_nats  # noqa: E402

MIB = 1 << 20
PAGE = 2 * MIB
NS = "m=bench-8b|dt=bfloat16|bs=16|L=32|H=8|D=128"


def hashes(n: int, tag: int) -> list[bytes]:
    return [(tag << 32 | i).to_bytes(16, "big") for i in range(n)]


async def bench(args: argparse.Namespace) -> None:
    try:
        import torch
        cuda = torch.cuda.is_available()
    except ImportError:
        torch, cuda = None, False
    if cuda:
        torch.cuda.init()  # a CUDA context before UCX starts, so it can move GPU buffers
    client = KvStoreClient(await connect_nats(NatsConfig(url=args.url), "bench", wait=10.0), TransferClient(),
                           "inferno", timeout=10.0, transfer_timeout=120.0)
    deadline = time.monotonic() + 60
    while True:
        try:
            stats = await client.stats()
            break
        except KvStoreError:
            assert time.monotonic() < deadline, "the kvstore did not come up"
            await asyncio.sleep(0.2)
    probe = hashes(16, 0)
    rtts = []
    for _ in range(200):
        t = time.perf_counter()
        await client.lookup(NS, 16, probe)
        rtts.append(time.perf_counter() - t)
    print(f"kvstore at {stats.address}; lookup of 16 hashes: {statistics.median(rtts) * 1e6:.0f} us median")
    print(f"{'pages':>6} {'MiB':>6} {'from':>5} | {'put GB/s':>9} {'call':>6} | {'get GB/s':>9} {'call':>6}")
    tag = 1
    for where in (["host", "cuda"] if cuda else ["host"]):
        for mib in args.sizes_mib:
            n = max(1, mib * MIB // PAGE)
            data = np.random.default_rng(mib).integers(0, 256, n * PAGE, dtype=np.uint8)
            if where == "cuda":
                data = torch.from_numpy(data).cuda()
                alloc = lambda count, size: torch.empty(count * size, dtype=torch.uint8, device="cuda")  # noqa: E731
            else:
                alloc = None
            put_x, put_c, get_x, get_c = [], [], [], []
            for rep in range(args.reps + 1):  # the first is a warm-up (endpoints, registration)
                keys = hashes(n, tag)
                tag += 1
                t = time.perf_counter()
                assert await client.put(NS, keys, data, PAGE) == n
                t_put = time.perf_counter() - t
                t = time.perf_counter()
                count, got = await client.get(NS, keys, alloc)
                t_get = time.perf_counter() - t
                assert count == n
                if rep == 0:
                    same = bool((got == data).all()) if where == "cuda" else np.array_equal(got, data)
                    assert same, "the bytes came back different"
                    continue
                size = n * PAGE
                put_x.append(size / client.last_put[1])
                get_x.append(size / client.last_get[1])
                put_c.append(size / t_put)
                get_c.append(size / t_get)
            med = lambda xs: statistics.median(xs) / 1e9  # noqa: E731
            print(f"{n:>6} {n * PAGE // MIB:>6} {where:>5} | {med(put_x):>9.2f} {med(put_c):>6.2f} | "
                  f"{med(get_x):>9.2f} {med(get_c):>6.2f}", flush=True)
    print((await client.stats()))
    await client.transfer.close()
    await client.conn.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[16, 64, 376])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--capacity-gb", type=float, default=4.0)
    args = ap.parse_args()
    port = free_port()
    args.url = f"nats://127.0.0.1:{port}"
    procs = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            procs.append(subprocess.Popen([find_nats_server(), "-a", "127.0.0.1", "-p", str(port), "-sd", tmp],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            procs.append(subprocess.Popen([sys.executable, "-m", "services.kvstore", "--nats-url", args.url,
                                           "--capacity-gb", str(args.capacity_gb), "--log-level", "WARNING"],
                                          cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"}))
            asyncio.run(bench(args))
        finally:
            for proc in reversed(procs):
                proc.terminate()
                proc.wait(10)


if __name__ == "__main__":
    main()
