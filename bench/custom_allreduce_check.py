"""Checks and times the one-shot all-reduce over peer memory (services/worker/engine/parallel/
custom_all_reduce.py) on whatever GPUs this machine has, 2 KB to 4 MB, fp32 and bf16.

    python3 bench/custom_allreduce_check.py [--ranks 2 4] [--mode procs streams]

procs: one process per rank (rank r on GPU r % count, so several ranks may share one GPU: CUDA
IPC works between processes on one device, NCCL does not), setup over a gloo group as the worker
does it; results are checked against the reference sum, eagerly and inside a captured CUDA graph
replayed many times with fresh inputs (the round counter lives on the device), then timed; with
a GPU per rank, NCCL is timed beside it. On one GPU without MPS the ranks' kernels do not run
at once (contexts take turns, ~2 ms per call on an H100), so its timings measure the time
slicing; under MPS (`nvidia-cuda-mps-control -d`, and MPS_ON=1 to label the rows) they do run
at once, and CUDA IPC works between MPS clients.
streams: all ranks in one process on one GPU, each on its own stream inside one graph: no IPC,
but the kernels do run at once, so its time per call is a lower bound (the peers' reads are
local, not over NVLink). One JSON line per measurement on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from services.worker.engine.parallel.custom_all_reduce import (
    MAX_BLOCKS, MAX_RANKS, CustomAllReduce, all_reduce_ref,
)

SIZES = (2 << 10, 8 << 10, 32 << 10, 128 << 10, 512 << 10, 2 << 20, 4 << 20)
DTYPES = (torch.float32, torch.bfloat16)
MAX_BYTES = 4 << 20
SMALL = 2 << 10  # a second, differently sized message in the same graph
PER_GRAPH = 32  # all-reduces back to back in a timed graph, as a step holds them


def inputs(dtype, numel: int, world: int, seed: int, device) -> list[torch.Tensor]:
    """Every rank's input for one call; each rank can make all of them for the reference.
    fp32: integers (the sum is exact); bf16: normal values (one rounding of the fp32 sum)."""
    out = []
    for r in range(world):
        g = torch.Generator(device=device).manual_seed(seed * 1009 + r)
        if dtype == torch.float32:
            out.append(torch.randint(-1000, 1000, (numel,), generator=g, device=device).to(dtype))
        else:
            out.append(torch.randn(numel, generator=g, device=device).to(dtype))
    return out


def compare(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max())


def timed(fn, iters: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / iters  # µs


class Counts:
    """How many calls each check makes: fewer where contexts take turns (each call waits for a
    time slice)."""

    def __init__(self, slow: bool):
        self.eager_checks, self.graph_replays = (4, 6) if slow else (16, 50)
        self.eager_timed, self.graph_timed = (10, 2) if slow else (200, 20)


# -- one process per rank ----------------------------------------------------------------------
def rank_main(rank: int, world: int, port: int, gpus: int) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    device = torch.device("cuda", rank % gpus)
    torch.cuda.set_device(device)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = dist.group.WORLD
    nccl = dist.new_group(backend="nccl") if gpus >= world else None
    t0 = time.perf_counter()
    ar = CustomAllReduce.setup(group, device, max_bytes=MAX_BYTES)
    setup_s = time.perf_counter() - t0
    # Is this machine running the ranks' kernels at once? One warm call, then a few timed.
    probe = torch.zeros(SMALL // 4, device=device)
    ar.all_reduce(probe)
    torch.cuda.synchronize()
    dist.barrier(group)
    per_call = timed(lambda: ar.all_reduce(probe), 5)
    counts = Counts(slow=per_call > 200)
    if rank == 0:
        emit({"mode": "procs", "ranks": world, "gpus": gpus, "device": torch.cuda.get_device_name(device),
                   "mps": bool(os.environ.get("MPS_ON")), "setup_s": round(setup_s, 3),
                   "probe_us": round(per_call, 1), "reduced_counts": counts.eager_timed < 200})
    failed = 0
    for dtype in DTYPES:
        for nbytes in SIZES:
            row = check_and_time(ar, nccl, group, rank, world, device, dtype, nbytes, counts)
            failed += row["ranks_failed"]
            if rank == 0:
                emit(row)
    dist.barrier(group)
    sys.stdout.flush()
    os._exit(1 if failed else 0)  # no teardown: IPC mappings and NCCL state go with the process


def emit(row: dict) -> None:
    print(json.dumps(row), flush=True)


def check_and_time(ar, nccl, group, rank, world, device, dtype, nbytes, counts: Counts) -> dict:
    numel = nbytes // torch.empty((), dtype=dtype).element_size()
    tol = 0.0  # the kernel sums in rank order in fp32 like the reference: the same bits
    worst = 0.0
    # Eager: a new input every call, so a stale buffer half or a missed flag shows.
    for i in range(counts.eager_checks):
        ins = inputs(dtype, numel, world, seed=nbytes + i, device=device)
        x = ins[rank].clone()
        ar.all_reduce(x)
        worst = max(worst, compare(x, all_reduce_ref(ins)))
    eager_err = worst
    # In a graph: this size, a small one, this size again (the sum of the sums), replayed with
    # fresh inputs copied in before each replay.
    small_numel = SMALL // torch.empty((), dtype=dtype).element_size()
    big, small = torch.empty(numel, dtype=dtype, device=device), torch.empty(small_numel, dtype=dtype, device=device)
    sets = []
    for s in range(3):
        ins_b = inputs(dtype, numel, world, seed=7 * nbytes + s, device=device)
        ins_s = inputs(dtype, small_numel, world, seed=11 * nbytes + s, device=device)
        once = all_reduce_ref(ins_b)
        sets.append((ins_b[rank], ins_s[rank], all_reduce_ref([once] * world), all_reduce_ref(ins_s)))
    big.copy_(sets[0][0])
    small.copy_(sets[0][1])
    for _ in range(2):  # warm: compile every variant the graph uses, outside capture
        ar.all_reduce(big)
        ar.all_reduce(small)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ar.all_reduce(big)
        ar.all_reduce(small)
        ar.all_reduce(big)
    worst = 0.0
    for i in range(counts.graph_replays):
        b_in, s_in, b_want, s_want = sets[i % len(sets)]
        big.copy_(b_in)
        small.copy_(s_in)
        graph.replay()
        worst = max(worst, compare(big, b_want), compare(small, s_want))
    graph_err = worst
    failed = torch.tensor([int(eager_err > tol or graph_err > tol)])
    dist.all_reduce(failed, group=group)
    # Timing (zeros: the values never overflow).
    x = torch.zeros(numel, dtype=dtype, device=device)
    ar.all_reduce(x)
    torch.cuda.synchronize()
    dist.barrier(group)
    eager_us = timed(lambda: ar.all_reduce(x), counts.eager_timed)
    timed_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(timed_graph):
        for _ in range(PER_GRAPH):
            ar.all_reduce(x)
    torch.cuda.synchronize()
    dist.barrier(group)
    timed_graph.replay()
    graph_us = timed(timed_graph.replay, counts.graph_timed) / PER_GRAPH
    row = {"mode": "procs", "ranks": world, "dtype": str(dtype).removeprefix("torch."), "bytes": nbytes,
           "ranks_failed": int(failed.item()), "eager_max_err": eager_err, "graph_max_err": graph_err,
           "eager_checks": counts.eager_checks, "graph_replays_checked": counts.graph_replays,
           "eager_us": round(eager_us, 2), "graph_us": round(graph_us, 2)}
    if nccl is not None:
        row["nccl_graph_us"] = round(nccl_graph_us(x, nccl, counts.graph_timed), 2)
    return row


def nccl_graph_us(x: torch.Tensor, group, replays: int) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        dist.all_reduce(x, group=group)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(PER_GRAPH):
            dist.all_reduce(x, group=group)
    graph.replay()
    torch.cuda.synchronize()
    return timed(graph.replay, replays) / PER_GRAPH


def run_procs(world: int) -> int:
    gpus = torch.cuda.device_count()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=rank_main, args=(r, world, port, gpus)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 240
    while any(p.exitcode is None for p in procs):
        if any(p.exitcode not in (None, 0) for p in procs) or time.monotonic() > deadline:
            break  # a rank failed (the others may wait for it for ever) or all hang
        time.sleep(0.5)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    if codes != [0] * world:
        emit({"mode": "procs", "ranks": world, "error": "a rank failed, found a wrong sum, or hung",
              "exit_codes": codes})
        return 1
    return 0


# -- every rank in one process, one stream each ------------------------------------------------
def run_streams(world: int) -> int:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    data = [torch.zeros(2 * MAX_BYTES, dtype=torch.uint8, device=device) for _ in range(world)]
    signals = [torch.zeros(MAX_RANKS * MAX_BLOCKS, dtype=torch.int64, device=device) for _ in range(world)]
    ars = [CustomAllReduce(r, data, signals, torch.zeros(2, dtype=torch.int64, device=device), MAX_BYTES)
           for r in range(world)]
    streams = [torch.cuda.Stream() for _ in range(world)]
    preload(world, device)
    if world == 2:
        launch_cost(device)
    ok = True
    for dtype in DTYPES:
        for nbytes in SIZES:
            numel = nbytes // torch.empty((), dtype=dtype).element_size()
            xs = [torch.zeros(numel, dtype=dtype, device=device) for _ in range(world)]

            def all_ranks(calls: int) -> None:
                here = torch.cuda.current_stream()
                for r in range(world):
                    streams[r].wait_stream(here)
                    with torch.cuda.stream(streams[r]):
                        for _ in range(calls):
                            ars[r].all_reduce(xs[r])
                for r in range(world):
                    here.wait_stream(streams[r])

            all_ranks(1)  # compile and warm, outside capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                all_ranks(PER_GRAPH)
            worst = 0.0
            for s in range(5):
                ins = inputs(dtype, numel, world, seed=13 * nbytes + s, device=device)
                for r in range(world):
                    xs[r].copy_(ins[r])
                want = all_reduce_ref(ins)
                for _ in range(PER_GRAPH - 1):
                    want = all_reduce_ref([want] * world)
                graph.replay()
                torch.cuda.synchronize()
                worst = max([worst] + [compare(x, want) for x in xs])
            for x in xs:
                x.zero_()
            graph.replay()
            torch.cuda.synchronize()
            graph_us = timed(graph.replay, 20) / PER_GRAPH
            ok = ok and worst == 0.0
            emit({"mode": "streams", "ranks": world, "dtype": str(dtype).removeprefix("torch."), "bytes": nbytes,
                  "graph_max_err": worst, "graph_us": round(graph_us, 2)})
    return 0 if ok else 1


def launch_cost(device) -> None:
    """Host time per eager call, on an instance whose flags are already set (nothing waits):
    what an eager all-reduce costs the CPU, the wrapper and Triton's launch together."""
    data = [torch.zeros(2 * MAX_BYTES, dtype=torch.uint8, device=device) for _ in range(2)]
    signals = [torch.full((MAX_RANKS * MAX_BLOCKS,), 1 << 62, dtype=torch.int64, device=device) for _ in range(2)]
    ar = CustomAllReduce(0, data, signals, torch.zeros(2, dtype=torch.int64, device=device), MAX_BYTES)
    x = torch.zeros(4096, dtype=torch.bfloat16, device=device)
    row = {"mode": "launch"}
    for name, fn in (("all_reduce", lambda: ar.all_reduce(x)), ("serves", lambda: ar.serves(x)),
                     ("torch_add", lambda: x.add_(0))):
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(2000):
            fn()
        row[f"{name}_host_us"] = round((time.perf_counter() - t0) / 2000 * 1e6, 2)
        torch.cuda.synchronize()
    emit(row)


def preload(world: int, device) -> None:
    """Launch every rank's kernel variant once on buffers whose flags are already set, so none
    waits. CUDA loads a kernel lazily at its first launch, and loading waits for the context's
    kernels in flight: in one process, rank 1's first launch would wait for rank 0's kernel,
    which waits for rank 1. (Ranks in processes of their own never share a context.)"""
    data = [torch.zeros(2 * MAX_BYTES, dtype=torch.uint8, device=device) for _ in range(world)]
    signals = [torch.full((MAX_RANKS * MAX_BLOCKS,), 1 << 62, dtype=torch.int64, device=device)
               for _ in range(world)]
    for r in range(world):
        ar = CustomAllReduce(r, data, signals, torch.zeros(2, dtype=torch.int64, device=device), MAX_BYTES)
        for dtype in DTYPES:
            for nbytes in SIZES:
                ar.all_reduce(torch.zeros(nbytes // torch.empty((), dtype=dtype).element_size(),
                                          dtype=dtype, device=device))
                torch.cuda.synchronize()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--mode", nargs="+", choices=("procs", "streams"), default=["procs", "streams"])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"error": "needs a GPU"}))
        return 1
    print(json.dumps({"torch": torch.__version__, "gpus": torch.cuda.device_count(),
                      "device": torch.cuda.get_device_name(0)}), flush=True)
    status = 0
    for mode in args.mode:
        for world in args.ranks:
            status |= run_procs(world) if mode == "procs" else run_streams(world)
    return status


if __name__ == "__main__":
    sys.exit(main())
