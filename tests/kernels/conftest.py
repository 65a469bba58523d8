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


def pytest_collection_modifyitems(config, items):
    """Under the interpreter, a test parametrized by `second_read` (the sampler's two ways of the
    second read, test_sampling_kernel.py) and by cases of its own takes the two ways in turn over
    its cases instead of every case both ways: a case whose positions in its parametrize lists sum
    to an even number runs one way, an odd one the other, so every case of every list still meets
    a way and each list's cases meet both (with two or more), at half the cost: the full product
    took ~25 min on a 2-core machine. A test with one case keeps both ways. Compiled on a GPU,
    everything runs."""
    if not INTERPRET:
        return
    cases: dict[str, list] = {}
    for item in items:
        spec = getattr(item, "callspec", None)
        if spec is not None and "second_read" in spec.params:
            cases.setdefault(item.nodeid.split("[")[0], []).append(item)
    dropped = []
    for members in cases.values():
        own = [_own_ids(item) for item in members]
        seen: list[list[str]] = [[] for _ in own[0]]  # each list's case ids, in order
        for ids in own:
            for k, case in enumerate(ids):
                if case not in seen[k]:
                    seen[k].append(case)
        if all(len(cases_k) < 2 for cases_k in seen):
            continue
        for item, ids in zip(members, own):
            parity = sum(seen[k].index(case) for k, case in enumerate(ids)) % 2
            if item.callspec.params["second_read"] != ("rows", "chunks")[parity]:
                dropped.append(item)
    if dropped:
        gone = set(map(id, dropped))
        items[:] = [item for item in items if id(item) not in gone]
        config.hook.pytest_deselected(items=dropped)


def _own_ids(item) -> list[str]:
    """The ids of the item's cases, one per parametrize list, second_read's left out."""
    ids = list(getattr(item.callspec, "_idlist", None) or [item.callspec.id])
    way = item.callspec.params["second_read"]
    if way in ids:
        ids.remove(way)
    else:  # no per-list ids: the whole id without the way, as one list
        ids = [item.callspec.id.replace(way, "", 1)]
    return ids
