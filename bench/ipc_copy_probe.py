"""How fast one process copies another's GPU memory over CUDA IPC (the hand-off's copy,
services/worker/engine/cuda_ipc.py): 362 MiB, the KV of a 3,000-token prompt of the 8B shape.

    python3 bench/ipc_copy_probe.py [--mib 362] [--src 1] [--dst 0]

Two processes, `src` owning the pages and `dst` the receive buffer, each maps the other's
buffer. Timed with CUDA events on the copying process's streams (median of 20):
  pull-ce-K  the receiver copies out of the mapped peer buffer, K chunks on K streams (copy engines);
  push-ce-K  the owner copies into the mapped receive buffer, K chunks on K streams;
  pull-sm / push-sm  a kernel (SM loads/stores over NVLink) instead of the copy engines;
  peer       torch's own cross-device copy in one process (cudaMemcpyPeer), the reference.
One JSON line per row on stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.multiprocessing as mp
import triton
import triton.language as tl

from services.worker.engine.cuda_ipc import open_shared, share


@triton.jit
def _copy_kernel(src, dst, n, BLOCK: tl.constexpr):
    start = tl.program_id(0) * BLOCK
    step = tl.num_programs(0) * BLOCK
    for off in range(start, n, step):
        idx = off + tl.arange(0, BLOCK)
        mask = idx < n
        tl.store(dst + idx, tl.load(src + idx, mask=mask), mask=mask)


def sm_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    n = dst.numel()
    _copy_kernel[(132 * 4,)](src, dst, n, BLOCK=4096, num_warps=8)


def timed(fn, device, repeat: int = 20) -> float:
    times = []
    for _ in range(repeat + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[2:])


def chunked(dst: torch.Tensor, src: torch.Tensor, streams: list) -> None:
    """dst ← src in len(streams) chunks, one per stream, joined on the current stream."""
    main = torch.cuda.current_stream(dst.device)
    chunks = zip(dst.chunk(len(streams)), src.chunk(len(streams)))
    for s, (d, c) in zip(streams, chunks):
        s.wait_stream(main)
        with torch.cuda.stream(s):
            d.copy_(c, non_blocking=True)
        main.wait_stream(s)


def rows_for(local: torch.Tensor, peer: torch.Tensor, direction: str, device) -> list[dict]:
    nbytes = local.numel()
    out = []
    dst, src = (local, peer) if direction == "pull" else (peer, local)
    for k in (1, 2, 4, 8):
        streams = [torch.cuda.Stream(device) for _ in range(k)]
        ms = timed(lambda: chunked(dst, src, streams), device)
        out.append({"row": f"{direction}-ce-{k}", "ms": round(ms, 3), "gb_s": round(nbytes / ms / 1e6, 1)})
    ms = timed(lambda: sm_copy(dst.view(torch.int64), src.view(torch.int64)), device)
    out.append({"row": f"{direction}-sm", "ms": round(ms, 3), "gb_s": round(nbytes / ms / 1e6, 1)})
    return out


def owner(src_dev: int, nbytes: int, to_main, from_main) -> None:
    device = torch.device("cuda", src_dev)
    torch.cuda.set_device(device)
    pages = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    torch.cuda.synchronize(device)
    to_main.put(share(pages))
    recv_fields = from_main.get()  # the receiver's buffer, for the push rows
    peer = open_shared(recv_fields, device)
    rows = rows_for(pages, peer, "push", device)
    torch.cuda.synchronize(device)
    to_main.put((rows, int(pages[12345].item())))
    from_main.get()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=362)
    ap.add_argument("--src", type=int, default=1)
    ap.add_argument("--dst", type=int, default=0)
    args = ap.parse_args()
    nbytes = args.mib << 20
    ctx = mp.get_context("spawn")
    to_main, from_main = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=owner, args=(args.src, nbytes, to_main, from_main))
    proc.start()
    device = torch.device("cuda", args.dst)
    torch.cuda.set_device(device)
    recv = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    peer = open_shared(to_main.get(), device)
    rows = rows_for(recv, peer, "pull", device)
    assert torch.equal(recv[:4096], peer[:4096]), "pull copied wrong bytes"
    from_main.put(share(recv))
    push_rows, probe = to_main.get()
    torch.cuda.synchronize(device)
    assert int(recv[12345].item()) == probe, "push copied wrong bytes"
    from_main.put("done")
    proc.join(timeout=60)
    if torch.cuda.device_count() > max(args.src, args.dst):
        a = torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", args.src))
        b = torch.empty(nbytes, dtype=torch.uint8, device=device)
        ms = timed(lambda: b.copy_(a, non_blocking=True), device)
        rows.append({"row": "peer", "ms": round(ms, 3), "gb_s": round(nbytes / ms / 1e6, 1)})
    for row in rows + push_rows:
        print(json.dumps({"probe": "ipc_copy", "mib": args.mib, "src": args.src, "dst": args.dst, **row}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
