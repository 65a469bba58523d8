"""Small-M linear (decode GEMV) and its SiLU-and-mul fused form: Triton vs reference."""

from __future__ import annotations

import pytest
import torch
from kernel_checks import TOL, rel_err

from services.worker.engine.ops import TorchOps, TritonOps
from services.worker.kernels import gemv as K
from services.worker.kernels.rmsnorm import rmsnorm_ref
from services.worker.kernels.silu_mul import silu_mul

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _nan_padded(rows: int, cols: int, dtype, device, scale: float = 1.0, pad: int = 9) -> torch.Tensor:
    """A [rows, cols] view of a [rows, cols + pad] tensor whose padding is NaN: a kernel that
    reads past column `cols` of a row (a missing K mask) turns its outputs NaN."""
    full = torch.full((rows, cols + pad), float("nan"), device=device)
    full[:, :cols] = torch.randn(rows, cols, device=device) * scale
    return full.to(dtype)[:, :cols]


def _exact(x, w, bias=None) -> torch.Tensor:
    """x Wᵀ + b in float64 of the (already rounded) inputs."""
    out = x.double() @ w.double().t()
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", range(1, K.MAX_ROWS + 1))
def test_linear_matches_reference(dtype, m, device):
    # N and K multiples of no block size: the last program's rows and the last K step are partial.
    n, k = 37, 300
    x = _nan_padded(m, k, dtype, device)
    w = _nan_padded(n, k, dtype, device, scale=0.05)
    bias = torch.randn(n, device=device).to(dtype) if m % 2 else None
    out = K.linear(x, w, bias)
    assert out.shape == (m, n) and out.dtype == dtype
    assert torch.isfinite(out).all()
    exact = _exact(x, w, bias)
    assert rel_err(out, exact) <= TOL[dtype]
    assert rel_err(out, K.linear_ref(x, w, bias)) <= TOL[dtype]
    if dtype != torch.float32:
        # fp32 sums rounded once: the correctly rounded result but for near-ties.
        assert (out != exact.to(dtype)).float().mean().item() < 0.03


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", [
    K.GemvConfig(block_n=1, block_k=256, num_stages=1),
    K.GemvConfig(block_n=2, block_k=512, num_stages=2),
    K.GemvConfig(block_n=8, block_k=256, num_stages=3),
    K.GemvConfig(block_n=16, block_k=1024, num_stages=4),
])
@pytest.mark.parametrize("m", [1, 4])
def test_block_sizes_agree(dtype, config, m, device):
    """Every configuration the probe compares computes the same product, K a multiple of the
    step or not, N a multiple of the rows per program or not (two programs each: the interpreter
    runs one at a time)."""
    ring = (config.num_stages - 1) * (config.block_n + m) * config.block_k * dtype.itemsize
    if device.type == "cuda" and ring > 227 * 1024:  # the probe's 16-bit configuration, in fp32
        pytest.skip(f"a {ring // 1024} KB load ring is more shared memory than an H100 has")
    for n, k in [(2 * config.block_n, 1024), (config.block_n + 3, 600)]:
        x = _nan_padded(m, k, dtype, device)
        w = _nan_padded(n, k, dtype, device, scale=0.05)
        out = K.linear(x, w, config=config)
        assert out.shape == (m, n) and torch.isfinite(out).all()
        assert rel_err(out, _exact(x, w)) <= TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 2, 5])
def test_silu_mul_linear_equals_unfused_path(dtype, m, device):
    """The activation made inside the GEMV is silu_mul's, rounding for rounding: the fused
    result equals silu_mul followed by the GEMV bit for bit."""
    inter, n = 150, 9  # a partial last program
    x = _nan_padded(m, 2 * inter, dtype, device, scale=3.0)
    w = _nan_padded(n, inter, dtype, device, scale=0.05)
    bias = torch.randn(n, device=device).to(dtype) if m == 2 else None
    out = K.silu_mul_linear(x, w, bias)
    assert out.shape == (m, n) and torch.isfinite(out).all()
    assert torch.equal(out, K.linear(silu_mul(x), w, bias))
    assert rel_err(out, K.silu_mul_linear_ref(x, w, bias)) <= TOL[dtype]


def test_zero_rows_and_zero_width(device):
    w = torch.randn(6, 16, device=device)
    assert K.linear(torch.randn(0, 16, device=device), w).shape == (0, 6)
    bias = torch.randn(6, device=device)
    out = K.linear(torch.randn(3, 0, device=device), torch.randn(6, 0, device=device), bias)
    assert torch.equal(out, bias.expand(3, 6))


def test_rejects_bad_arguments(device):
    x = torch.randn(2, 32, device=device)
    w = torch.randn(8, 32, device=device)
    with pytest.raises(ValueError, match="contiguous in its last dimension"):
        K.linear(x, torch.randn(32, 8, device=device).t())  # a transposed (column-major) weight
    with pytest.raises(ValueError, match="contiguous in its last dimension"):
        K.linear(torch.randn(32, 2, device=device).t(), w)
    with pytest.raises(ValueError, match="dtype"):
        K.linear(x, w.to(torch.bfloat16))
    with pytest.raises(ValueError, match="shape"):
        K.linear(x, torch.randn(8, 31, device=device))
    with pytest.raises(ValueError, match="shape"):
        K.linear(x, w, torch.randn(7, device=device))
    with pytest.raises(ValueError, match="cuBLAS"):
        K.linear(torch.randn(K.MAX_ROWS + 1, 32, device=device), w)
    with pytest.raises(ValueError, match="even"):
        K.silu_mul_linear(torch.randn(2, 33, device=device), w)
    with pytest.raises(ValueError, match="power of two"):
        K.GemvConfig(block_n=3, block_k=256, num_stages=2)


def test_ops_route_by_row_count(device):
    """TritonOps: the GEMV up to DISPATCH_MAX_ROWS rows, the fused activation up to FUSED_SILU_MAX_ROWS,
    cuBLAS (torch) past them; TorchOps is torch throughout."""
    w = torch.randn(24, 40, device=device)
    triton_ops, torch_ops = TritonOps(), TorchOps()
    for m in (1, K.DISPATCH_MAX_ROWS, K.DISPATCH_MAX_ROWS + 1, K.MAX_ROWS + 3):
        x = torch.randn(m, 40, device=device)
        expected = K.linear(x, w) if m <= K.DISPATCH_MAX_ROWS else torch.nn.functional.linear(x, w)
        assert torch.equal(triton_ops.linear(x, w), expected)
        assert torch.equal(torch_ops.linear(x, w), torch.nn.functional.linear(x, w))
    for m in (1, K.FUSED_SILU_MAX_ROWS + 1, K.MAX_ROWS + 1):
        gate_up = torch.randn(m, 80, device=device)
        out = triton_ops.silu_mul_linear(gate_up, w)
        assert torch.equal(out, triton_ops.linear(silu_mul(gate_up), w))
        assert rel_err(torch_ops.silu_mul_linear(gate_up, w), out) <= TOL[torch.float32]


@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("silu_mul", [False, True])
def test_fp8_weights_with_per_row_scales(m, silu_mul, device):
    """--quantization fp8 at decode sizes: the weight streamed as e4m3 (16 a vector), each output
    row times its scale after the sum, x unquantized; as the fp32 reference on the same values."""
    from services.worker.kernels.fp8_linear import quantize_weight

    n, k = 18, 384  # a partial last program
    w = (torch.randn(n, k, device=device) * 0.05).to(torch.bfloat16)
    wq, scale = quantize_weight(w)
    bias = torch.randn(n, device=device).to(torch.bfloat16)
    x = torch.randn(m, 2 * k if silu_mul else k, device=device).to(torch.bfloat16)
    fn, ref = (K.silu_mul_linear, K.silu_mul_linear_ref) if silu_mul else (K.linear, K.linear_ref)
    out = fn(x, wq, bias, scale=scale)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, ref(x, wq, bias, scale)) <= 1e-2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 2, 3])
def test_add_rmsnorm_linear_matches_the_unfused_path(dtype, m, device):
    """The residual add and RMS norm made inside the GEMV: the new residual is the norm kernel's
    bit for bit; the product agrees with norm-then-GEMV to the dtype's tolerance (the normed input
    is not rounded before the product there)."""
    n, k = 7, 300  # a partial last program and a partial last K step
    x = _nan_padded(m, k, dtype, device, scale=2.0)
    residual = _nan_padded(m, k, dtype, device, scale=2.0)
    norm_w = (1.0 + 0.1 * torch.randn(k, device=device)).to(dtype)
    w = _nan_padded(n, k, dtype, device, scale=0.05)
    bias = torch.randn(n, device=device).to(dtype) if m == 2 else None
    out, new_residual = K.add_rmsnorm_linear(x, residual, norm_w, 1e-5, w, bias)
    want, want_residual = K.add_rmsnorm_linear_ref(x, residual, norm_w, 1e-5, w, bias)
    assert out.shape == (m, n) and out.dtype == dtype and torch.isfinite(out).all()
    assert torch.equal(new_residual, want_residual)
    assert rel_err(out, want) <= TOL[dtype]
    normed = rmsnorm_ref(want_residual, norm_w, 1e-5)
    assert rel_err(out, _exact(normed, w, bias)) <= TOL[dtype]


@pytest.mark.parametrize("config", [
    K.GemvConfig(block_n=1, block_k=256, num_stages=1),
    K.GemvConfig(block_n=8, block_k=512, num_stages=3),
])
def test_add_rmsnorm_linear_block_sizes(config, device):
    """K a multiple of the step or not; every program but the first leaves the residual alone (two
    programs or more; the second one partial)."""
    for n, k in [(2 * config.block_n, 1024), (config.block_n + 3, 600)]:
        x = _nan_padded(2, k, torch.bfloat16, device)
        residual = _nan_padded(2, k, torch.bfloat16, device)
        norm_w = torch.ones(k, device=device, dtype=torch.bfloat16)
        w = _nan_padded(n, k, torch.bfloat16, device, scale=0.05)
        out, new_residual = K.add_rmsnorm_linear(x, residual, norm_w, 1e-6, w, config=config)
        want, want_residual = K.add_rmsnorm_linear_ref(x, residual, norm_w, 1e-6, w)
        assert torch.equal(new_residual, want_residual)
        assert rel_err(out, want) <= TOL[torch.bfloat16]


def test_add_rmsnorm_linear_with_no_output_rows_still_adds(device):
    x = torch.randn(1, 64, device=device)
    residual = torch.randn(1, 64, device=device)
    out, new_residual = K.add_rmsnorm_linear(x, residual, torch.ones(64, device=device), 1e-6,
                                             torch.empty(0, 64, device=device))
    assert out.shape == (1, 0) and torch.equal(new_residual, residual + x)


def test_ops_fuse_the_norm_only_where_the_gemv_serves(device):
    """TritonOps fuse a norm into the projection after it at decode sizes; larger batches, and
    the reference ops, norm first. Both give the reference's residual."""
    from services.worker.engine.layers import Linear

    torch.manual_seed(0)
    proj = Linear(96, 40, TritonOps()).to(device)
    proj.weight.data = torch.randn(40, 96, device=device) * 0.05
    norm_w = torch.ones(96, device=device)
    for m in (1, K.FUSED_NORM_MAX_ROWS + 1):
        x, residual = torch.randn(m, 96, device=device), torch.randn(m, 96, device=device)
        got, got_residual = TritonOps().add_rmsnorm_linear(x, residual, norm_w, 1e-6, proj)
        want, want_residual = TorchOps().add_rmsnorm_linear(x, residual, norm_w, 1e-6, proj)
        assert torch.equal(got_residual, want_residual)
        assert rel_err(got, want) <= TOL[torch.float32]
