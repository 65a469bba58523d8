"""The one-shot all-reduce over peer memory that small tensor-parallel messages take instead of
NCCL: the buffers every rank maps (CUDA IPC), the Triton kernel, and which messages it serves.

Each rank owns a data buffer (two halves of `max_bytes`) and a signal buffer, and maps every
peer's. One kernel per call, every rank making the same calls in the same order:

  state = [calls, done] lives in the rank's own memory; the call reads calls = c, so its flag is
  c + 1 and its half h = c % 2. Block b of the grid
    1. copies its tiles of x into half h of this rank's data buffer,
    2. writes the flag into slot [rank, b] of every peer's signal buffer (release, system scope),
    3. waits until slot [p, b] of its own signal buffer holds at least the flag for every peer p
       (acquire, system scope): peer p's block b has copied its tiles,
    4. sums those tiles of half h of every rank's buffer, in rank order and in fp32, into x;
  the last block to finish (it counts itself in `done`) resets `done` and stores calls = c + 1.

The counter lives on the device, so a captured CUDA graph replays correctly: no argument changes
from call to call. No second barrier is needed: a rank that writes half h again (call c + 2) has
finished call c + 1, for which every peer had arrived, so every peer had finished call c (a
stream runs its kernels in order) and its reads of half h. Flags only grow (int64), so a peer
already on to call c + 1 still satisfies "at least". Summing in rank order on every rank gives
every rank the same bits, which tensor parallelism needs (the ranks' hidden states must agree).

Setup is collective over a process group: the ranks exchange their buffers' IPC handles (plain
bytes, msgpack) and agree that every one of them could map every other's; otherwise none uses it.

Waiting is a spin on the GPU with no deadline: a rank that dies mid-call leaves its peers
spinning until the group's watchdog ends them (as NCCL would hang). Ranks must be processes of
their own: CUDA loads a kernel at its first launch and loading waits for the context's kernels
in flight, so two ranks sharing one context can wait on each other for ever.
"""

from __future__ import annotations

import msgpack
import torch
import torch.distributed as dist
import triton
import triton.language as tl

from services.worker.engine.cuda_ipc import open_shared, share
from services.worker.kernels._common import cast_rtne, next_power_of_2, pdl_args, pdl_enter

MAX_RANKS = 8
MAX_BLOCKS = 128  # a signal buffer has one slot per (rank, block)
TILE_BYTES = 4096  # one block's tile per loop step: 16 bytes for each of 256 threads
NUM_WARPS = 8
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def default_max_bytes(world: int) -> int:
    """Largest message served. One-shot reads (world - 1) × the message over the links on every
    rank, so its edge over NCCL's ring shrinks with the group. Two H100s over NVLink (2026-11-27,
    in graphs, bf16): one-shot 5.9 / 13.7 / 21.1 µs against NCCL's 14.5 / 35.5 / 40.3 µs at
    8 KB / 2 MB / 4 MB, so two ranks take it up to 4 MiB (the 70B shape's batch 256 × 8192);
    larger groups are not measured yet."""
    return 4 << 20 if world == 2 else 512 << 10


class PeerMemoryUnavailable(RuntimeError):
    """Setup found that some rank cannot map its peers' memory; every rank raises it together."""


def all_reduce_ref(inputs: list[torch.Tensor]) -> torch.Tensor:
    """What every rank gets: the ranks' tensors summed in rank order in fp32, cast back."""
    acc = inputs[0].float()
    for t in inputs[1:]:
        acc = acc + t.float()
    return acc.to(inputs[0].dtype)


@triton.jit
def _nth(i: tl.constexpr, p0, p1, p2, p3, p4, p5, p6, p7):
    if i == 0:
        p = p0
    elif i == 1:
        p = p1
    elif i == 2:
        p = p2
    elif i == 3:
        p = p3
    elif i == 4:
        p = p4
    elif i == 5:
        p = p5
    elif i == 6:
        p = p6
    else:
        p = p7
    return p


@triton.jit
def _begin_call(state_ptr, b0, b1, b2, b3, b4, b5, b6, b7, RANK: tl.constexpr, HALF: tl.constexpr):
    """This call's flag (its number + 1), its half of the data buffers, and this rank's half."""
    calls = tl.load(state_ptr)
    half = (calls % 2) * HALF
    return calls + 1, half, _nth(RANK, b0, b1, b2, b3, b4, b5, b6, b7) + half


@triton.jit
def _exchange(pid, flag, s0, s1, s2, s3, s4, s5, s6, s7,
              WORLD: tl.constexpr, RANK: tl.constexpr, SLOTS: tl.constexpr):
    """Block pid has copied its part into this rank's buffer: say so to every peer, then wait
    until every peer's block pid has said so for this call."""
    # Every thread's copy is done before the release below publishes it.
    tl.debug_barrier()
    for p in tl.static_range(WORLD):
        if p != RANK:  # this block's own copy needs no flag: the barrier above ordered it
            sig = _nth(p, s0, s1, s2, s3, s4, s5, s6, s7)
            tl.atomic_xchg(sig + RANK * SLOTS + pid, flag, sem="release", scope="sys")
    inbox = _nth(RANK, s0, s1, s2, s3, s4, s5, s6, s7) + pid
    for p in tl.static_range(WORLD):
        if p != RANK:
            seen = tl.atomic_add(inbox + p * SLOTS, 0, sem="acquire", scope="sys")
            while seen < flag:
                seen = tl.atomic_add(inbox + p * SLOTS, 0, sem="acquire", scope="sys")
    tl.debug_barrier()


@triton.jit
def _end_call(state_ptr, grid, flag):
    """The last block to finish resets the done count and moves the call counter on."""
    tl.debug_barrier()
    done = tl.atomic_add(state_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if done == grid - 1:
        tl.store(state_ptr + 1, 0)
        tl.store(state_ptr, flag)


@triton.jit
def _one_shot_all_reduce_kernel(
    x_ptr, n,
    b0, b1, b2, b3, b4, b5, b6, b7,  # every rank's data buffer (as x's dtype), rank order
    s0, s1, s2, s3, s4, s5, s6, s7,  # every rank's signal buffer (int64 [MAX_RANKS, SLOTS])
    state_ptr,  # this rank's int64 [calls, done]
    WORLD: tl.constexpr, RANK: tl.constexpr, HALF: tl.constexpr, SLOTS: tl.constexpr,
    BLOCK: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    flag, half, own = _begin_call(state_ptr, b0, b1, b2, b3, b4, b5, b6, b7, RANK, HALF)
    for start in range(pid * BLOCK, n, grid * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(own + offs, tl.load(x_ptr + offs, mask=mask), mask=mask)
    _exchange(pid, flag, s0, s1, s2, s3, s4, s5, s6, s7, WORLD, RANK, SLOTS)
    for start in range(pid * BLOCK, n, grid * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        # .cg: through L2 only, so no line a previous call left in this SM's L1 is read.
        acc = tl.load(b0 + half + offs, mask=mask, cache_modifier=".cg").to(tl.float32)
        for r in tl.static_range(1, WORLD):
            peer = _nth(r, b0, b1, b2, b3, b4, b5, b6, b7)
            acc += tl.load(peer + half + offs, mask=mask, cache_modifier=".cg").to(tl.float32)
        tl.store(x_ptr + offs, acc.to(x_ptr.dtype.element_ty), mask=mask)
    _end_call(state_ptr, grid, flag)


@triton.jit(do_not_specialize=["n_rows"])  # eager steps change the row count every time
def _one_shot_add_rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_rows, n_cols, eps,
    b0, b1, b2, b3, b4, b5, b6, b7,
    s0, s1, s2, s3, s4, s5, s6, s7,
    state_ptr,
    WORLD: tl.constexpr, RANK: tl.constexpr, HALF: tl.constexpr, SLOTS: tl.constexpr,
    BLOCK_H: tl.constexpr, PDL: tl.constexpr = False,
):
    """The one-shot all-reduce of x [n_rows, n_cols], then the decoder's residual add and RMSNorm
    on the sum (kernels/rmsnorm.py's order and roundings): two kernels of a tensor-parallel layer
    in one. A block owns whole rows (rows pid, pid + grid, ...), so the flags stay per block as in
    the plain kernel, whose protocol (halves, flags, the counter) this follows line for line."""
    pdl_enter(PDL)
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    flag, half, own = _begin_call(state_ptr, b0, b1, b2, b3, b4, b5, b6, b7, RANK, HALF)
    cols = tl.arange(0, BLOCK_H)
    cmask = cols < n_cols
    for row in range(pid, n_rows, grid):
        offs = row * n_cols + cols
        tl.store(own + offs, tl.load(x_ptr + offs, mask=cmask), mask=cmask)
    _exchange(pid, flag, s0, s1, s2, s3, s4, s5, s6, s7, WORLD, RANK, SLOTS)
    dtype = x_ptr.dtype.element_ty
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    for row in range(pid, n_rows, grid):
        offs = row * n_cols + cols
        acc = tl.load(b0 + half + offs, mask=cmask, other=0.0, cache_modifier=".cg").to(tl.float32)
        for r in tl.static_range(1, WORLD):
            peer = _nth(r, b0, b1, b2, b3, b4, b5, b6, b7)
            acc += tl.load(peer + half + offs, mask=cmask, other=0.0, cache_modifier=".cg").to(tl.float32)
        reduced = cast_rtne(acc, dtype)  # what the plain kernel leaves in x
        res = tl.load(res_ptr + offs, mask=cmask, other=0.0)
        summed = cast_rtne(res.to(tl.float32) + reduced.to(tl.float32), dtype)
        tl.store(res_out_ptr + offs, summed, mask=cmask)
        sf = summed.to(tl.float32)
        rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(sf * sf, axis=0) / n_cols + eps))
        normed = cast_rtne(sf * rstd, dtype).to(tl.float32)
        tl.store(out_ptr + offs, cast_rtne(normed * w, dtype), mask=cmask)
    _end_call(state_ptr, grid, flag)


MAX_NORM_COLS = 16384  # one row per block, in registers: hidden sizes up to 16k


class CustomAllReduce:
    """One rank's side: every rank's buffers (its own and the peers' mappings, in rank order)
    and its own counter. Built by `setup` over a process group; tests and benchmarks may build
    one from buffers they made themselves (all ranks in one process, or shared CPU memory
    under TRITON_INTERPRET)."""

    def __init__(self, rank: int, buffers: list[torch.Tensor], signals: list[torch.Tensor],
                 state: torch.Tensor, max_bytes: int):
        world = len(buffers)
        if not 2 <= world <= MAX_RANKS or len(signals) != world or not 0 <= rank < world:
            raise ValueError(f"rank {rank} of {world} buffers and {len(signals)} signal buffers "
                             f"(2 to {MAX_RANKS} ranks)")
        if max_bytes <= 0 or max_bytes % TILE_BYTES:
            raise ValueError(f"max_bytes {max_bytes} must be a positive multiple of {TILE_BYTES}")
        self.device = buffers[rank].device
        for t in buffers:
            _expect(t, torch.uint8, 2 * max_bytes, self.device, "data buffer")
        for t in signals:
            _expect(t, torch.int64, MAX_RANKS * MAX_BLOCKS, self.device, "signal buffer")
        _expect(state, torch.int64, 2, self.device, "state")
        self.rank, self.world, self.max_bytes = rank, world, max_bytes
        self.state = state
        pad = MAX_RANKS - world
        sigs = tuple(signals) + (signals[rank],) * pad
        # Per dtype: the launch's pointer arguments and constants, built once (eager calls pay
        # Triton's launch on the host every time).
        self._launch = {}
        for dt in DTYPES:
            size = torch.empty((), dtype=dt).element_size()
            bufs = tuple(b.view(dt) for b in buffers) + (buffers[rank].view(dt),) * pad
            self._launch[dt] = (TILE_BYTES // size, bufs + sigs + (state,),
                                dict(WORLD=world, RANK=rank, HALF=max_bytes // size, SLOTS=MAX_BLOCKS,
                                     BLOCK=TILE_BYTES // size, num_warps=NUM_WARPS, **pdl_args(self.device)))
        self._mappings = (buffers, signals)  # the peers' mappings live as long as this object

    def serves(self, x: torch.Tensor) -> bool:
        return serves(x.device, self.device, x.dtype, x.numel() * x.element_size(), x.is_contiguous(),
                      self.max_bytes)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the group in place (and return it). The caller checked `serves(x)`."""
        if not self.serves(x):
            raise ValueError(f"the one-shot all-reduce does not serve {x.dtype} {tuple(x.shape)} on {x.device} "
                             f"(contiguous {self.device} {DTYPES}, up to {self.max_bytes} bytes)")
        n = x.numel()
        block, args, consts = self._launch[x.dtype]
        _one_shot_all_reduce_kernel[(min(triton.cdiv(n, block), MAX_BLOCKS),)](x, n, *args, **consts)
        return x

    def serves_add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> bool:
        return (self.serves(x) and x.dim() == 2 and 0 < x.shape[1] <= MAX_NORM_COLS
                and residual.shape == x.shape and residual.dtype == x.dtype and residual.is_contiguous()
                and residual.device == x.device and weight.shape == (x.shape[1],) and weight.is_contiguous()
                and weight.device == x.device)

    def all_reduce_add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                               eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(rmsnorm(sum(x) + residual) * weight, sum(x) + residual), new tensors, in one kernel:
        what all_reduce(x) then kernels/rmsnorm.fused_add_rmsnorm give. x is left as it was (its
        sum lives only in the data buffers). The caller checked `serves_add_rmsnorm`."""
        if not self.serves_add_rmsnorm(x, residual, weight):
            raise ValueError(f"the fused all-reduce does not serve x {x.dtype} {tuple(x.shape)}, residual "
                             f"{tuple(residual.shape)}, weight {tuple(weight.shape)}")
        rows, cols = x.shape
        out, new_residual = torch.empty_like(x), torch.empty_like(x)
        _, args, consts = self._launch[x.dtype]
        consts = {k: v for k, v in consts.items() if k != "BLOCK"}
        _one_shot_add_rmsnorm_kernel[(min(rows, MAX_BLOCKS),)](
            x, residual, weight, out, new_residual, rows, cols, float(eps), *args,
            BLOCK_H=next_power_of_2(cols), **consts)
        return out, new_residual

    @classmethod
    def setup(cls, group, device: torch.device, max_bytes: int | None = None) -> "CustomAllReduce":
        """Collective over `group` (NCCL or gloo): allocate, exchange IPC handles, map the peers'.
        Raises PeerMemoryUnavailable on every rank if any rank failed."""
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        max_bytes = max_bytes or default_max_bytes(world)
        if not 2 <= world <= MAX_RANKS:
            raise PeerMemoryUnavailable(f"a group of {world} ranks (the kernel serves 2 to {MAX_RANKS})")
        buffers, signals, error, mine = [], [], "", b""
        try:
            buffer = torch.zeros(2 * max_bytes, dtype=torch.uint8, device=device)
            signal = torch.zeros(MAX_RANKS * MAX_BLOCKS, dtype=torch.int64, device=device)
            state = torch.zeros(2, dtype=torch.int64, device=device)
            # Zeroed on the device before any peer can learn of the buffers (and write a flag).
            torch.cuda.synchronize(device)
            mine = msgpack.packb({"device": device.index, "data": share(buffer),
                                  "signal": share(signal)})
        except Exception as e:  # noqa: BLE001 - whatever it was, this rank cannot take part
            error = f"rank {rank}: {type(e).__name__}: {e}"
        blobs = _all_gather_bytes(mine, group)  # an empty blob: that rank failed and says why below
        if not error and all(blobs):
            try:
                for r, blob in enumerate(blobs):
                    if r == rank:
                        buffers.append(buffer)
                        signals.append(signal)
                        continue
                    peer = msgpack.unpackb(blob)
                    if peer["device"] != device.index and not torch.cuda.can_device_access_peer(device, peer["device"]):
                        raise RuntimeError(f"cuda:{device.index} cannot reach cuda:{peer['device']} (no peer access)")
                    buffers.append(open_shared(peer["data"], device))
                    signals.append(open_shared(peer["signal"], device).view(torch.int64))
            except Exception as e:  # noqa: BLE001
                error = f"rank {rank}: {type(e).__name__}: {e}"
        failures = [m.decode() for m in _all_gather_bytes(error.encode(), group) if m]
        if failures:
            raise PeerMemoryUnavailable("; ".join(failures))
        return cls(rank, buffers, signals, state, max_bytes)


def serves(x_device: torch.device, device: torch.device, dtype: torch.dtype, nbytes: int, contiguous: bool,
           max_bytes: int) -> bool:
    """The messages the one-shot kernel takes; NCCL (or gloo) takes the others."""
    return x_device == device and dtype in DTYPES and contiguous and 0 < nbytes <= max_bytes


def _expect(t: torch.Tensor, dtype: torch.dtype, numel: int, device: torch.device, name: str) -> None:
    if t.dtype != dtype or t.numel() != numel or t.device != device or not t.is_contiguous():
        raise ValueError(f"{name}: {t.dtype} {tuple(t.shape)} on {t.device}; expected a contiguous "
                         f"{dtype} of {numel} elements on {device}")


def _all_gather_bytes(blob: bytes, group) -> list[bytes]:
    """Every rank's bytes, in rank order, through the group's own backend (CPU tensors for gloo,
    this rank's GPU for NCCL)."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
    world = dist.get_world_size(group)
    length = torch.tensor([len(blob)], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(length) for _ in range(world)]
    dist.all_gather(lengths, length, group=group)
    sizes = [int(t.item()) for t in lengths]
    data = torch.zeros(max(1, max(sizes)), dtype=torch.uint8)
    data[:len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else data[:0]
    data = data.to(device)
    gathered = [torch.empty_like(data) for _ in range(world)]
    dist.all_gather(gathered, data, group=group)
    return [bytes(t[:s].cpu().numpy().tobytes()) for t, s in zip(gathered, sizes)]
