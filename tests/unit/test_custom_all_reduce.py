"""Which all-reduces the one-shot kernel over peer memory takes and which fall back to NCCL/gloo,
and its signalling protocol between processes, on the CPU.

What cannot run here: the CUDA IPC mappings (setup) and the kernel on the GPU — TRITON_INTERPRET
runs kernels on host copies of CUDA tensors, so it cannot run across processes over peer GPU
memory; bench/custom_allreduce_check.py checks those on a GPU. What does run: the same kernel
under the interpreter in two processes whose buffers are shared CPU memory, which exercises the
flags, the round counter on the "device" and the double-buffered halves (though the interpreter's
timing rarely exposes a race the real GPU would).
"""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from services.worker.engine.parallel.custom_all_reduce import (
    DTYPES, MAX_BLOCKS, MAX_RANKS, TILE_BYTES, CustomAllReduce, PeerMemoryUnavailable, all_reduce_ref,
    default_max_bytes, serves,
)
from services.worker.engine.parallel.tensor_parallel import TensorGroup

CUDA0, CUDA1, CPU = torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cpu")
LIMIT = 512 << 10


def buffers(world: int, max_bytes: int, shared: bool = False):
    data = [torch.zeros(2 * max_bytes, dtype=torch.uint8) for _ in range(world)]
    signals = [torch.zeros(MAX_RANKS * MAX_BLOCKS, dtype=torch.int64) for _ in range(world)]
    if shared:
        data = [t.share_memory_() for t in data]
        signals = [t.share_memory_() for t in signals]
    return data, signals


@pytest.mark.parametrize("dtype", DTYPES)
def test_serves_float_dtypes_up_to_the_limit(dtype):
    assert serves(CUDA0, CUDA0, dtype, 8192, True, LIMIT)
    assert serves(CUDA0, CUDA0, dtype, LIMIT, True, LIMIT)
    assert not serves(CUDA0, CUDA0, dtype, LIMIT + 2, True, LIMIT)
    assert not serves(CUDA0, CUDA0, dtype, 0, True, LIMIT)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.int64, torch.uint8])
def test_other_dtypes_fall_back(dtype):
    assert not serves(CUDA0, CUDA0, dtype, 8192, True, LIMIT)


def test_other_devices_and_strided_tensors_fall_back():
    assert not serves(CPU, CUDA0, torch.bfloat16, 8192, True, LIMIT)
    assert not serves(CUDA1, CUDA0, torch.bfloat16, 8192, True, LIMIT)
    assert not serves(CUDA0, CUDA0, torch.bfloat16, 8192, False, LIMIT)


def test_default_limit_by_group_size():
    assert default_max_bytes(2) == 4 << 20  # two ranks: batch 256 × hidden 8192 × bf16 is one-shot
    assert default_max_bytes(4) == default_max_bytes(8) == 512 << 10


def test_an_instance_routes_by_its_device_dtype_size_and_layout():
    data, signals = buffers(2, 16384)
    ar = CustomAllReduce(1, data, signals, torch.zeros(2, dtype=torch.int64), 16384)
    assert ar.serves(torch.zeros(8192, dtype=torch.bfloat16))  # 16 KB: the limit
    assert ar.serves(torch.zeros(4096, dtype=torch.float32))
    assert not ar.serves(torch.zeros(8193, dtype=torch.bfloat16))
    assert not ar.serves(torch.zeros(16, dtype=torch.float64))
    assert not ar.serves(torch.zeros(8, 16, dtype=torch.float32).t())
    assert not ar.serves(torch.zeros(16, dtype=torch.float32, device="meta"))
    with pytest.raises(ValueError, match="does not serve"):
        ar.all_reduce(torch.zeros(16, dtype=torch.float64))


def test_construction_checks_the_buffers():
    data, signals = buffers(2, 16384)
    state = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="2 to 8 ranks"):
        CustomAllReduce(0, data[:1], signals[:1], state, 16384)
    with pytest.raises(ValueError, match="rank 2 of 2"):
        CustomAllReduce(2, data, signals, state, 16384)
    with pytest.raises(ValueError, match="multiple of"):
        CustomAllReduce(0, data, signals, state, 16384 + TILE_BYTES // 2)
    with pytest.raises(ValueError, match="data buffer"):
        CustomAllReduce(0, data, signals, state, 8192)  # buffers twice the size
    with pytest.raises(ValueError, match="signal buffer"):
        CustomAllReduce(0, data, [s[:-1] for s in signals], state, 16384)


def test_reference_sums_in_rank_order_in_fp32():
    ins = [torch.tensor([1.0, 256.0], dtype=torch.bfloat16), torch.tensor([1.0, 1.0], dtype=torch.bfloat16),
           torch.tensor([0.0, 1.0], dtype=torch.bfloat16)]
    # bf16 step addition would give 256 + 1 = 256 twice; fp32 then one rounding gives 258.
    assert all_reduce_ref(ins).tolist() == [2.0, 258.0]


@pytest.fixture
def gloo_one_rank():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_tensor_group_on_gloo_sets_up_nothing(gloo_one_rank):
    tg = TensorGroup(gloo_one_rank, 2)  # a size of 2 claimed, but gloo: no peer memory, no collective
    assert tg.peer is None
    x = torch.arange(6, dtype=torch.float32)
    assert tg.all_reduce(x) is x and x.tolist() == [0, 1, 2, 3, 4, 5]
    with pytest.raises(PeerMemoryUnavailable, match="a group of 1 ranks"):
        CustomAllReduce.setup(gloo_one_rank, CPU)


class _RecordingPeer:
    def __init__(self, limit: int):
        self.limit, self.calls = limit, []

    def serves(self, x):
        return x.numel() * x.element_size() <= self.limit

    def all_reduce(self, x):
        self.calls.append(x.numel())
        return x.mul_(2)


def test_tensor_group_sends_what_the_peer_serves_there_and_the_rest_to_the_backend(gloo_one_rank):
    tg = TensorGroup(gloo_one_rank, 1)
    tg.peer = _RecordingPeer(limit=16)
    small, large = torch.ones(4), torch.ones(5)
    assert tg.all_reduce(small).tolist() == [2.0] * 4
    assert tg.all_reduce(large).tolist() == [1.0] * 5  # gloo over one rank: unchanged
    assert tg.peer.calls == [4]


# -- the kernel's protocol, interpreted, between two processes ---------------------------------
INTERP_MAX_BYTES = 16384
SIZES = (7, 1000, 2048, 4096)  # one partial tile ... several tiles per block; INTERP_MAX_BYTES too


def _interpreted_rank(rank: int, world: int, data, signals, results) -> None:
    state = torch.zeros(2, dtype=torch.int64)
    ar = CustomAllReduce(rank, data, signals, state, INTERP_MAX_BYTES)
    mismatches = []
    for step in range(4):
        for dtype in (torch.float32, torch.bfloat16):
            for numel in SIZES + (INTERP_MAX_BYTES // torch.empty((), dtype=dtype).element_size(),):
                # Integer values, different per rank and per call: a stale half or a missed flag
                # shows up as a wrong sum, and every partial sum is exact in both dtypes.
                ins = [((torch.arange(numel) * (r + 1) + 7 * step + r) % 61 - 30).to(dtype) for r in range(world)]
                x = ins[rank].clone()
                ar.all_reduce(x)
                if not torch.equal(x, all_reduce_ref(ins)):
                    mismatches.append((step, str(dtype), numel))
    results.put((rank, mismatches, state.tolist()))


def test_the_kernel_protocol_between_two_interpreted_processes(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the children import Triton afresh
    world = 2
    data, signals = buffers(world, INTERP_MAX_BYTES, shared=True)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_interpreted_rank, args=(r, world, data, signals, results)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        got = sorted(results.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    calls = 4 * 2 * (len(SIZES) + 1)
    assert got == [(r, [], [calls, 0]) for r in range(world)]
    # Block 0's last flag reached the peer's inbox; no rank signals itself.
    assert [[s[r * MAX_BLOCKS].item() for r in range(world)] for s in signals] == [[0, calls], [calls, 0]]
