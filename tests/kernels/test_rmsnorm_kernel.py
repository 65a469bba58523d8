"""RMSNorm / fused add-RMSNorm: Triton vs reference, and the reference vs HF's LlamaRMSNorm."""

from __future__ import annotations

import pytest
import torch
from kernel_checks import TOL, rel_err

from services.worker.kernels import rmsnorm as K

DTYPES = [torch.float32, torch.bfloat16]


def _strided(rows: int, cols: int, dtype, device, pad: int = 7) -> torch.Tensor:
    """A [rows, cols] view with row stride cols + pad (last dim contiguous)."""
    return torch.randn(rows, cols + pad, device=device).to(dtype)[:, :cols]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols", [(1, 64), (5, 100), (33, 256)])
def test_rmsnorm_matches_reference(dtype, rows, cols, device):
    x = _strided(rows, cols, dtype, device)
    assert x.stride(0) != cols
    w = (1.0 + 0.1 * torch.randn(cols, device=device)).to(dtype)
    out = K.rmsnorm(x, w, 1e-5)
    ref = K.rmsnorm_ref(x, w, 1e-5)
    assert out.shape == ref.shape and out.dtype == dtype
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) <= TOL[dtype]
    if dtype == torch.bfloat16:
        # Same fp32 math, same rounding points: at most an ulp apart, nearly always identical.
        assert (out != ref).float().mean().item() < 0.02


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rmsnorm_matches_reference(dtype, device):
    x = _strided(9, 96, dtype, device)
    residual = _strided(9, 96, dtype, device, pad=3)
    w = torch.randn(96, device=device).to(dtype)
    out, new_res = K.fused_add_rmsnorm(x, residual, w, 1e-6)
    ref_out, ref_res = K.fused_add_rmsnorm_ref(x, residual, w, 1e-6)
    assert torch.equal(new_res, ref_res)  # one rounded add: exact
    assert torch.equal(new_res, x + residual)
    assert rel_err(out, ref_out) <= TOL[dtype]
    # The inputs are left alone.
    assert torch.isfinite(x).all() and torch.isfinite(residual).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_per_head_qk_norm_shape(dtype, device):
    """Qwen3's q/k norm: [T * heads, head_dim] rows, many narrow rows per program."""
    t, heads, head_dim = 7, 5, 32
    q = torch.randn(t, heads, head_dim, device=device).to(dtype).reshape(t * heads, head_dim)
    w = torch.randn(head_dim, device=device).to(dtype)
    assert rel_err(K.rmsnorm(q, w, 1e-6), K.rmsnorm_ref(q, w, 1e-6)) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_equals_hf_llama_rmsnorm(dtype):
    modeling_llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    norm = modeling_llama.LlamaRMSNorm(48, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(48))
        x = torch.randn(11, 48).to(dtype)
        assert torch.equal(K.rmsnorm_ref(x, norm.weight, 1e-6), norm(x))


def test_rejects_bad_arguments(device):
    x = torch.randn(4, 32, device=device)
    with pytest.raises(ValueError, match="weight"):
        K.rmsnorm(x, torch.randn(31, device=device), 1e-6)
    with pytest.raises(ValueError, match="last dimension"):
        K.rmsnorm(torch.randn(32, 4, device=device).t(), torch.randn(32, device=device), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        K.fused_add_rmsnorm(x, torch.randn(4, 32, device=device).to(torch.bfloat16),
                            torch.randn(32, device=device), 1e-6)


def test_empty_batch(device):
    out = K.rmsnorm(torch.randn(0, 32, device=device), torch.randn(32, device=device), 1e-6)
    assert out.shape == (0, 32)
