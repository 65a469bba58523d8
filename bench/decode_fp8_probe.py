"""Decode attention over an fp8 cache: which tile shape reads it fastest (H100 probe).

    python3 bench/decode_fp8_probe.py

For each (BLOCK_N, num_warps, num_stages) the split kernel's launch config is swapped in and
timed as a CUDA-graph replay at W2's decode shape (B=1024, ctx 384) and a long context (B=8,
ctx 8192), bf16 and fp8 caches; checked against the reference each time.
"""

from __future__ import annotations

import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.gpu_kernels import graph_us, paged_cache, rel_err  # noqa: E402
from services.worker.kernels import decode_attention as K  # noqa: E402

N_Q, HEAD_DIM = 32, 128


def main() -> None:
    torch.manual_seed(0)
    shapes = [(1024, 384), (256, 512), (8, 8192)]
    original = K.launch_config
    for batch, ctx in shapes:
        kc, vc, tables = paged_cache([ctx] * batch, "cuda")
        q = torch.randn(batch, N_Q, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        for fp8 in (False, True):
            k8, v8 = (kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)) if fp8 else (kc, vc)
            ref = K.paged_decode_attention_ref(q, k8, v8, tables, seq_lens, HEAD_DIM ** -0.5)
            nbytes = batch * ctx * 8 * HEAD_DIM * 2 * k8.element_size()
            for block_n, warps, stages in itertools.product((32, 64, 128), (4, 8), (2, 3, 4)):
                K.launch_config = lambda head_dim, b=block_n, w=warps, s=stages: (b, w, s)
                try:
                    fn = lambda: K.paged_decode_attention(q, k8, v8, tables, seq_lens, HEAD_DIM ** -0.5, max_seq_len=ctx)
                    err = rel_err(fn(), ref)
                    us = graph_us(fn)
                    print(f"B={batch} ctx={ctx} {'fp8 ' if fp8 else 'bf16'} BLOCK_N={block_n:3d} warps={warps} "
                          f"stages={stages}  {us:8.1f} us  {nbytes / us / 1e3:6.0f} GB/s  err {err:.1e}", flush=True)
                except Exception as e:  # noqa: BLE001 - a config that does not compile (shared memory)
                    print(f"B={batch} ctx={ctx} {'fp8' if fp8 else 'bf16'} {block_n} {warps} {stages}: {type(e).__name__}")
                finally:
                    K.launch_config = original


if __name__ == "__main__":
    main()
