"""How much of a process's first Triton launches is one-time setup (GPU probe).

    python3 bench/triton_first_launch_probe.py      (run it twice: the second run finds the cache warm)

Times, in a fresh interpreter: import torch and triton, the CUDA context, then the first launch of one
trivial kernel, a second kernel, a new variant of the first, and the first launches of the engine's own
RMS-norm and SiLU kernels at the 8B shapes (each after a synchronize). A large first figure against
the others is setup paid once per process, which a start could pay while its weights load.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
T0 = time.perf_counter()

import torch  # noqa: E402

T1 = time.perf_counter()
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

T2 = time.perf_counter()


@triton.jit
def _fill(x_ptr, n, v, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + i, v, mask=i < n)


@triton.jit
def _double(x_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) * 2, mask=i < n)


def timed(label, fn, rows):
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    rows.append((label, time.perf_counter() - t))


def main() -> None:
    rows = [("import torch", T1 - T0), ("import triton", T2 - T1)]
    timed("CUDA context", lambda: torch.empty(1, device="cuda"), rows)
    x = torch.zeros(4096, device="cuda")
    timed("first launch (_fill)", lambda: _fill[(4,)](x, 4096, 1.0, BLOCK=1024), rows)
    timed("first launch of a second kernel (_double)", lambda: _double[(4,)](x, 4096, BLOCK=1024), rows)
    timed("a new variant of _fill (BLOCK=512)", lambda: _fill[(8,)](x, 4096, 2.0, BLOCK=512), rows)
    timed("_fill again", lambda: _fill[(4,)](x, 4096, 1.0, BLOCK=1024), rows)
    from services.worker.kernels import rmsnorm, silu_mul  # noqa: E402
    h = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
    res = torch.randn_like(h)
    timed("engine: rms_norm first launch", lambda: rmsnorm.rmsnorm(h, w, 1e-5), rows)
    timed("engine: fused_add_rmsnorm first launch", lambda: rmsnorm.fused_add_rmsnorm(h, res, w, 1e-5), rows)
    g = torch.randn(8192, 2 * 14336, device="cuda", dtype=torch.bfloat16)
    timed("engine: silu_mul first launch", lambda: silu_mul.silu_mul(g), rows)
    timed("engine: silu_mul again", lambda: silu_mul.silu_mul(g), rows)
    a = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(6144, 4096, device="cuda", dtype=torch.bfloat16)
    timed("cuBLAS: first GEMM 8192x4096x6144", lambda: a @ b.t(), rows)
    timed("cuBLAS: same again", lambda: a @ b.t(), rows)
    for label, s in rows:
        print(f"{label:45s} {s * 1000:9.1f} ms")


if __name__ == "__main__":
    main()
