"""Kernel tests: Triton under TRITON_INTERPRET=1 on the CPU, fresh seeds per test, poisoned outputs.

TRITON_INTERPRET is set here, at import, before any kernel module is imported by these tests;
triton.jit decides interpreted vs compiled when a kernel is defined. To run the same tests
compiled on a GPU: TRITON_INTERPRET=0 pytest tests/kernels.
"""

from __future__ import annotations

import os
import sys
import zlib

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

INTERPRET = os.environ["TRITON_INTERPRET"] == "1"

if INTERPRET and "triton" in sys.modules:
    # triton.jit picks interpreted or compiled when a function is defined, triton's own library
    # (tl.sum, ...) included, so a triton imported before this file cannot be switched over.
    import triton.language as _tl

    if type(_tl.sum).__name__ != "InterpretedFunction":
        raise pytest.UsageError(
            "triton was imported (compiled mode) before tests/kernels/conftest.py could set "
            "TRITON_INTERPRET=1: set TRITON_INTERPRET=1 in the environment (or in tests/conftest.py) "
            "to run the kernel tests together with the other test directories")

if INTERPRET:
    # The interpreter's cost on the CPU is mostly its own bookkeeping: see interpreter_patching.py.
    from interpreter_patching import install as _patch_once_per_launch  # noqa: E402

    _patch_once_per_launch()

DEVICE = torch.device("cuda" if not INTERPRET and torch.cuda.is_available() else "cpu")


@pytest.fixture
def device() -> torch.device:
    return DEVICE


@pytest.fixture(autouse=True)
def _seed_per_test(request):
    """Reproducible per test, different across tests (and across parametrisations)."""
    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)
    return seed


@pytest.fixture(autouse=True)
def _poisoned_empty(monkeypatch):
    """torch.empty hands out NaN (floats) or a huge sentinel (ints): an element a kernel
    forgets to write cannot pass for a right answer."""
    real_empty = torch.empty

    def poisoned(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype != torch.bool:
            t.fill_(torch.iinfo(t.dtype).max)
        return t

    # torch.device(...) contexts find the factories to redirect in a set built once and cached: built
    # while torch.empty is this wrapper, it would miss the real one for the rest of the process, and
    # every later `with torch.device("meta")` would allocate for real (an 8B plan: 32 GB on the CPU).
    from torch.utils._device import _device_constructors
    _device_constructors()
    monkeypatch.setattr(torch, "empty", poisoned)
