"""Block sizes of the decode GEMV over fp8 (e4m3) weights, M = 1 (`--quantization fp8`, H100 probe).

    python3 bench/gemv_fp8_probe.py

Each Llama-3.1-8B projection (the down projection with its SiLU fused) under every (block_n,
block_k, num_stages) below: CUDA-graph µs with a cold L2, GB/s of the weight bytes, and the best
per shape next to the current choice (gemv_config); checked against the reference each time.
"""

from __future__ import annotations

import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.gpu_kernels import graph_us, rel_err  # noqa: E402
from services.worker.kernels import gemv  # noqa: E402
from services.worker.kernels.fp8_linear import quantize_weight  # noqa: E402

SHAPES = [("qkv", 6144, 4096, False), ("o_proj", 4096, 4096, False), ("gate_up", 28672, 4096, False),
          ("down", 4096, 14336, True)]
CONFIGS = [gemv.GemvConfig(bn, bk, st) for bn, bk, st in itertools.product((2, 4, 8, 16), (512, 1024, 2048, 4096), (3, 4))]


def main() -> None:
    torch.manual_seed(0)
    for name, n, k, silu in SHAPES:
        wq, ws = quantize_weight(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
        x = torch.randn(1, 2 * k if silu else k, device="cuda", dtype=torch.bfloat16)
        fn, ref_fn = (gemv.silu_mul_linear, gemv.silu_mul_linear_ref) if silu else (gemv.linear, gemv.linear_ref)
        ref = ref_fn(x, wq, None, ws)
        current = gemv.gemv_config(1, n, k, wq.dtype)
        results = []
        for config in CONFIGS:
            try:
                call = lambda c=config: fn(x, wq, None, config=c, scale=ws)  # noqa: E731
                err = rel_err(call(), ref)
                us = graph_us(call)
                if us is None or err > 1e-2:
                    continue
                results.append((us, config))
                print(f"{name:8s} {config}  {us:7.1f} us  {n * k / us / 1e3:5.0f} GB/s", flush=True)
            except Exception as e:  # noqa: BLE001 - a variant that does not compile
                print(f"{name:8s} {config}: {type(e).__name__}", flush=True)
        results.sort(key=lambda r: r[0])
        now = next((us for us, c in results if c == current), None)
        print(f"== {name}: best {results[0][1]} {results[0][0]:.1f} us ({n * k / results[0][0] / 1e3:.0f} GB/s); "
              f"current {current} {now if now is None else round(now, 1)} us", flush=True)


if __name__ == "__main__":
    main()
