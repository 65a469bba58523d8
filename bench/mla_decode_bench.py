"""MLA's absorbed decode (services/worker/kernels/mla_decode.py) on the GPU: checked once against its
torch reference, then timed, its cache read in GB/s against a device-to-device copy's.

Usage, from the repository root: python bench/mla_decode_bench.py [--page 16] [--iters 50]
(the script puts the repository root on sys.path itself; `PYTHONPATH=.` does the same).

Shapes: DeepSeek-V2/V3's latent rows (lora 512 + rope 64, bf16), 16 heads (128 over TP=8), at
B=64 ctx 4,096 (the target: the cache read at >= 70 % of the copy's rate), B=1 ctx 4,096 and
B=256 ctx 1,024. Every sequence is ctx long, its blocks shuffled in the pool. Each case is captured
in a CUDA graph (no launch overhead) that runs the kernel over enough copies of its inputs that
together they overflow L2 several times, so every call reads its cache from HBM; the figure is
the graph's replay time between CUDA events, divided by the calls in it. GB/s counts the cache
bytes a call must read (B x ctx x 576 x 2); the copy's counts bytes read and written.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from services.worker.kernels import mla_decode as K  # noqa: E402

LORA, ROPE, HEADS, DTYPE = 512, 64, 16, torch.bfloat16
CASES = [(64, 4096), (1, 4096), (256, 1024)]  # (batch, context)


def time_graph_us(fn, iters: int) -> float:
    """GPU µs of one fn() (a few launches), replayed in a CUDA graph `iters` times between events."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm outside the capture
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) * 1e3 / iters


def copy_gbps(device, nbytes: int = 2 << 30, iters: int = 50) -> float:
    """A device-to-device copy's rate, bytes read and written counted (HBM's practical ceiling).
    Timed outside a graph: captured, a copy becomes a memcpy node that the copy engines run, at
    ~2.7 TB/s on an H200 against ~4.3 through the SMs."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(100):  # ~0.1 s of copies first: an idle GPU's clocks take that long to rise
        dst.copy_(src)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    stop.record()
    stop.synchronize()
    return 2 * nbytes * iters / (start.elapsed_time(stop) * 1e-3) / 1e9


def make_inputs(batch: int, ctx: int, page: int, device):
    """q, the latent cache (blocks shuffled) and its block table, seq_lens all ctx."""
    per_seq = -(-ctx // page)
    n_blocks = batch * per_seq
    cache = torch.randn(n_blocks, page, 1, LORA + ROPE, device=device, dtype=DTYPE)
    tables = torch.randperm(n_blocks, device=device).to(torch.int32).view(batch, per_seq)
    q = torch.randn(batch, HEADS, LORA + ROPE, device=device, dtype=DTYPE)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    return q, cache, tables, seq_lens


def run_case(batch: int, ctx: int, page: int, iters: int, l2_bytes: int, copy_rate: float, device) -> bool:
    scale = (LORA + ROPE) ** -0.5
    inputs = make_inputs(batch, ctx, page, device)
    q, cache, tables, seq_lens = inputs
    out = K.mla_decode(q, cache, tables, seq_lens, scale, LORA, max_seq_len=ctx)
    ref = K.mla_decode_ref(q, cache, tables, seq_lens, scale, LORA)
    err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    ok = err <= 1e-2
    del ref

    cache_bytes = batch * ctx * (LORA + ROPE) * cache.element_size()
    # Enough input copies that one pass over them overflows L2 four times: every call reads HBM.
    copies = [inputs] + [make_inputs(batch, ctx, page, device) for _ in range(-(-4 * l2_bytes // cache_bytes) - 1)]
    outs = [torch.empty_like(out) for _ in copies]

    def calls():
        for (q_, c_, t_, s_), o_ in zip(copies, outs):
            K.mla_decode(q_, c_, t_, s_, scale, LORA, max_seq_len=ctx, out=o_)

    us = time_graph_us(calls, iters) / len(copies)
    gbps = cache_bytes / (us * 1e-6) / 1e9
    splits = K.choose_num_splits(batch, -(-HEADS // K.BLOCK_H), ctx)
    block_n, warps, stages = K.launch_config(LORA)
    print(f"B={batch:<4d} ctx={ctx:<5d} splits={splits:<2d} BLOCK_N={block_n} warps={warps} stages={stages}  "
          f"{us:8.1f} us  {cache_bytes / 1e6:7.1f} MB  {gbps:7.0f} GB/s  copy {copy_rate:5.0f} GB/s  "
          f"ratio {gbps / copy_rate:5.1%}  rel_err {err:.1e} {'ok' if ok else 'FAIL'}")
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--page", type=int, default=16, help="block size of the latent cache (the worker's default)")
    ap.add_argument("--iters", type=int, default=50, help="graph replays timed per case")
    args = ap.parse_args()
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    l2_bytes = getattr(props, "L2_cache_size", 64 << 20)
    copy_rate = copy_gbps(device)
    print(f"{props.name}, {props.multi_processor_count} SMs, L2 {l2_bytes >> 20} MiB; "
          f"lora {LORA} + rope {ROPE}, {HEADS} heads, {DTYPE}, page {args.page}")
    ok = all([run_case(b, ctx, args.page, args.iters, l2_bytes, copy_rate, device) for b, ctx in CASES])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
