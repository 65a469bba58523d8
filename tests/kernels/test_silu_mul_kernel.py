"""SiLU-and-mul: Triton vs reference, and the reference vs HF's act(gate) * up."""

from __future__ import annotations

import pytest
import torch
from kernel_checks import TOL, rel_err

from services.worker.kernels import silu_mul as K


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,inter", [(1, 16), (3, 37), (6, 1500)])
def test_silu_mul_matches_reference(dtype, rows, inter, device):
    # A strided view, as a slice of a wider projection output would be.
    x = torch.randn(rows, 2 * inter + 5, device=device).mul(3).to(dtype)[:, : 2 * inter]
    out = K.silu_mul(x)
    ref = K.silu_mul_ref(x)
    assert out.shape == (rows, inter) and out.dtype == dtype
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) <= TOL[dtype]


def test_reference_equals_hf_mlp_activation():
    x = torch.randn(4, 2 * 24)
    gate, up = x[:, :24], x[:, 24:]
    assert torch.equal(K.silu_mul_ref(x), torch.nn.functional.silu(gate) * up)


def test_rejects_odd_width(device):
    with pytest.raises(ValueError, match="even"):
        K.silu_mul(torch.randn(2, 7, device=device))
