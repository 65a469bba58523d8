"""fp8 linear layers: the row quantizer (Triton, interpreted) against its reference, and the
reference GEMM against the 16-bit product it approximates."""

from __future__ import annotations

import pytest
import torch
from kernel_checks import rel_err

from services.worker.kernels import fp8_linear as K


@pytest.mark.parametrize("silu_mul", [False, True])
@pytest.mark.parametrize("rows,cols", [(1, 64), (5, 300), (3, 4096)])
def test_quantize_rows_matches_reference(silu_mul, rows, cols, device):
    x = (torch.randn(rows, 2 * cols if silu_mul else cols, device=device) * 3).to(torch.bfloat16)
    x[0, :3] = torch.tensor([0.0, 1e-4, -50.0])
    ref_q, ref_s = (K.silu_mul_quantize_rows_ref if silu_mul else K.quantize_rows_ref)(x)
    q, s = K.quantize_rows(x, silu_mul=silu_mul)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (rows, 1)
    assert torch.allclose(s, ref_s, rtol=1e-6)
    # Same scale, both round to nearest even: the bytes agree (a division's last bit aside).
    assert (q.float() != ref_q.float()).float().mean() < 0.01
    assert q.float().abs().max() <= 448


def test_all_zero_rows_keep_a_finite_scale(device):
    q, s = K.quantize_rows(torch.zeros(2, 32, device=device, dtype=torch.bfloat16))
    assert torch.isfinite(s).all() and (q.float() == 0).all()


def test_fp8_linear_reference_is_near_the_16_bit_product():
    torch.manual_seed(0)
    x = torch.randn(7, 256).to(torch.bfloat16)
    w = (torch.randn(96, 256) * 0.05).to(torch.bfloat16)
    wq, ws = K.quantize_weight(w)
    assert wq.dtype == torch.float8_e4m3fn and ws.shape == (96,)
    xq, xs = K.quantize_rows_ref(x)
    y = K.linear_fp8_ref(xq, xs, wq, ws, torch.bfloat16)
    assert y.dtype == torch.bfloat16 and rel_err(y, x.float() @ w.float().t()) < 0.06
