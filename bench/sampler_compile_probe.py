"""Does any batch size compile a sampler kernel variant after the worker's warm-up? (GPU probe)

    python3 bench/sampler_compile_probe.py [VOCAB] [MAX_ROWS]

Times Sampler.warm_up (what a worker runs before ready), counts the compiled variants of each
sampler kernel, then draws at every batch size 1..MAX_ROWS the way a step does and reports the
variants again and the slowest draw. Run it with an empty TRITON_CACHE_DIR (cold compile) and
again with the same one (a restarted worker).
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from services.worker.engine.ops import TritonOps  # noqa: E402
from services.worker.engine.sampler import Sampler  # noqa: E402
from services.worker.kernels import sampling as K  # noqa: E402


def variants() -> dict[str, int]:
    kernels = (K._stats_kernel, K._bounds_kernel, K._collect_kernel, K._collect_end_kernel, K._sample_kernel,
               K._chain_round_kernel, K._chain_finish_kernel)
    return {k.__name__: sum(len(c[0]) for c in k.device_caches.values()) for k in kernels}


def main() -> None:
    vocab = int(sys.argv[1]) if len(sys.argv) > 1 else 128256
    max_rows = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
    dev = torch.device("cuda")
    sampler = Sampler(TritonOps(), vocab, dev, max_rows, torch.bfloat16)  # the engine's logits are bf16
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    draws = sampler.warm_up(max_rows)
    torch.cuda.synchronize()
    warm_s = time.perf_counter() - t0
    after_warm = variants()
    logits = torch.randn(max_rows, vocab, device=dev) * 3
    slowest, slowest_n = 0.0, 0
    t_all = time.perf_counter()
    for n in range(1, max_rows + 1):
        for rows in (logits[:n].to(torch.bfloat16), logits[:n]):  # the model's, and widened by penalties
            t = time.perf_counter()
            sampler._draw(rows, [[0.8] * n, [0.9] * n, [0.05] * n], [[50] * n, list(range(n)), [n] * n])
            torch.cuda.synchronize()
            dt = time.perf_counter() - t
            if dt > slowest:
                slowest, slowest_n = dt, n
    print(f"vocab {vocab} rows 1..{max_rows}: warm_up {draws} draws {warm_s:.2f} s, variants {after_warm}; "
          f"after every batch size {variants()}; slowest draw {slowest * 1e3:.1f} ms at {slowest_n} rows; "
          f"all sizes {time.perf_counter() - t_all:.2f} s")


if __name__ == "__main__":
    main()
