"""The cost of one tensor-parallel all-reduce on this machine's GPUs, eager and inside a CUDA graph,
at the sizes a decode step sends (batch × hidden bf16). Run: python3 bench/allreduce_bench.py [ranks]
(it starts one process per GPU). Prints one JSON line per size from rank 0."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Llama-3.1-8B, 70B by default; AR_HIDDEN="2048" AR_BATCHES="1 64 512" for another model's sizes.
HIDDEN = tuple(int(x) for x in os.environ.get("AR_HIDDEN", "4096 8192").split())
BATCHES = tuple(int(x) for x in os.environ.get("AR_BATCHES", "1 16 64 256").split())


def timed(fn, iters: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / iters  # µs


def worker(rank: int, world: int, port: int) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    for hidden in HIDDEN:
        for batch in BATCHES:
            x = torch.randn(batch, hidden, dtype=torch.bfloat16, device="cuda")
            eager = timed(lambda: dist.all_reduce(x), 200)
            # 32 all-reduces per replay, as a step's graph would hold them back to back.
            graph = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                dist.all_reduce(x)
            torch.cuda.current_stream().wait_stream(s)
            with torch.cuda.graph(graph):
                for _ in range(32):
                    dist.all_reduce(x)
            in_graph = timed(graph.replay, 50) / 32
            if rank == 0:
                print(json.dumps({"ranks": world, "hidden": hidden, "batch": batch, "bytes": x.numel() * 2,
                                  "eager_us": round(eager, 2), "graph_us": round(in_graph, 2)}), flush=True)
    dist.destroy_process_group()


def main() -> int:
    world = int(sys.argv[1]) if len(sys.argv) > 1 else torch.cuda.device_count()
    if world < 2:
        print(json.dumps({"error": f"needs 2 GPUs, found {torch.cuda.device_count()}"}))
        return 1
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(world, port), nprocs=world)
    return 0


if __name__ == "__main__":
    sys.exit(main())
