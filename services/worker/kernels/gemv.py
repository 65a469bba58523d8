"""Linear layers of a few rows (decode steps): y = x Wᵀ (+ b) that streams each weight row once.

At M = 1..8 rows a projection is a read of its weight matrix and nothing else, so the kernel is
built for bandwidth, not for FLOPs: each program owns `block_n` output rows and streams their
whole K, row-major weights read with 16-byte vector loads, `num_stages - 1` loop steps in flight
through a cp.async ring in shared memory; x is a few KB and is read from L2. The K loop is split
between the program's warps (each warp a slice of every row's tile, summed once at the end): no
split-K across programs, so no workspace, no second kernel and a deterministic sum. cuBLAS takes
larger M (see `MAX_ROWS`); `bench/gemv_probe.py` times both and the block sizes below.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from services.worker.kernels._common import (FLOAT_DTYPES, FP8_KV, cast_rtne, check, check_shape, check_tensor, pdl_args,
                                             pdl_enter)
from services.worker.kernels.rmsnorm import fused_add_rmsnorm_ref
from services.worker.kernels.silu_mul import silu_mul_ref

# The most rows the kernel takes (an fp32 accumulator per row of x in every thread).
MAX_ROWS = 8
# Past this many rows cuBLAS's tiles reuse each weight load across rows, which this kernel does
# not, so TritonOps sends larger inputs to cuBLAS. H100, 8B shapes (bench/gemv_probe.py): a decode
# step's projections at 1 / 2 / 4 rows take 5.19 / 5.32 / 5.47 ms here against cuBLAS's 5.64 /
# 5.66 / 5.73, but at 8 rows 6.09 against 5.69.
DISPATCH_MAX_ROWS = 4
# Every program recomputes the activation of the columns it reads: at more rows of x that costs
# more ALU time than the separate silu_mul launch it saves.
FUSED_SILU_MAX_ROWS = 2
# The same holds for the residual add and RMS norm made on the way in (add_rmsnorm_linear).
# INFERNO_FUSED_NORM=0 keeps them apart (A/B runs).
FUSED_NORM_MAX_ROWS = 2 if os.environ.get("INFERNO_FUSED_NORM", "1") != "0" else 0


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               scale: torch.Tensor | None = None) -> torch.Tensor:
    """scale (fp32 [N]): weight is fp8 and row n stands for weight[n] * scale[n]; the product is
    taken in fp32 then, with x as it is (the GEMV's weight-only fp8)."""
    if scale is None:
        return F.linear(x, weight, bias)
    y = (x.float() @ weight.float().t()) * scale[None, :]
    return (y if bias is None else y + bias.float()).to(x.dtype)


def silu_mul_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                        scale: torch.Tensor | None = None) -> torch.Tensor:
    """x: [M, 2K] = [gate | up] -> linear(silu(gate) * up): the MLP's down projection."""
    return linear_ref(silu_mul_ref(x), weight, bias, scale)


@dataclass(frozen=True, slots=True)
class GemvConfig:
    block_n: int     # output rows per program
    block_k: int     # weight columns per loop step (a multiple of one warp's 32 vectors)
    num_stages: int  # loop steps in flight, counting the one being summed

    def __post_init__(self):
        for name in ("block_n", "block_k"):
            value = getattr(self, name)
            check(value > 0 and value & (value - 1) == 0, "{} must be a power of two, got {}", name, value)
        check(self.num_stages >= 1, "num_stages must be at least 1, got {}", self.num_stages)


def _vector(dtype: torch.dtype) -> int:
    """Elements per 16-byte load."""
    return 16 // dtype.itemsize


def _num_warps(block_k: int, dtype: torch.dtype) -> int:
    # Every warp spans at least one row of 32 vectors of the tile, so the loads, the products and
    # the accumulator share one layout (warps along K only): no shuffle through shared memory
    # inside the loop, which a layout change would cost.
    return max(1, min(8, block_k // (32 * _vector(dtype))))


def gemv_config(m: int, n: int, k: int, dtype: torch.dtype) -> GemvConfig:
    """Block sizes from the shape alone (graph capture allows no tuning at run time); the choices
    to compare on an H100 are bench/gemv_probe.py's. Up to 8192 rows (qkv, o_proj, down_proj),
    4 rows and 2 warps a program: 1024-1536 programs, all resident at once (one wave, so none
    waits for a second round); past that (gate_up, the LM head) there are many waves anyway and
    8 rows a program halve the reads of x."""
    vec = _vector(dtype)
    small_n = n <= 8192
    # fp8 weights (16 to a vector) at K = 4096: steps of 512 columns (one warp a program) beat
    # 1,024 by 4-6 % (bench/gemv_fp8_probe.py at bfb45c8, H100: qkv 18.8 -> 17.4 us, o_proj 14.6 -> 13.7).
    per_thread = 32 if dtype.itemsize == 1 and small_n and k <= 4096 else 64 if small_n else 128
    block_k = per_thread * vec
    block_k = min(block_k, max(32 * vec, triton.next_power_of_2(k)))
    # An fp32 accumulator per x row and weight row in every thread: at 4+ rows of x, 8 weight
    # rows would pass 100 registers and halve the programs an SM holds.
    block_n = 4 if small_n or m > 2 else 8
    return GemvConfig(block_n=block_n, block_k=block_k, num_stages=3)


@triton.jit
def _halves(t):
    """[A, B, 2C] -> its even and its odd columns, each [A, B, C] (a thread's own registers)."""
    return tl.split(tl.reshape(t, (t.shape[0], t.shape[1], t.shape[2] // 2, 2)))


@triton.jit
def _fma_runs(acc, x, w, RUN: tl.constexpr):
    """acc [M, N, C] + the sums of x [M, 1, RUN*C] * w [1, N, RUN*C] over runs of RUN adjacent
    columns: one fma per product, chained in a thread's registers. (A tl.sum over the run would
    cost a mul and an add per product; a [M, N, RUN*C] accumulator, RUN times the registers.)"""
    if RUN == 1:
        acc = tl.fma(x, w, acc)
    else:
        x_even, x_odd = _halves(x)
        w_even, w_odd = _halves(w)
        acc = _fma_runs(acc, x_even, w_even, RUN // 2)
        acc = _fma_runs(acc, x_odd, w_odd, RUN // 2)
    return acc


# Nothing here changes per step: N, K and the strides come with the layer, M with the batch (of
# its values Triton singles out only 1, which has its own BLOCK_M anyway), so the graph buckets'
# warm-up compiles every variant serving will launch.
@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, s_ptr, out_ptr,
    r_ptr, nw_ptr, r_out_ptr,
    M, N, K,
    x_stride, w_stride, out_stride,
    r_stride, r_out_stride, eps,
    HAS_BIAS: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    SILU_MUL: tl.constexpr,
    NORM: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    VEC: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_K)
    # Rows past the end of x and W are clamped onto the last real one (read, never stored), so
    # the loads need no row mask. 64-bit offsets: an LM head can pass 2^31 elements.
    w_rows = tl.minimum(rows, N - 1).to(tl.int64)
    x_rows = tl.minimum(m, M - 1).to(tl.int64)
    # One 3-D layout for everything in the loop: [x row, weight row, column].
    w_ptrs = w_ptr + w_rows[None, :, None] * w_stride + cols[None, None, :]
    x_ptrs = x_ptr + x_rows[:, None, None] * x_stride + cols[None, None, :]
    act_ty = x_ptr.dtype.element_ty
    if NORM:  # the residual, and where program 0 writes x + residual (its other rows: masked)
        r_ptrs = r_ptr + x_rows[:, None, None] * r_stride + cols[None, None, :]
        r_out_ptrs = r_out_ptr + x_rows[:, None, None] * r_out_stride + cols[None, None, :]
        r_out_rows = (m < tl.where(pid == 0, M, 0))[:, None, None]
        squares = tl.zeros([BLOCK_M, 1, BLOCK_K // VEC], dtype=tl.float32)

    # A thread's products of each VEC-column vector are chained into one accumulator: with the
    # step one vector a thread (BLOCK_K = 32 * VEC * warps), BLOCK_M * BLOCK_N registers.
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K // VEC], dtype=tl.float32)
    # An explicit num_stages makes Triton pipeline these loads (no tl.dot in the loop) through
    # cp.async into shared memory: NUM_STAGES - 1 steps in flight while one is summed.
    for k in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        in_k = None if EVEN_K else (k + cols < K)[None, None, :]
        zero = None if EVEN_K else 0.0
        w = tl.load(w_ptrs + k, mask=in_k, other=zero)
        xk = tl.load(x_ptrs + k, mask=in_k, other=zero)
        if SILU_MUL:
            # x is [gate | up]: the activation is made here, rounded exactly as silu_mul.py
            # rounds it (silu to the activation dtype, then the product), so the sum is the
            # unfused path's bit for bit. A masked column is silu(0) * 0 = 0.
            up = tl.load(x_ptrs + K + k, mask=in_k, other=zero)
            gate = xk.to(tl.float32)
            act = cast_rtne(gate / (1.0 + tl.exp(-gate)), act_ty).to(tl.float32)
            xk = cast_rtne(act * up.to(tl.float32), act_ty)
        if NORM:
            # x + residual, rounded as rmsnorm.py rounds it, is this row's new residual; its
            # squares are summed on the way (every program streams all of K), and its RMS scale
            # is applied to the sum after the loop: rmsnorm(x + r) · W = rstd · ((x + r) ⊙ nw) · W.
            res = tl.load(r_ptrs + k, mask=in_k, other=zero)
            h = cast_rtne(xk.to(tl.float32) + res.to(tl.float32), act_ty)
            tl.store(r_out_ptrs + k, h, mask=r_out_rows if EVEN_K else r_out_rows & in_k)
            hf = h.to(tl.float32)
            squares = _fma_runs(squares, hf, hf, VEC)
            nw = tl.load(nw_ptr + k + cols[None, None, :], mask=in_k, other=zero)
            xk = hf * nw.to(tl.float32)
        acc = _fma_runs(acc, xk.to(tl.float32), w.to(tl.float32), VEC)

    y = tl.sum(acc, axis=2)
    if NORM:
        rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(squares, axis=2) / K + eps))  # [BLOCK_M, 1]
        y *= rstd
    if HAS_SCALE:  # fp8 weights: each row's scale, once, after its sum
        y *= tl.load(s_ptr + w_rows)[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + w_rows).to(tl.float32)[None, :]
    mask = (m < M)[:, None] & (rows < N)[None, :]
    tl.store(out_ptr + m[:, None] * out_stride + rows[None, :], cast_rtne(y, out_ptr.dtype.element_ty), mask=mask)


def _launch(x, weight, bias, k: int, silu_mul: bool, config: GemvConfig | None,
            scale: torch.Tensor | None = None, norm: tuple | None = None) -> torch.Tensor:
    """norm: (residual, norm weight, eps, new residual [M, K] to fill): x is normed on the way in."""
    check_tensor(weight, "weight", ndim=2, dtypes=(x.dtype,) if scale is None else (FP8_KV,), device=x.device)
    m, n = x.shape[0], weight.shape[0]
    check_shape(weight, "weight", (n, k))
    if scale is not None:
        check_tensor(scale, "scale", ndim=1, dtypes=(torch.float32,), device=x.device, contiguous=True)
        check_shape(scale, "scale", (n,))
    if bias is not None:
        check_tensor(bias, "bias", ndim=1, dtypes=(x.dtype,), device=x.device, contiguous=True)
        check_shape(bias, "bias", (n,))
    check(m <= MAX_ROWS, "{} rows is past the GEMV's {} (use cuBLAS)", m, MAX_ROWS)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(m, n))
    # Vectors of 16 bytes of the weight (16 fp8 values, 8 bf16): the weight is what is streamed.
    config = config or gemv_config(m, n, k, weight.dtype)
    vec = _vector(weight.dtype)
    check(config.block_k >= vec, "block_k {} is under one {}-element vector", config.block_k, vec)
    grid = (triton.cdiv(n, config.block_n),)
    residual, norm_weight, eps, new_residual = norm if norm is not None else (x, x, 0.0, x)
    _gemv_kernel[grid](
        x, weight, bias if bias is not None else weight, scale if scale is not None else weight, out,
        residual, norm_weight, new_residual,
        m, n, k,
        x.stride(0), weight.stride(0), out.stride(0),
        residual.stride(0), new_residual.stride(0), float(eps),
        HAS_BIAS=bias is not None, HAS_SCALE=scale is not None, SILU_MUL=silu_mul, NORM=norm is not None,
        EVEN_K=k % config.block_k == 0,
        BLOCK_M=triton.next_power_of_2(m), BLOCK_N=config.block_n, BLOCK_K=config.block_k, VEC=vec,
        NUM_STAGES=config.num_stages, num_warps=_num_warps(config.block_k, weight.dtype), **pdl_args(x.device),
    )
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           config: GemvConfig | None = None, scale: torch.Tensor | None = None) -> torch.Tensor:
    """x: [M <= MAX_ROWS, K] (row stride free, last dim contiguous), weight [N, K] (same),
    bias [N] or None, all one dtype -> new [M, N] tensor in x.dtype, summed in fp32. With scale
    (fp32 [N]) the weight is fp8 (`--quantization fp8`): half the bytes to stream, x unquantized."""
    check_tensor(x, "x", ndim=2, dtypes=FLOAT_DTYPES)
    return _launch(x, weight, bias, x.shape[1], False, config, scale)


def silu_mul_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    config: GemvConfig | None = None, scale: torch.Tensor | None = None) -> torch.Tensor:
    """x: [M <= MAX_ROWS, 2K] = [gate | up], weight [N, K] -> linear(silu_mul(x), weight, bias),
    the activation made on the fly (no [M, K] tensor written and read back, no extra launch)."""
    check_tensor(x, "x", ndim=2, dtypes=FLOAT_DTYPES)
    check(x.shape[1] % 2 == 0, "x's last dimension must be even (gate | up), got {}", x.shape[1])
    return _launch(x, weight, bias, x.shape[1] // 2, True, config, scale)


def add_rmsnorm_linear_ref(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                           weight: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(rmsnorm(x + residual)), x + residual): a decoder layer's norm and the projection after it."""
    h, new_residual = fused_add_rmsnorm_ref(x, residual, norm_weight, eps)
    return linear_ref(h, weight, bias), new_residual


def add_rmsnorm_linear(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                       weight: torch.Tensor, bias: torch.Tensor | None = None,
                       config: GemvConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """add_rmsnorm_linear_ref in one kernel: the residual add and the RMS norm made on the way into
    the GEMV, no normed [M, K] tensor written and read back and no norm launch (64 a step of an 8B
    decode). Not the unfused path bit for bit: the normed input is not rounded to x.dtype before
    the product, and the RMS scale multiplies the sum (fp32 rounding apart, the same value)."""
    check_tensor(x, "x", ndim=2, dtypes=FLOAT_DTYPES)
    m, k = x.shape
    check_tensor(residual, "residual", ndim=2, dtypes=(x.dtype,), device=x.device)
    check_shape(residual, "residual", (m, k))
    check_tensor(norm_weight, "norm_weight", ndim=1, dtypes=(x.dtype,), device=x.device, contiguous=True)
    check_shape(norm_weight, "norm_weight", (k,))
    check(float(eps) >= 0.0, "eps must be non-negative")
    new_residual = torch.empty((m, k), dtype=x.dtype, device=x.device)
    if m and not weight.shape[0]:  # no program would write the new residual
        new_residual.copy_(residual + x)
    out = _launch(x, weight, bias, k, False, config, norm=(residual, norm_weight, eps, new_residual))
    return out, new_residual
