"""Can decode attention run beside the GEMMs on one H100? W2's large decode steps (~955 rows) spend
~20 ms in GEMMs (compute-bound) and ~17 ms in paged attention (HBM-bound), one after the other. This
probe runs the kernels of an 8B layer (q/k/v, o, gate/up, down GEMMs; paged decode attention over
`ctx` tokens of bf16 KV) for two micro-batches of `rows` rows each, `layers` times:
  serial    one stream: A's GEMMs, A's attention, B's GEMMs, B's attention, layer after layer;
  streams   A on one stream and B on another, no dependencies between them (the GPU interleaves);
  offset    as `streams`, but B starts half a layer late, so A's attention meets B's GEMMs (two-batch overlap).
Each mode is timed with CUDA events (median of `reps`) inside a CUDA graph (launches out of the way), with
the GPU's power draw sampled while it runs. Prints one JSON line per mode and the ideal max(GEMMs, attention).

Usage: python bench/overlap_probe.py [--rows 480] [--ctx 384] [--layers 32] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.worker.kernels.decode_attention import paged_decode_attention  # noqa: E402

HIDDEN, MLP, NQ, NKV, HD, PAGE = 4096, 14336, 32, 8, 128, 16


class MicroBatch:
    """One micro-batch's activations, weights shared, its own KV blocks."""

    def __init__(self, rows: int, ctx: int, weights: dict, kv: tuple, first_block: int):
        dev = "cuda"
        self.w = weights
        self.k_cache, self.v_cache = kv
        self.x = torch.randn(rows, HIDDEN, device=dev, dtype=torch.bfloat16) * 0.1
        self.h = torch.randn(rows, MLP, device=dev, dtype=torch.bfloat16) * 0.1
        self.q = torch.randn(rows, NQ, HD, device=dev, dtype=torch.bfloat16)
        blocks = -(-ctx // PAGE)
        self.tables = (first_block + torch.arange(rows * blocks, device=dev, dtype=torch.int32)).view(rows, blocks)
        self.seq_lens = torch.full((rows,), ctx, device=dev, dtype=torch.int32)
        self.ctx = ctx

    def gemms(self) -> None:
        w = self.w
        torch.nn.functional.linear(self.x, w["qkv"])
        torch.nn.functional.linear(self.x, w["o"])
        torch.nn.functional.linear(self.x, w["gate_up"])
        torch.nn.functional.linear(self.h, w["down"])

    def attention(self) -> None:
        paged_decode_attention(self.q, self.k_cache, self.v_cache, self.tables, self.seq_lens, HD ** -0.5,
                               max_seq_len=self.ctx)


def power_sampler():
    return subprocess.Popen(["nvidia-smi", "--query-gpu=power.draw,clocks.sm", "--format=csv,noheader,nounits",
                             "-lms", "50"], stdout=subprocess.PIPE, text=True)


def run_mode(name: str, body, reps: int) -> dict:
    graph = torch.cuda.CUDAGraph()
    body()  # warm (compiles, cuBLAS plans) outside capture
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        body()
    torch.cuda.synchronize()
    times = []
    smi = power_sampler()
    for _ in range(20):  # the sampler's start-up, under load
        graph.replay()
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 10)
    smi.terminate()
    samples = [line.split(",") for line in smi.communicate()[0].splitlines() if "," in line]
    watts = [float(p) for p, _ in samples]
    clocks = [float(c) for _, c in samples]
    return {"mode": name, "ms": round(statistics.median(times), 3),
            "power_w": round(statistics.median(watts), 0) if watts else None,
            "sm_mhz": round(statistics.median(clocks), 0) if clocks else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=480)
    ap.add_argument("--ctx", type=int, default=384)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    dev = "cuda"
    torch.manual_seed(0)
    weights = {"qkv": torch.randn((NQ + 2 * NKV) * HD, HIDDEN, device=dev, dtype=torch.bfloat16) * 0.01,
               "o": torch.randn(HIDDEN, NQ * HD, device=dev, dtype=torch.bfloat16) * 0.01,
               "gate_up": torch.randn(2 * MLP, HIDDEN, device=dev, dtype=torch.bfloat16) * 0.01,
               "down": torch.randn(HIDDEN, MLP, device=dev, dtype=torch.bfloat16) * 0.01}
    blocks_each = args.rows * -(-args.ctx // PAGE)
    # One layer's KV pool; each layer of the probe reads the same pages (L2 is 50 MB: no reuse at this size).
    kv = tuple(torch.randn(2 * blocks_each, PAGE, NKV, HD, device=dev, dtype=torch.bfloat16) for _ in range(2))
    a = MicroBatch(args.rows, args.ctx, weights, kv, 0)
    b = MicroBatch(args.rows, args.ctx, weights, kv, blocks_each)
    side = torch.cuda.Stream()

    def gemms_only():
        for _ in range(args.layers):
            a.gemms()
            b.gemms()

    def attention_only():
        for _ in range(args.layers):
            a.attention()
            b.attention()

    def serial():
        for _ in range(args.layers):
            a.gemms()
            a.attention()
            b.gemms()
            b.attention()

    def two_streams(offset: bool):
        def body():
            if offset:
                a.gemms()  # B starts after A's first GEMMs: A's attention meets B's GEMMs
            fork = torch.cuda.Event()
            fork.record()
            side.wait_event(fork)
            with torch.cuda.stream(side):
                for _ in range(args.layers):
                    b.gemms()
                    b.attention()
            for layer in range(args.layers):
                if not (offset and layer == 0):
                    a.gemms()
                a.attention()
            join = torch.cuda.Event()
            join.record(side)
            torch.cuda.current_stream().wait_event(join)
        return body

    results = [run_mode("gemms only", gemms_only, args.reps), run_mode("attention only", attention_only, args.reps),
               run_mode("serial", serial, args.reps), run_mode("streams", two_streams(False), args.reps),
               run_mode("offset", two_streams(True), args.reps)]
    by = {r["mode"]: r["ms"] for r in results}
    for r in results:
        print(json.dumps({**r, "rows_each": args.rows, "ctx": args.ctx, "layers": args.layers}))
    ideal = max(by["gemms only"], by["attention only"])
    print(json.dumps({"ideal_ms": ideal, "serial_ms": by["serial"], "best_overlap_ms": min(by["streams"], by["offset"]),
                      "saved_of_possible": round((by["serial"] - min(by["streams"], by["offset"]))
                                                 / max(by["serial"] - ideal, 1e-9), 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
