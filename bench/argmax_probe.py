"""Greedy token choice after the LM head: torch.argmax against the sampler kernel's greedy path (H100 probe).

    python3 bench/argmax_probe.py

W1's decode probe put 28 µs of a batch-1 step on `logits.argmax(-1)`: one row of 128,256 logits
reduced by few blocks. The sampler kernel splits a row over many programs. CUDA-graph µs, cold L2,
fp32 and bf16 logits, B = 1, 8, 64, 256; the two must agree exactly (ties to the lowest index).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.gpu_kernels import graph_us  # noqa: E402
from services.worker.kernels import sampling as K  # noqa: E402


def main() -> None:
    dev = torch.device("cuda")
    V = 128_256
    for dtype in (torch.float32, torch.bfloat16):
        for B in (1, 8, 64, 256):
            x = (torch.randn(B, V, device=dev) * 3).to(dtype)
            zf = torch.zeros(B, device=dev)
            zi = torch.zeros(B, dtype=torch.int32, device=dev)
            one = torch.ones(B, device=dev)
            zl = torch.zeros(B, dtype=torch.int64, device=dev)
            a = x.argmax(-1)
            b = K.sample(x, zf, zi, one, zf, zl, zl)
            same = bool(torch.equal(a, b))
            t_torch = graph_us(lambda: x.argmax(-1))
            t_kernel = graph_us(lambda: K.sample(x, zf, zi, one, zf, zl, zl))
            print(f"{str(dtype):15} B={B:4}: torch.argmax {t_torch:6.1f} us, sampler greedy {t_kernel:6.1f} us, "
                  f"same={same}")


if __name__ == "__main__":
    main()
