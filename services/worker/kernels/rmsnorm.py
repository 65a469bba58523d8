"""RMSNorm and fused residual-add + RMSNorm: the Triton kernel and its torch reference."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.worker.kernels._common import (
    FLOAT_DTYPES, cast_rtne, check, check_shape, check_tensor, next_power_of_2, pdl_args, pdl_enter)


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm's exact order: normalise in fp32, cast back, then multiply by the weight."""
    xf = x.float()
    variance = xf.pow(2).mean(-1, keepdim=True)
    normed = xf * torch.rsqrt(variance + eps)
    return (weight * normed.to(x.dtype)).to(x.dtype)


def fused_add_rmsnorm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual), x + residual), the sum rounded to x.dtype as HF's decoder layer does."""
    new_residual = residual + x
    return rmsnorm_ref(new_residual, weight, eps), new_residual


# The row count changes every eager step: specialising on it (== 1, % 16) would compile a
# variant mid-serving for each new pattern.
@triton.jit(do_not_specialize=["n_rows"])
def _rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    n_rows, n_cols,
    x_stride, res_stride, out_stride, res_out_stride,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    pid = tl.program_id(0)
    rows = (pid * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    col_mask = cols < n_cols
    mask = (rows < n_rows)[:, None] & col_mask[None, :]

    x = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + rows[:, None] * res_stride + cols[None, :], mask=mask, other=0.0)
        # Rounded to the activation dtype, like HF's `residual + hidden_states`.
        x = cast_rtne(r.to(tl.float32) + x.to(tl.float32), x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + rows[:, None] * res_out_stride + cols[None, :], x, mask=mask)

    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, axis=1) / n_cols
    rstd = tl.div_rn(1.0, tl.sqrt_rn(variance + eps))
    # HF casts the normalised row back to the input dtype before the weight multiply.
    normed = cast_rtne(xf * rstd[:, None], x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    y = normed * w[None, :]
    tl.store(out_ptr + rows[:, None] * out_stride + cols[None, :], cast_rtne(y, out_ptr.dtype.element_ty),
             mask=mask)


def _launch_config(n_rows: int, n_cols: int) -> tuple[int, int, int]:
    block_h = next_power_of_2(n_cols)
    # Narrow rows (per-head q/k norm, head_dim 64-256) are packed several to a program.
    block_r = max(1, min(64, 2048 // block_h))
    num_warps = max(1, min(16, block_r * block_h // 512))
    return block_r, block_h, num_warps


def _check_args(x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    check_tensor(x, "x", ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor(weight, "weight", ndim=1, dtypes=FLOAT_DTYPES, device=x.device, contiguous=True)
    check_shape(weight, "weight", (x.shape[1],))
    check(x.shape[1] <= 65536, "hidden size {} is too large for a one-tile row", x.shape[1])
    check(float(eps) >= 0.0, "eps must be non-negative")


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, H] (row stride free, last dim contiguous) -> new [T, H] tensor in x.dtype."""
    _check_args(x, weight, eps)
    n_rows, n_cols = x.shape
    out = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    if n_rows == 0:
        return out
    block_r, block_h, num_warps = _launch_config(n_rows, n_cols)
    grid = (triton.cdiv(n_rows, block_r),)
    _rmsnorm_kernel[grid](
        x, x, weight, out, out,
        n_rows, n_cols,
        x.stride(0), x.stride(0), out.stride(0), out.stride(0),
        float(eps),
        HAS_RESIDUAL=False, BLOCK_R=block_r, BLOCK_H=block_h, num_warps=num_warps, **pdl_args(x.device),
    )
    return out


def fused_add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (rmsnorm(x + residual), x + residual), both new [T, H] tensors in x.dtype."""
    _check_args(x, weight, eps)
    check_tensor(residual, "residual", ndim=2, dtypes=(x.dtype,), device=x.device)
    check_shape(residual, "residual", tuple(x.shape))
    n_rows, n_cols = x.shape
    out = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    new_residual = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    if n_rows == 0:
        return out, new_residual
    block_r, block_h, num_warps = _launch_config(n_rows, n_cols)
    grid = (triton.cdiv(n_rows, block_r),)
    _rmsnorm_kernel[grid](
        x, residual, weight, out, new_residual,
        n_rows, n_cols,
        x.stride(0), residual.stride(0), out.stride(0), new_residual.stride(0),
        float(eps),
        HAS_RESIDUAL=True, BLOCK_R=block_r, BLOCK_H=block_h, num_warps=num_warps, **pdl_args(x.device),
    )
    return out, new_residual
