"""SiLU-and-multiply of the fused gate/up projection: the Triton kernel and its torch reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from services.worker.kernels._common import FLOAT_DTYPES, cast_rtne, check, check_tensor, pdl_args, pdl_enter


def silu_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] = [gate | up] -> silu(gate) * up, in x.dtype like HF's `act_fn(gate) * up`."""
    inter = x.shape[-1] // 2
    return F.silu(x[..., :inter]) * x[..., inter:]


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, inter, x_stride, out_stride, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + inter + cols, mask=mask, other=0.0).to(tl.float32)
    # silu is rounded to the activation dtype before the product, as in the two-op torch form.
    act = cast_rtne(gate / (1.0 + tl.exp(-gate)), out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, cast_rtne(act * up, out_ptr.dtype.element_ty), mask=mask)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] (row stride free, last dim contiguous) -> new [T, I] tensor in x.dtype."""
    check_tensor(x, "x", ndim=2, dtypes=FLOAT_DTYPES)
    check(x.shape[1] % 2 == 0, "x's last dimension must be even (gate | up), got {}", x.shape[1])
    n_rows, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((n_rows, inter), dtype=x.dtype, device=x.device)
    if n_rows == 0 or inter == 0:
        return out
    block = 1024 if inter >= 1024 else triton.next_power_of_2(inter)
    grid = (n_rows, triton.cdiv(inter, block))
    _silu_mul_kernel[grid](x, out, inter, x.stride(0), out.stride(0), BLOCK=block, num_warps=4, **pdl_args(x.device))
    return out
