"""Why loading takes what it takes: page-cache read speed and the loader at several thread counts."""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

t0 = time.time()
import torch  # noqa: E402

print(f"import torch: {time.time() - t0:.2f} s")

from services.worker.engine.loader import load_model  # noqa: E402


def read_all(files, threads):
    def read(path):
        buf = bytearray(64 << 20)
        n = 0
        with open(path, "rb", buffering=0) as f:
            while (k := f.readinto(buf)):
                n += k
        return n
    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(read, files))
    return total / (time.perf_counter() - t) / 1e9


def main() -> int:
    model = Path(sys.argv[1])
    files = sorted(model.glob("*.safetensors"))
    for threads in (1, 4):
        print(f"page-cache read, {threads} threads: {read_all(files, threads):.1f} GB/s")
    t = time.perf_counter()
    torch.empty(1, device="cuda")
    print(f"cuda init: {time.perf_counter() - t:.2f} s")
    for mib in (8, 64, 256):
        t = time.perf_counter()
        torch.empty(mib << 20, dtype=torch.uint8, pin_memory=True)
        print(f"first pinned alloc of {mib} MiB: {1000 * (time.perf_counter() - t):.1f} ms")
    import services.worker.engine.loader as loader
    for staging in (16, 64):
        loader.STAGING_BYTES = staging << 20
        t = time.perf_counter()
        m = load_model(model, "cuda", torch.bfloat16, num_threads=8)
        torch.cuda.synchronize()
        print(f"load_model, 8 threads, {staging} MiB staging: {time.perf_counter() - t:.2f} s")
        del m
        torch.cuda.empty_cache()
    for threads in (4, 8, 16):
        t = time.perf_counter()
        m = load_model(model, "cuda", torch.bfloat16, num_threads=threads)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        nbytes = sum(p.numel() * p.element_size() for p in m.parameters())
        print(f"load_model, {threads} threads: {dt:.2f} s, {nbytes / dt / 1e9:.1f} GB/s")
        del m
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
