"""fp8 (e4m3) weights and activations for the linear layers (`--quantization fp8`), as vLLM's
online fp8: each weight row (output channel) gets a scale, its amax / 448, when the model is
loaded; each activation row (token) gets one per call. The GEMM runs on fp8 tensor cores with
both scales applied to its fp32 result (cuBLASLt through torch._scaled_mm): half the weight bytes
of bf16 and twice the multiply rate, so about half the energy per token at large batches.

The Triton kernel quantizes activation rows in one launch (SiLU(gate) * up fused in for the down
projection); the torch references define the math: the CPU path and the tests run them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.worker.kernels._common import FLOAT_DTYPES, FP8_KV, FP8_MAX, cast_rtne, check, check_tensor, to_kv

FP8 = FP8_KV  # e4m3, the format of both weights and activations
_MIN_AMAX = 1e-12  # an all-zero row keeps a finite scale


def quantize_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (fp8 [M, K], fp32 [M, 1] scales) with x ≈ q * scale, rows rounded to nearest even."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp(min=_MIN_AMAX) / FP8_MAX
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def silu_mul_quantize_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, 2I] = [gate | up] -> quantize_rows_ref(silu(gate) * up), the product in x's dtype."""
    inter = x.shape[-1] // 2
    return quantize_rows_ref(torch.nn.functional.silu(x[:, :inter]) * x[:, inter:])


def linear_fp8_ref(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor,
                   out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """(xq * x_scale) @ (weight * w_scale)ᵀ in fp32: weight fp8 [N, K], w_scale fp32 [N]."""
    y = (xq.float() @ weight.float().t()) * x_scale * w_scale[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [N, K] -> (fp8 [N, K], fp32 [N]): one scale per output channel."""
    q, scale = quantize_rows_ref(w)
    return q, scale[:, 0].contiguous()


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, cols, x_stride, q_stride,
                          SILU_MUL: tl.constexpr, BLOCK: tl.constexpr):
    """One program per row: pass 1 finds the row's amax, pass 2 writes q = x / scale. With
    SILU_MUL the row is [gate | up] and x = silu(gate) * up (rounded to x's dtype, as torch's
    two ops would), so the down projection's input is never written in 16 bits."""
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * x_stride
    amax = tl.zeros([BLOCK], tl.float32)
    for c0 in range(0, cols, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        x = _row_values(base, c, cols, SILU_MUL)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0), 1e-12) / 448.0
    tl.store(scale_ptr + row, scale)
    for c0 in range(0, cols, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        x = _row_values(base, c, cols, SILU_MUL)
        tl.store(q_ptr + row * q_stride + c, to_kv(x / scale, q_ptr.dtype.element_ty), mask=c < cols)


@triton.jit
def _row_values(base, c, cols, SILU_MUL: tl.constexpr):
    mask = c < cols
    if SILU_MUL:
        gate = tl.load(base + c, mask=mask, other=0.0)
        up = tl.load(base + cols + c, mask=mask, other=0.0)
        g = gate.to(tl.float32)
        act = cast_rtne(g / (1.0 + tl.exp(-g)), gate.dtype).to(tl.float32)  # torch's silu, in x's dtype
        return cast_rtne(act * up.to(tl.float32), gate.dtype).to(tl.float32)
    return tl.load(base + c, mask=mask, other=0.0).to(tl.float32)


def quantize_rows(x: torch.Tensor, silu_mul: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as quantize_rows_ref (silu_mul: as silu_mul_quantize_rows_ref), one launch."""
    check_tensor(x, "x", ndim=2, dtypes=FLOAT_DTYPES)
    rows, cols = x.shape[0], x.shape[1] // 2 if silu_mul else x.shape[1]
    check(not silu_mul or x.shape[1] % 2 == 0, "[gate | up] needs an even width, got {}", x.shape[1])
    q = torch.empty((rows, cols), dtype=FP8, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows and cols:
        block = min(2048, triton.next_power_of_2(cols))
        _quantize_rows_kernel[(rows,)](x, q, scale, cols, x.stride(0), q.stride(0),
                                       SILU_MUL=silu_mul, BLOCK=block, num_warps=4)
    return q, scale


def linear_fp8(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor,
               out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as linear_fp8_ref, on the GPU's fp8 tensor cores (row counts padded to 16,
    which cuBLASLt's fp8 GEMM needs)."""
    m = xq.shape[0]
    pad = -m % 16
    if pad:
        xq = torch.nn.functional.pad(xq.view(torch.uint8), (0, 0, 0, pad)).view(FP8)
        x_scale = torch.nn.functional.pad(x_scale, (0, 0, 0, pad), value=1.0)
    y = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=w_scale[None, :], out_dtype=out_dtype)
    y = y[:m] if pad else y
    return y + bias if bias is not None else y
