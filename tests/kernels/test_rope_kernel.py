"""RoPE + KV write: the cos/sin table vs HF, the reference vs HF's rotation, Triton vs reference."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from kernel_checks import TOL, rel_err

from services.worker.kernels import rope as K

LLAMA3_SCALING = SimpleNamespace(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=64)


def _hf_rotary(head_dim: int, theta: float, scaling):
    modeling_llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    from transformers import LlamaConfig

    rope_scaling = None if scaling is None else {
        "rope_type": "llama3", "factor": scaling.factor, "low_freq_factor": scaling.low_freq_factor,
        "high_freq_factor": scaling.high_freq_factor,
        "original_max_position_embeddings": scaling.original_max_position_embeddings,
    }
    cfg = LlamaConfig(hidden_size=head_dim * 2, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=head_dim, rope_theta=theta, rope_scaling=rope_scaling,
                      max_position_embeddings=512)
    return modeling_llama, modeling_llama.LlamaRotaryEmbedding(cfg)


@pytest.mark.parametrize("scaling", [None, LLAMA3_SCALING], ids=["default", "llama3"])
def test_cos_sin_cache_equals_hf(scaling):
    head_dim, theta = 64, 500000.0
    _, rotary = _hf_rotary(head_dim, theta, scaling)
    cache = K.rope_cos_sin_cache(head_dim, 300, theta, scaling)
    assert cache.shape == (300, head_dim) and cache.dtype == torch.float32
    positions = torch.arange(300)[None, :]
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    assert torch.equal(cache[:, : head_dim // 2], cos[0, :, : head_dim // 2])
    assert torch.equal(cache[:, head_dim // 2:], sin[0, :, : head_dim // 2])
    assert torch.equal(K.rope_inv_freq(head_dim, theta, scaling), rotary.inv_freq)


def test_reference_rotation_equals_hf_in_fp32():
    head_dim = 32
    modeling_llama, rotary = _hf_rotary(head_dim, 10000.0, None)
    t, hq, hkv = 9, 4, 2
    q = torch.randn(t, hq, head_dim)
    k = torch.randn(t, hkv, head_dim)
    v = torch.randn(t, hkv, head_dim)
    positions = torch.randint(0, 200, (t,))
    cache = K.rope_cos_sin_cache(head_dim, 256, 10000.0)
    kc = torch.zeros(4, 16, hkv, head_dim)
    vc = torch.zeros_like(kc)
    q_rot, k_rot = K.rope_kv_write_ref(q, k, v, positions, cache, kc, vc, torch.arange(t))
    cos, sin = rotary(q, positions[None, :])
    hf_q, hf_k = modeling_llama.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    assert torch.equal(q_rot, hf_q[0].transpose(0, 1))
    assert torch.equal(k_rot, hf_k[0].transpose(0, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,head_dim,page", [(4, 4, 16, 16), (8, 2, 32, 16), (8, 1, 64, 8), (6, 3, 48, 4)])
def test_rope_kv_write_matches_reference(dtype, hq, hkv, head_dim, page, device):
    t, n_blocks = 11, 6
    # q, k, v as strided views into one fused qkv projection output.
    qkv = torch.randn(t, (hq + 2 * hkv) * head_dim, device=device).to(dtype)
    q = qkv[:, : hq * head_dim].view(t, hq, head_dim)
    k = qkv[:, hq * head_dim:(hq + hkv) * head_dim].view(t, hkv, head_dim)
    v = qkv[:, (hq + hkv) * head_dim:].view(t, hkv, head_dim)
    positions = torch.randint(0, 100, (t,), device=device)
    cos_sin = K.rope_cos_sin_cache(head_dim, 128, 10000.0).to(device)
    slots = torch.randperm(n_blocks * page)[:t].to(device)
    slots[[2, 7]] = -1  # padding tokens write nothing
    kc = torch.full((n_blocks, page, hkv, head_dim), float("nan"), dtype=dtype, device=device)
    vc = torch.full_like(kc, float("nan"))
    kc_ref, vc_ref = kc.clone(), vc.clone()

    q_rot, k_rot = K.rope_kv_write(q, k, v, positions, cos_sin, kc, vc, slots)
    q_ref, k_ref = K.rope_kv_write_ref(q, k, v, positions, cos_sin, kc_ref, vc_ref, slots)

    assert q_rot.shape == (t, hq, head_dim) and q_rot.dtype == dtype
    assert rel_err(q_rot, q_ref) <= TOL[dtype]
    assert rel_err(k_rot, k_ref) <= TOL[dtype]
    written = torch.zeros(n_blocks * page, dtype=torch.bool, device=device)
    written[slots[slots >= 0]] = True
    flat_k, flat_v = kc.view(-1, hkv, head_dim), vc.view(-1, hkv, head_dim)
    # Targeted slots hold exactly k_rot and v; every other slot is still poisoned.
    assert torch.isfinite(flat_k[written]).all() and torch.isfinite(flat_v[written]).all()
    assert torch.isnan(flat_k[~written]).all() and torch.isnan(flat_v[~written]).all()
    valid = slots >= 0
    assert torch.equal(flat_k[slots[valid]], k_rot[valid])
    assert torch.equal(flat_v[slots[valid]], v[valid])
    assert rel_err(flat_k[written], kc_ref.view(-1, hkv, head_dim)[written]) <= TOL[dtype]
    assert torch.equal(vc.nan_to_num(0.0), vc_ref.nan_to_num(0.0))
    # The inputs are not rotated in place.
    assert torch.isfinite(qkv).all()


def test_single_token_decode(device):
    head_dim = 32
    q = torch.randn(1, 4, head_dim, device=device)
    k = torch.randn(1, 2, head_dim, device=device)
    v = torch.randn(1, 2, head_dim, device=device)
    cos_sin = K.rope_cos_sin_cache(head_dim, 64, 10000.0).to(device)
    pos = torch.tensor([63], device=device)
    slot = torch.tensor([21], device=device)
    kc = torch.full((2, 16, 2, head_dim), float("nan"), device=device)
    vc = kc.clone()
    q_rot, k_rot = K.rope_kv_write(q, k, v, pos, cos_sin, kc, vc, slot)
    q_ref, k_ref = K.rope_kv_write_ref(q, k, v, pos, cos_sin, kc.clone(), vc.clone(), slot)
    assert rel_err(q_rot, q_ref) <= 1e-5 and rel_err(k_rot, k_ref) <= 1e-5
    assert torch.equal(kc[1, 5], k_rot[0]) and torch.equal(vc[1, 5], v[0])
    assert torch.isnan(kc[0]).all() and torch.isnan(kc[1, :5]).all() and torch.isnan(kc[1, 6:]).all()


def test_position_zero_is_identity(device):
    q = torch.randn(3, 2, 16, device=device)
    cos_sin = K.rope_cos_sin_cache(16, 8, 10000.0).to(device)
    kc = torch.zeros(1, 16, 2, 16, device=device)
    q_rot, k_rot = K.rope_kv_write(q, q, q, torch.zeros(3, dtype=torch.long, device=device), cos_sin,
                                   kc, kc.clone(), torch.arange(3, device=device))
    assert torch.equal(q_rot, q) and torch.equal(k_rot, q)


def test_rejects_bad_arguments(device):
    q = torch.randn(2, 4, 16, device=device)
    k = torch.randn(2, 2, 16, device=device)
    cos_sin = K.rope_cos_sin_cache(16, 8, 10000.0).to(device)
    kc = torch.zeros(2, 16, 2, 16, device=device)
    pos = torch.zeros(2, dtype=torch.long, device=device)
    with pytest.raises(ValueError, match="v"):
        K.rope_kv_write(q, k, torch.randn(2, 3, 16, device=device), pos, cos_sin, kc, kc.clone(), pos)
    with pytest.raises(ValueError, match="cos_sin"):
        K.rope_kv_write(q, k, k, pos, cos_sin.double(), kc, kc.clone(), pos)
    with pytest.raises(ValueError, match="last dimension"):
        K.rope_kv_write(q.transpose(1, 2).contiguous().transpose(1, 2), k, k, pos, cos_sin, kc, kc.clone(), pos)


def test_rope_kv_write_into_an_fp8_cache(device):
    """The fp8 cache gets the rotated k and v rounded as torch rounds them, saturated at ±448."""
    t, hq, hkv, head_dim, page, n_blocks = 9, 8, 2, 32, 16, 2
    q = torch.randn(t, hq, head_dim, device=device).to(torch.bfloat16)
    k = (torch.randn(t, hkv, head_dim, device=device) * 4).to(torch.bfloat16)
    v = torch.randn(t, hkv, head_dim, device=device).to(torch.bfloat16)
    v[0, 0, :4] = torch.tensor([1000.0, -1000.0, 0.001, -3.3])  # past the range, subnormal, plain
    positions = torch.randint(0, 100, (t,), device=device)
    cos_sin = K.rope_cos_sin_cache(head_dim, 128, 10000.0).to(device)
    slots = torch.randperm(n_blocks * page)[:t].to(device)
    kc = torch.zeros((n_blocks, page, hkv, head_dim), dtype=torch.float8_e4m3fn, device=device)
    vc, kc_ref, vc_ref = kc.clone(), kc.clone(), kc.clone()
    _, k_rot = K.rope_kv_write(q, k, v, positions, cos_sin, kc, vc, slots)
    K.rope_kv_write_ref(q, k, v, positions, cos_sin, kc_ref, vc_ref, slots)
    assert torch.equal(vc.float(), vc_ref.float())
    assert vc.view(-1, hkv, head_dim)[slots[0], 0, :2].float().tolist() == [448.0, -448.0]
    # k is rotated in fp32 by both; a rounding tie may fall either way, one fp8 step at most.
    diff = (kc.float() - kc_ref.float()).abs()
    assert (diff <= kc_ref.float().abs() / 8 + 1e-3).all() and (diff > 0).float().mean() < 0.05


def test_llama4_reference_equals_transformers_rotary_and_qk_norm():
    """Llama 4's complex-number rotary over interleaved pairs and its L2 QK-norm: the reference's q and
    k are transformers' with each head's pairs in the half-split order (K.halves)."""
    modeling_llama4 = pytest.importorskip("transformers.models.llama4.modeling_llama4")
    t, hq, hkv, head_dim = 7, 4, 2, 16
    q, k, v = torch.randn(t, hq, head_dim), torch.randn(t, hkv, head_dim), torch.randn(t, hkv, head_dim)
    positions = torch.randint(0, 60, (t,))
    cos_sin = K.rope_cos_sin_cache(head_dim, 64, 500000.0, LLAMA3_SCALING)
    kc = torch.zeros(1, 16, hkv, head_dim)
    q_rot, k_rot = K.rope_kv_write_ref(q, k, v, positions, cos_sin, kc, kc.clone(), torch.arange(t),
                                       interleave=True, norm_eps=1e-5)
    inv_freq = K.rope_inv_freq(head_dim, 500000.0, LLAMA3_SCALING)
    freqs = positions[None, :, None].float() * inv_freq
    hf_q, hf_k = modeling_llama4.apply_rotary_emb(q[None], k[None], torch.polar(torch.ones_like(freqs), freqs))
    norm = modeling_llama4.Llama4TextL2Norm(1e-5)
    assert rel_err(q_rot, K.halves(norm(hf_q[0]), True)) <= 1e-6
    assert rel_err(k_rot, K.halves(norm(hf_k[0]), True)) <= 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", ["interleave-norm", "nope-scale"])
def test_llama4_variants_match_reference(variant, dtype, device):
    """A RoPE layer of Llama 4 (interleaved pairs, then the L2 QK-norm) and a NoPE one (no rotation,
    each token's q scaled by its temperature): q, k and the cache as the reference has them."""
    t, hq, hkv, head_dim, page = 9, 4, 2, 16, 8
    qkv = torch.randn(t, (hq + 2 * hkv) * head_dim, device=device).to(dtype)
    q, k, v = (x.view(t, -1, head_dim) for x in qkv.split([hq * head_dim, hkv * head_dim, hkv * head_dim], -1))
    positions = torch.randint(0, 60, (t,), device=device)
    rope = variant == "interleave-norm"
    kwargs = dict(interleave=True, norm_eps=1e-5) if rope else dict(
        q_scale=torch.rand(t, device=device) + 1.0)
    cos_sin = K.rope_cos_sin_cache(head_dim, 64, 10000.0).to(device) if rope else None
    slots = torch.randperm(3 * page)[:t].to(device)
    kc = torch.full((3, page, hkv, head_dim), float("nan"), dtype=dtype, device=device)
    vc, kc_ref, vc_ref = kc.clone(), kc.clone(), kc.clone()
    q_rot, k_rot = K.rope_kv_write(q, k, v, positions, cos_sin, kc, vc, slots, **kwargs)
    q_ref, k_ref = K.rope_kv_write_ref(q, k, v, positions, cos_sin, kc_ref, vc_ref, slots, **kwargs)
    assert rel_err(q_rot, q_ref) <= TOL[dtype] and rel_err(k_rot, k_ref) <= TOL[dtype]
    assert rel_err(kc.view(-1, hkv, head_dim)[slots], kc_ref.view(-1, hkv, head_dim)[slots]) <= TOL[dtype]
    assert torch.equal(vc.nan_to_num(0.0), vc_ref.nan_to_num(0.0))
    if not rope:  # nothing rotated: k is written as it came
        assert torch.equal(kc.view(-1, hkv, head_dim)[slots], k)
