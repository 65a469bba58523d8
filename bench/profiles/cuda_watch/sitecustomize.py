"""Diagnostics for bench/profiles/w2_profile.sh, loaded through PYTHONPATH into every service of the
stack (only a process that initialises CUDA does anything): torch's sync debug mode set to warn (each
synchronising call site is reported once, with its stack), and every 5 s the caching allocator's
counters that reveal device frees and retries (cudaFree synchronises the device and spins) on stderr;
and one line per Triton compile in the process (kernel, seconds, thread), which a serving step
would wait for."""

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


def _watch_compiles() -> None:
    while "triton" not in sys.modules:
        time.sleep(0.05)
    started: dict[int, float] = {}

    def name(kw) -> str:
        fn = kw.get("fn")
        return getattr(fn, "name", None) or getattr(getattr(fn, "jit_function", None), "__name__", "?")

    def before(*_a, **kw):  # a miss of the in-memory cache: a compile (or a disk-cache load) follows
        started[threading.get_ident()] = time.perf_counter()
        return False  # never skip the compile

    def after(*_a, **kw):
        t0 = started.pop(threading.get_ident(), None)
        took = time.perf_counter() - t0 if t0 is not None else -1.0
        print(f"triton_compile pid {os.getpid()} {time.time():.2f} {name(kw)} {took:.3f}s "
              f"thread {threading.current_thread().name}", file=sys.stderr, flush=True)

    for _ in range(200):
        try:
            import triton.knobs as knobs
            knobs.runtime.jit_cache_hook = before
            knobs.runtime.jit_post_compile_hook = after
            return
        except Exception:  # noqa: BLE001 - triton still importing
            time.sleep(0.05)


if os.environ.get("INFERNO_CUDA_WATCH") == "1":
    threading.Thread(target=_watch, name="cuda-watch", daemon=True).start()
    threading.Thread(target=_watch_compiles, name="compile-watch", daemon=True).start()
