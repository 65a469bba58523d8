"""Rotary position embedding fused with the paged KV-cache write: the Triton kernel and its torch reference."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from services.worker.kernels._common import (
    FLOAT_DTYPES, FP8_KV, INDEX_DTYPES, cast_rtne, check, check_shape, check_tensor, copy_rows_, next_power_of_2,
    pdl_args, pdl_enter, to_kv, to_kv_ref)


def rope_inv_freq(head_dim: int, theta: float, scaling=None, device=None) -> torch.Tensor:
    """[head_dim / 2] float32, computed exactly as transformers does (llama3 scaling included)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    if scaling is None:
        return inv_freq
    if hasattr(scaling, "freq_factors"):  # llama.cpp's form: one divisor per frequency (a GGUF's rope_freqs)
        return inv_freq / torch.tensor(scaling.freq_factors, dtype=torch.float32, device=device)
    if hasattr(scaling, "beta_fast"):
        return _yarn_inv_freq(inv_freq, head_dim, theta, scaling)
    # transformers' _compute_llama3_parameters, step for step.
    factor = scaling.factor
    low_freq_factor = scaling.low_freq_factor
    high_freq_factor = scaling.high_freq_factor
    old_context_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


def _yarn_inv_freq(inv_freq: torch.Tensor, dim: int, theta: float, yarn) -> torch.Tensor:
    """transformers' _compute_yarn_parameters: the frequencies that turn fewer than beta_slow times
    over the original context are interpolated (divided by the factor), those that turn more than
    beta_fast times kept, with a linear ramp between."""
    def correction_dim(rotations):
        return dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=inv_freq.device) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    pos_freqs = 1.0 / inv_freq
    return 1.0 / (yarn.factor * pos_freqs) * (1 - extrapolation) + inv_freq * extrapolation


def rope_cos_sin_cache(head_dim: int, max_position: int, theta: float, scaling=None,
                       device=None) -> torch.Tensor:
    """[max_position, head_dim] float32: cos(pos * inv_freq) in the first half, sin in the second.

    As HF: the angles are the float32 product of the float32 position and inv_freq.
    """
    check(head_dim % 2 == 0, "head_dim must be even, got {}", head_dim)
    inv_freq = rope_inv_freq(head_dim, theta, scaling, device=device)
    positions = torch.arange(max_position, dtype=torch.int64, device=device).float()
    freqs = positions[:, None] * inv_freq[None, :]
    table = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    factor = getattr(scaling, "attention_factor", 1.0)  # YaRN scales cos and sin (as transformers does)
    return (table * factor if factor != 1.0 else table).contiguous()


def _rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    # HF's q*cos + rotate_half(q)*sin, term for term: (x1*cos + (-x2)*sin, x2*cos + x1*sin).
    return torch.cat((x1 * cos + (-x2) * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def halves(x: torch.Tensor, interleave: bool) -> torch.Tensor:
    """The rotated pairs in the half-split order (x0, x2, ... | x1, x3, ...) where the checkpoint
    pairs neighbours (x0, x1), (x2, x3), ... (DeepSeek, Llama 4's complex-number rotary)."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1) if interleave else x


def l2_norm_ref(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Each head over its mean square, no weight (Llama 4's QK-norm, Llama4TextL2Norm), in fp32."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope_kv_write_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor | None,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, interleave: bool = False,
    norm_eps: float | None = None, q_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k (neox / rotate_half style, in fp32), write k_rot and v at their slots.

    q: [T, Hq, D], k/v: [T, Hkv, D], positions/slot_mapping: [T], cos_sin: [P, D] float32,
    caches: [N, block_size, Hkv, D]. Slot s is block s // block_size, offset s % block_size;
    slots < 0 (padding) are skipped. Returns (q_rot, k_rot) in q's and k's dtypes.
    Llama 4's variants, in transformers' order: cos_sin None rotates nothing (its NoPE layers);
    interleave reads neighbours as the pairs and writes them half-split (halves()), q and k alike,
    so their dot products are unchanged; norm_eps L2-norms q and k per head after the rotation;
    q_scale (float32 [T]) multiplies each token's q last (its attention temperature).
    """
    if cos_sin is None:
        q_rot, k_rot = q, k
    else:
        half = q.shape[-1] // 2
        cs = cos_sin[positions.long()]
        cos, sin = cs[:, None, :half], cs[:, None, half:]
        q_rot = _rotate_ref(halves(q, interleave), cos, sin)
        k_rot = _rotate_ref(halves(k, interleave), cos, sin)
    if norm_eps is not None:
        q_rot, k_rot = l2_norm_ref(q_rot, norm_eps), l2_norm_ref(k_rot, norm_eps)
    if q_scale is not None:
        q_rot = (q_rot * q_scale[:, None, None]).to(q.dtype)
    n_blocks, block_size, n_kv, d = k_cache.shape
    slots = slot_mapping.long()
    valid = slots >= 0
    if bool(valid.all()):
        idx = slots
        k_new, v_new = k_rot, v
    else:
        idx = slots[valid]
        k_new, v_new = k_rot[valid], v[valid]
    copy_rows_(k_cache.view(n_blocks * block_size, n_kv, d), 0, idx, to_kv_ref(k_new, k_cache.dtype))
    copy_rows_(v_cache.view(n_blocks * block_size, n_kv, d), 0, idx, to_kv_ref(v_new, v_cache.dtype))
    return q_rot, k_rot


@triton.jit
def _rotate_store(src_ptr, src_stride_h, dst_ptr, dst_stride_h, cos, sin, heads, d, head_mask, d_mask, eps, scale,
                  HALF: tl.constexpr, INTERLEAVE: tl.constexpr, ROTATE: tl.constexpr, NORM: tl.constexpr,
                  SCALE: tl.constexpr):
    """Rotates [heads, D] at src (then norms and scales it where asked), stores the result at dst
    (in dst's dtype); returns it (fp32)."""
    mask = head_mask[:, None] & d_mask[None, :]
    # The pair one frequency turns: neighbours when interleaved (written half-split), else HALF apart.
    first = 2 * d if INTERLEAVE else d
    second = first + 1 if INTERLEAVE else d + HALF
    src = src_ptr + heads[:, None] * src_stride_h
    o1 = tl.load(src + first[None, :], mask=mask, other=0.0).to(tl.float32)
    o2 = tl.load(src + second[None, :], mask=mask, other=0.0).to(tl.float32)
    if ROTATE:
        x1, x2 = o1, o2
        o1 = x1 * cos[None, :] - x2 * sin[None, :]
        o2 = x2 * cos[None, :] + x1 * sin[None, :]
    if NORM:
        # As transformers: the rotated head rounded to its dtype, then normed over its mean square.
        o1 = cast_rtne(o1, dst_ptr.dtype.element_ty).to(tl.float32)
        o2 = cast_rtne(o2, dst_ptr.dtype.element_ty).to(tl.float32)
        r = 1.0 / tl.sqrt((tl.sum(o1 * o1, axis=1) + tl.sum(o2 * o2, axis=1)) / (2 * HALF) + eps)
        o1, o2 = o1 * r[:, None], o2 * r[:, None]
    if SCALE:
        if NORM or ROTATE:
            o1 = cast_rtne(o1, dst_ptr.dtype.element_ty).to(tl.float32)
            o2 = cast_rtne(o2, dst_ptr.dtype.element_ty).to(tl.float32)
        o1, o2 = o1 * scale, o2 * scale
    dst = dst_ptr + heads[:, None] * dst_stride_h + d[None, :]
    tl.store(dst, cast_rtne(o1, dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, cast_rtne(o2, dst_ptr.dtype.element_ty), mask=mask)
    return o1, o2


@triton.jit
def _rope_kv_write_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cos_sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, q_out_ptr, k_out_ptr,
    q_scale_ptr, eps,
    q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t, v_stride_h,
    cs_stride,
    kc_stride_b, kc_stride_o, kc_stride_h, vc_stride_b, vc_stride_o, vc_stride_h,
    qo_stride_t, qo_stride_h, ko_stride_t, ko_stride_h,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr,
    PAGE: tl.constexpr, INTERLEAVE: tl.constexpr = False, ROTATE: tl.constexpr = True, NORM: tl.constexpr = False,
    SCALE_Q: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    d_mask = d < HALF
    cos = 0.0
    sin = 0.0
    if ROTATE:
        pos = tl.load(pos_ptr + t).to(tl.int64)
        cos = tl.load(cos_sin_ptr + pos * cs_stride + d, mask=d_mask, other=0.0)
        sin = tl.load(cos_sin_ptr + pos * cs_stride + HALF + d, mask=d_mask, other=0.0)
    q_scale = 1.0
    if SCALE_Q:
        q_scale = tl.load(q_scale_ptr + t)

    hq = tl.arange(0, BLOCK_HQ)
    _rotate_store(q_ptr + t * q_stride_t, q_stride_h, q_out_ptr + t * qo_stride_t, qo_stride_h,
                  cos, sin, hq, d, hq < NUM_Q_HEADS, d_mask, eps, q_scale, HALF, INTERLEAVE, ROTATE, NORM, SCALE_Q)

    hk = tl.arange(0, BLOCK_HKV)
    hk_mask = hk < NUM_KV_HEADS
    k1, k2 = _rotate_store(k_ptr + t * k_stride_t, k_stride_h, k_out_ptr + t * ko_stride_t, ko_stride_h,
                           cos, sin, hk, d, hk_mask, d_mask, eps, 1.0, HALF, INTERLEAVE, ROTATE, NORM, False)

    slot = tl.load(slot_ptr + t).to(tl.int64)
    # Padding tokens (slot < 0) write nothing. (A block-shaped test: the interpreter mistypes
    # a block & scalar-bool mask.)
    cache_mask = (hk_mask & ((hk * 0 + slot) >= 0))[:, None] & d_mask[None, :]
    block = slot // PAGE
    offset = slot % PAGE
    kc = k_cache_ptr + block * kc_stride_b + offset * kc_stride_o + hk[:, None] * kc_stride_h + d[None, :]
    tl.store(kc, to_kv(k1, k_cache_ptr.dtype.element_ty), mask=cache_mask)
    tl.store(kc + HALF, to_kv(k2, k_cache_ptr.dtype.element_ty), mask=cache_mask)

    v_src = v_ptr + t * v_stride_t + hk[:, None] * v_stride_h + d[None, :]
    vc = v_cache_ptr + block * vc_stride_b + offset * vc_stride_o + hk[:, None] * vc_stride_h + d[None, :]
    v_mask = hk_mask[:, None] & d_mask[None, :]
    v1 = tl.load(v_src, mask=v_mask, other=0.0)
    v2 = tl.load(v_src + HALF, mask=v_mask, other=0.0)
    tl.store(vc, to_kv(v1.to(tl.float32), v_cache_ptr.dtype.element_ty), mask=cache_mask)
    tl.store(vc + HALF, to_kv(v2.to(tl.float32), v_cache_ptr.dtype.element_ty), mask=cache_mask)


def rope_kv_write(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor | None,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, interleave: bool = False,
    norm_eps: float | None = None, q_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as rope_kv_write_ref; q/k/v may be strided views (last dim contiguous),
    e.g. slices of the fused qkv output. q_rot and k_rot come back as new contiguous tensors."""
    check_tensor(q, "q", ndim=3, dtypes=FLOAT_DTYPES)
    device = q.device
    n_tokens, n_q, head_dim = q.shape
    check(head_dim % 2 == 0, "head_dim must be even, got {}", head_dim)
    check_tensor(k, "k", ndim=3, dtypes=(q.dtype,), device=device)
    n_kv = k.shape[1]
    check_shape(k, "k", (n_tokens, n_kv, head_dim))
    check_tensor(v, "v", ndim=3, dtypes=FLOAT_DTYPES, device=device)
    check_shape(v, "v", (n_tokens, n_kv, head_dim))
    check_tensor(positions, "positions", ndim=1, dtypes=INDEX_DTYPES, device=device, contiguous=True)
    check_shape(positions, "positions", (n_tokens,))
    check_tensor(slot_mapping, "slot_mapping", ndim=1, dtypes=INDEX_DTYPES, device=device, contiguous=True)
    check_shape(slot_mapping, "slot_mapping", (n_tokens,))
    if cos_sin is not None:
        check_tensor(cos_sin, "cos_sin", ndim=2, dtypes=(torch.float32,), device=device)
        check(cos_sin.shape[1] == head_dim, "cos_sin has {} columns, expected head_dim {}", cos_sin.shape[1], head_dim)
    if q_scale is not None:
        check_tensor(q_scale, "q_scale", ndim=1, dtypes=(torch.float32,), device=device, contiguous=True)
        check_shape(q_scale, "q_scale", (n_tokens,))
    check_tensor(k_cache, "k_cache", ndim=4, dtypes=FLOAT_DTYPES + (FP8_KV,), device=device)
    check_tensor(v_cache, "v_cache", ndim=4, dtypes=(k_cache.dtype,), device=device)
    page = k_cache.shape[1]
    check_shape(k_cache, "k_cache", (k_cache.shape[0], page, n_kv, head_dim))
    check_shape(v_cache, "v_cache", tuple(k_cache.shape))

    q_rot = torch.empty((n_tokens, n_q, head_dim), dtype=q.dtype, device=device)
    k_rot = torch.empty((n_tokens, n_kv, head_dim), dtype=k.dtype, device=device)
    if n_tokens == 0:
        return q_rot, k_rot
    half = head_dim // 2
    block_half = next_power_of_2(half)
    block_hq = next_power_of_2(n_q)
    num_warps = max(1, min(8, block_hq * block_half // 256))
    _rope_kv_write_kernel[(n_tokens,)](
        q, k, v, positions, cos_sin if cos_sin is not None else q, k_cache, v_cache, slot_mapping, q_rot, k_rot,
        q_scale if q_scale is not None else q, float(norm_eps or 0.0),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos_sin.stride(0) if cos_sin is not None else 0,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        q_rot.stride(0), q_rot.stride(1), k_rot.stride(0), k_rot.stride(1),
        NUM_Q_HEADS=n_q, NUM_KV_HEADS=n_kv, HALF=half, BLOCK_HALF=block_half,
        BLOCK_HQ=block_hq, BLOCK_HKV=next_power_of_2(n_kv), PAGE=page, INTERLEAVE=interleave,
        ROTATE=cos_sin is not None, NORM=norm_eps is not None, SCALE_Q=q_scale is not None,
        num_warps=num_warps, **pdl_args(device),
    )
    return q_rot, k_rot
