"""Host bytes over UCXX on loopback, as a hand-off's frame moves them (shared/kv_transfer.py): GB/s
for 256 MiB payloads, pinned host memory (torch) or GPU memory, under the UCX_TLS / UCX_NET_DEVICES
this process runs with. Run: UCX_TLS=tcp,cuda_copy,self python3 bench/ucx_tcp_probe.py [MiB] [cuda]"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.getcwd())
from shared.kv_transfer import TransferClient, TransferServer, init_ucx  # noqa: E402


async def main(mib: int, device: str) -> None:
    init_ucx(cuda_context=device == "cuda")
    n = mib << 20
    pin = device == "cpu" and torch.cuda.is_available()
    dst = torch.empty(n, dtype=torch.uint8, device=device, pin_memory=pin)
    src = torch.ones(n, dtype=torch.uint8, device=device, pin_memory=pin)

    async def handler(header, payload):
        return {"ok": True}, None
    server = TransferServer(handler, lambda h: dst[:h["nbytes"]]).start()
    client = TransferClient()
    await client.call(server.address, {}, src[:1 << 20])
    rates = []
    for _ in range(3):
        t0 = time.perf_counter()
        await client.call(server.address, {}, src)
        rates.append(round(n / (time.perf_counter() - t0) / 1e9, 3))
    print(json.dumps({"UCX_TLS": os.environ.get("UCX_TLS", ""), "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", ""),
                      "memory": device, "mib": mib, "gb_s": rates}), flush=True)
    await client.close()
    await server.close()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 256, sys.argv[2] if len(sys.argv) > 2 else "cpu"))
