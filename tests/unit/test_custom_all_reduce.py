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


def run_interpreted(target, world: int, data, signals, timeout: float = 120) -> list:
    """target(rank, world, data, signals, results) in one spawned process per rank, under the
    interpreter (set by the caller); each rank's result, in rank order."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, world, data, signals, results)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        return sorted(results.get(timeout=timeout) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def test_the_kernel_protocol_between_two_interpreted_processes(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the children import Triton afresh
    world = 2
    data, signals = buffers(world, INTERP_MAX_BYTES, shared=True)
    got = run_interpreted(_interpreted_rank, world, data, signals)
    calls = 4 * 2 * (len(SIZES) + 1)
    assert got == [(r, [], [calls, 0]) for r in range(world)]
    # Block 0's last flag reached the peer's inbox; no rank signals itself.
    assert [[s[r * MAX_BLOCKS].item() for r in range(world)] for s in signals] == [[0, calls], [calls, 0]]


# -- the one-shot all-reduce fused with the residual add and RMSNorm ---------------------------
NORM_SHAPES = ((1, 48), (3, 64), (40, 48), (100, 32))  # one row ... more rows than blocks take at once


def _norm_inputs(rows, cols, dtype, world, step):
    ins = [((torch.arange(rows * cols) * (r + 3) + 5 * step + r) % 23 - 11).to(dtype).view(rows, cols)
           for r in range(world)]
    residual = ((torch.arange(rows * cols) * 7 + step) % 13 - 6).to(dtype).view(rows, cols)
    weight = (torch.arange(cols) % 5 + 1).to(dtype) / 4
    return ins, residual, weight


def _interpreted_fused_rank(rank: int, world: int, data, signals, results) -> None:
    from services.worker.kernels.rmsnorm import fused_add_rmsnorm_ref

    state = torch.zeros(2, dtype=torch.int64)
    ar = CustomAllReduce(rank, data, signals, state, INTERP_MAX_BYTES)
    bad = []
    for step in range(2):
        for dtype in (torch.float32, torch.bfloat16):
            for rows, cols in NORM_SHAPES:
                ins, residual, weight = _norm_inputs(rows, cols, dtype, world, step)
                x = ins[rank].clone()
                assert ar.serves_add_rmsnorm(x, residual, weight)
                out, new_residual = ar.all_reduce_add_rmsnorm(x, residual, weight, 1e-6)
                ref_out, ref_residual = fused_add_rmsnorm_ref(all_reduce_ref(ins), residual, weight, 1e-6)
                tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
                if not (torch.equal(new_residual, ref_residual) and torch.equal(x, ins[rank])
                        and torch.allclose(out.float(), ref_out.float(), rtol=tol, atol=tol)):
                    bad.append((step, str(dtype), rows, cols))
                # A plain all-reduce between fused ones: the two kernels share halves and counter.
                y = ins[rank].clone().view(-1)
                ar.all_reduce(y)
                if not torch.equal(y, all_reduce_ref([t.view(-1) for t in ins])):
                    bad.append(("plain", step, str(dtype), rows, cols))
    results.put((rank, bad, state.tolist()))


def test_the_fused_kernel_between_two_interpreted_processes(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    world = 2
    data, signals = buffers(world, INTERP_MAX_BYTES, shared=True)
    got = run_interpreted(_interpreted_fused_rank, world, data, signals, timeout=180)
    calls = 2 * 2 * len(NORM_SHAPES) * 2
    assert got == [(r, [], [calls, 0]) for r in range(world)]


def test_the_fused_kernel_serves_rows_of_a_matching_residual_and_weight():
    data, signals = buffers(2, 16384)
    ar = CustomAllReduce(0, data, signals, torch.zeros(2, dtype=torch.int64), 16384)
    x, w = torch.zeros(4, 64, dtype=torch.bfloat16), torch.ones(64, dtype=torch.bfloat16)
    assert ar.serves_add_rmsnorm(x, torch.zeros_like(x), w)
    assert not ar.serves_add_rmsnorm(x, torch.zeros(4, 64, dtype=torch.float32), w)  # residual dtype
    assert not ar.serves_add_rmsnorm(x, torch.zeros(4, 32, dtype=torch.bfloat16), w)  # residual shape
    assert not ar.serves_add_rmsnorm(x, torch.zeros_like(x), torch.ones(32, dtype=torch.bfloat16))
    assert not ar.serves_add_rmsnorm(x.view(-1), torch.zeros_like(x).view(-1), w)  # rows, not a vector
    big = torch.zeros(200, 64, dtype=torch.bfloat16)  # 25.6 KB: over the limit
    assert not ar.serves_add_rmsnorm(big, torch.zeros_like(big), w)


class _RecordingFusingPeer(_RecordingPeer):
    def serves_add_rmsnorm(self, x, residual, weight):
        return self.serves(x)

    def all_reduce_add_rmsnorm(self, x, residual, weight, eps):
        self.calls.append(("fused", x.numel()))
        return x * 0 + 7, residual


def test_reducing_ops_all_reduce_before_add_rmsnorm_fused_only_when_asked(gloo_one_rank):
    from services.worker.engine.ops import TorchOps
    from services.worker.engine.parallel.tensor_parallel import ReducingOps

    x, residual, w = torch.ones(2, 4), torch.ones(2, 4), torch.ones(4)
    for fuse in (False, True):
        tg = TensorGroup(gloo_one_rank, 1, fuse_norm=fuse)
        tg.peer = _RecordingFusingPeer(limit=64)
        ops = ReducingOps(TorchOps(), tg)
        assert ops.rmsnorm is not None and ops.name == TorchOps().name  # everything else is the wrapped ops'
        out, new_residual = ops.add_rmsnorm(x.clone(), residual, w, 1e-6)
        if fuse:
            assert tg.peer.calls == [("fused", 8)] and torch.equal(out, torch.full((2, 4), 7.0))
        else:  # the plain all-reduce (doubles, as the recording peer does), then the add and norm
            assert tg.peer.calls == [8] and torch.equal(new_residual, torch.full((2, 4), 3.0))
