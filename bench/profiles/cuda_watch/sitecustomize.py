"""Diagnostics for bench/profiles/w2_profile.sh, loaded through PYTHONPATH into every service of the
stack (only a process that initialises CUDA does anything): torch's sync debug mode set to warn (each
synchronising call site is reported once, with its stack), and every 5 s the caching allocator's
counters that reveal device frees and retries (cudaFree synchronises the device and spins) on stderr."""

import os
import sys
import threading
import time


def _watch() -> None:
    while "torch" not in sys.modules:
        time.sleep(0.5)
    torch = sys.modules["torch"]
    while not (hasattr(torch, "cuda") and torch.cuda.is_initialized()):
        time.sleep(0.5)
    try:
        torch.cuda.set_sync_debug_mode("warn")
    except Exception as e:  # noqa: BLE001 - a diagnostic must never break the service
        print(f"cuda_watch: sync debug mode unavailable: {e!r}", file=sys.stderr, flush=True)
    keys = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_ooms", "num_sync_all_streams")
    last = None
    while True:
        time.sleep(5)
        try:
            stats = torch.cuda.memory_stats()
        except Exception:  # noqa: BLE001
            continue
        now = {k: stats.get(k, 0) for k in keys}
        if now != last:
            print(f"cuda_watch pid {os.getpid()} {time.time():.1f} {now}", file=sys.stderr, flush=True)
            last = now


if os.environ.get("INFERNO_CUDA_WATCH") == "1":
    threading.Thread(target=_watch, name="cuda-watch", daemon=True).start()
