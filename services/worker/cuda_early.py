"""The GPU's context and the loader's pinned staging, made through the CUDA driver on a thread that
starts before torch is imported (W5b: process start to first token).

At process start `import torch` takes 4-7 s on the H100 VM. After it the worker paid, in line,
~0.37 s to create the CUDA context and ~0.5 s to page-lock the loader's staging buffers: driver
work that needs no torch. Here a daemon thread does both through libcuda (ctypes calls drop the
GIL) while the interpreter imports. torch's runtime later finds the device's primary context made
(the driver keeps one per device, shared by the runtime and by this code), and the loader takes
these buffers as its staging (page-locked for every context: portable). On an H100 (three starts
each, bench/w5b_ab.sh, 2026-11-27) the worker's device part went from 1.02 to 0.16 s, and what
follows the imports from 3.26 to 2.38 s; the imports themselves vary by a second from start to
start, with or without this thread. Standard library only; best effort: on any failure the worker
does as before.
"""

from __future__ import annotations

import ctypes
import threading
import time

STAGING_BYTES = 16 << 20  # one staging buffer of the loader (engine/loader.py): the bytes of one disk read and one copy
_PORTABLE = 0x01  # CU_MEMHOSTALLOC_PORTABLE: pinned for every context, the runtime's included


class EarlyDevice:
    """Starts the driver's context for one device and allocates `count` pinned buffers of `nbytes`."""

    def __init__(self, ordinal: int, count: int, nbytes: int):
        self.ordinal, self.count, self.nbytes = ordinal, count, nbytes
        self.pointers: list[int] = []
        self.error = ""
        self.seconds = 0.0
        self._thread = threading.Thread(target=self._run, name="cuda-early", daemon=True)

    def start(self) -> EarlyDevice:
        self._thread.start()
        return self

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            cuda = ctypes.CDLL("libcuda.so.1")
            dev, ctx = ctypes.c_int(), ctypes.c_void_p()
            _check(cuda.cuInit(0), "cuInit")
            _check(cuda.cuDeviceGet(ctypes.byref(dev), self.ordinal), "cuDeviceGet")
            _check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
            _check(cuda.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
            cuda.cuMemHostAlloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint]
            for _ in range(self.count):
                ptr = ctypes.c_void_p()
                _check(cuda.cuMemHostAlloc(ctypes.byref(ptr), self.nbytes, _PORTABLE), "cuMemHostAlloc")
                self.pointers.append(ptr.value)
            _check(cuda.cuCtxSetCurrent(None), "cuCtxSetCurrent")  # this thread ends; the context stays retained
        except (OSError, AttributeError, RuntimeError) as e:
            self.error = str(e)
        self.seconds = time.perf_counter() - t0

    def buffers(self, timeout: float = 10.0) -> list[memoryview]:
        """The pinned buffers as writable memoryviews (none if the driver failed), once the thread is done."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            return []
        return [memoryview((ctypes.c_ubyte * self.nbytes).from_address(p)).cast("B") for p in self.pointers]

    def report(self) -> dict:
        return {"early_device_s": round(self.seconds, 3), "early_staging": len(self.pointers),
                **({"early_device_error": self.error} if self.error else {})}


def _check(result: int, call: str) -> None:
    if result != 0:
        raise RuntimeError(f"{call} returned CUDA error {result}")


def device_ordinal(device: str) -> int | None:
    """The ordinal of a "cuda" or "cuda:N" device string; None for any other device."""
    if device == "cuda":
        return 0
    head, _, tail = device.partition(":")
    return int(tail) if head == "cuda" and tail.isdigit() else None


def start_early_device(device: str, count: int, nbytes: int) -> EarlyDevice | None:
    ordinal = device_ordinal(device)
    return EarlyDevice(ordinal, count, nbytes).start() if ordinal is not None else None
