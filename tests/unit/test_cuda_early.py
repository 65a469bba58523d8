"""The early device thread (services/worker/cuda_early.py) and the loader's staging pool it feeds.

The driver calls themselves run only on a GPU (bench/gpu_bench.sh's W5b breakdown reports them);
here: a machine without libcuda gets no buffers and no exception, and the pool hands out adopted
buffers, gives them back and fills the rest.
"""

from __future__ import annotations

import ctypes

import torch

from services.worker.cuda_early import EarlyDevice, device_ordinal, start_early_device
from services.worker.engine.loader import StagingPool


def test_device_ordinals():
    assert device_ordinal("cuda") == 0
    assert device_ordinal("cuda:3") == 3
    assert device_ordinal("cpu") is None
    assert device_ordinal("cuda:x") is None
    assert start_early_device("cpu", 2, 1024) is None


def test_without_a_driver_nothing_is_made_and_nothing_raises(monkeypatch):
    def no_driver(name, *a, **k):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", no_driver)
    early = EarlyDevice(0, 2, 1 << 20).start()
    assert early.buffers() == []
    report = early.report()
    assert report["early_staging"] == 0 and "libcuda" in report["early_device_error"]


def test_the_pool_hands_out_adopted_buffers_and_takes_them_back():
    pool = StagingPool()
    backing = [(ctypes.c_ubyte * 4096)() for _ in range(3)]  # stand-ins for the driver's pinned memory
    pool.adopt(memoryview(b).cast("B") for b in backing)
    assert len(pool) == 3
    taken = pool.take(2)
    assert len(pool) == 1 and all(t.dtype == torch.uint8 and t.numel() == 4096 for t in taken)
    taken[0][:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)  # writable, and the same memory
    assert bytes(backing[0])[:4] == b"\x01\x02\x03\x04"
    pool.give(taken)
    assert len(pool) == 3


def test_fill_tops_the_pool_up_to_a_count(monkeypatch):
    from services.worker.engine import loader

    made = []
    real_empty = torch.empty

    def empty(*shape, **kw):  # pinned memory needs a GPU: the count is what is checked here
        kw.pop("pin_memory", None)
        made.append(shape)
        return real_empty(*shape, **kw)

    monkeypatch.setattr(loader.torch, "empty", empty)
    pool = StagingPool()
    pool.adopt([torch.zeros(16, dtype=torch.uint8)])
    pool.fill(3)
    assert len(pool) == 3 and len(made) == 2
    pool.fill(2)
    assert len(pool) == 3 and len(made) == 2
    assert len(pool.take(5)) == 5 and len(made) == 4


def test_warm_device_off_the_gpu_has_no_staging():
    """The worker's pool of pinned buffers exists on a GPU only; the marks are the breakdown's."""
    from services.worker.model_build import warm_device
    from shared.config import WorkerServiceConfig

    warm = warm_device(WorkerServiceConfig(device="cpu"))
    assert warm.staging is None
    assert warm.marks["imported_at"] <= warm.marks["device_at"]
