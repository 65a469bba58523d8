"""Kernel tests: Triton under TRITON_INTERPRET=1 on the CPU, fresh seeds per test, poisoned outputs.

TRITON_INTERPRET is set here, at import, before any kernel module is imported by these tests;
triton.jit decides interpreted vs compiled when a kernel is defined. To run the same tests
compiled on a GPU: TRITON_INTERPRET=0 pytest tests/kernels.
"""

from __future__ import annotations

import importlib
import os
import sys
import zlib

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

INTERPRET = os.environ["TRITON_INTERPRET"] == "1"

# If another test directory imported the kernels first (compiled), re-define them interpreted.
if INTERPRET:
    _common = sys.modules.get("services.worker.kernels._common")
    if _common is not None and not bool(_common.INTERPRET):
        for _name in ("_common", "decode_attention", "extend_attention", "rmsnorm", "rope", "sampling",
                      "silu_mul"):
            _mod = sys.modules.get(f"services.worker.kernels.{_name}")
            if _mod is not None:
                importlib.reload(_mod)

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

    monkeypatch.setattr(torch, "empty", poisoned)
