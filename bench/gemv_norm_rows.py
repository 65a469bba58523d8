"""The norm-fused GEMV against the norm kernel then the GEMV at 1, 2 and 4 rows (8B shapes, bf16,
graph µs): where gemv.FUSED_NORM_MAX_ROWS should stand. GPU probe.

    python3 bench/gemv_norm_rows.py
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.gpu_kernels import graph_us  # noqa: E402
from services.worker.kernels import gemv as K  # noqa: E402
from services.worker.kernels.rmsnorm import fused_add_rmsnorm  # noqa: E402


def main() -> None:
    dev, dt = torch.device("cuda"), torch.bfloat16
    for n in (6144, 28672):
        w = torch.randn(n, 4096, device=dev, dtype=dt) * 0.02
        nw = torch.ones(4096, device=dev, dtype=dt)
        for m in (1, 2, 4):
            x, r = (torch.randn(m, 4096, device=dev, dtype=dt) for _ in range(2))
            fused = graph_us(lambda: K.add_rmsnorm_linear(x, r, nw, 1e-5, w))
            apart = graph_us(lambda: K.linear(fused_add_rmsnorm(x, r, nw, 1e-5)[0], w))
            print(f"N={n} M={m}: fused {fused:.1f} us, norm + GEMV {apart:.1f} us")


if __name__ == "__main__":
    main()
