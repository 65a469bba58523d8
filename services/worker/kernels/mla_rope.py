"""MLA's rotary embedding fused with the latent cache write: the Triton kernel and its torch reference.

Per token: the rotary part of every head's query is rotated and returned; the shared rotary key is
rotated and stored with the normed latent as the token's cache row [latent | k_rot]. DeepSeek's
checkpoints order the rotary dimensions in interleaved pairs (x0, x1), (x2, x3), ...: those are
read as pairs and written in the half-split order (x0, x2, ... | x1, x3, ...), as transformers
does, so queries and cached keys agree and the attention kernels see plain rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.worker.kernels._common import (
    FLOAT_DTYPES, FP8_KV, INDEX_DTYPES, cast_rtne, check, check_shape, check_tensor, copy_rows_, next_power_of_2,
    to_kv, to_kv_ref)
from services.worker.kernels.rope import _rotate_ref, halves


def mla_rope_write_ref(q_rot: torch.Tensor, k_rot: torch.Tensor, latent: torch.Tensor, positions: torch.Tensor,
                       cos_sin: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
                       interleave: bool) -> torch.Tensor:
    """q_rot: [T, H, R]; k_rot: [T, R]; latent: [T, C]; cos_sin: [P, R] float32; cache: [N, block_size, 1,
    C + R]. Writes [latent | rotated k_rot] at each token's slot (slots < 0, padding, write nothing);
    returns the rotated q_rot in its dtype (half-split order)."""
    half = q_rot.shape[-1] // 2
    cs = cos_sin[positions.long()]
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    q_out = _rotate_ref(halves(q_rot, interleave), cos, sin)
    k_out = _rotate_ref(halves(k_rot, interleave)[:, None], cos, sin)[:, 0]
    rows = torch.cat((latent, k_out), dim=-1)
    slots = slot_mapping.long()
    valid = slots >= 0
    n_blocks, page, _, width = cache.shape
    copy_rows_(cache.view(n_blocks * page, width), 0, slots[valid], to_kv_ref(rows[valid], cache.dtype))
    return q_out


@triton.jit
def _mla_rope_write_kernel(
    q_ptr, k_ptr, lat_ptr, pos_ptr, cos_sin_ptr, cache_ptr, slot_ptr, q_out_ptr,
    q_stride_t, q_stride_h, k_stride_t, lat_stride_t, cs_stride, c_stride_b, c_stride_o, qo_stride_t, qo_stride_h,
    HEADS: tl.constexpr, HALF: tl.constexpr, LORA: tl.constexpr, INTERLEAVE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_LORA: tl.constexpr, PAGE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    d_mask = d < HALF
    cos = tl.load(cos_sin_ptr + pos * cs_stride + d, mask=d_mask, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * cs_stride + HALF + d, mask=d_mask, other=0.0)
    # The pair (x1, x2) that one frequency turns: neighbours when interleaved, else HALF apart.
    first = 2 * d if INTERLEAVE else d
    second = first + 1 if INTERLEAVE else d + HALF

    h = tl.arange(0, BLOCK_H)
    qm = (h < HEADS)[:, None] & d_mask[None, :]
    q = q_ptr + t * q_stride_t + h[:, None] * q_stride_h
    x1 = tl.load(q + first[None, :], mask=qm, other=0.0).to(tl.float32)
    x2 = tl.load(q + second[None, :], mask=qm, other=0.0).to(tl.float32)
    qo = q_out_ptr + t * qo_stride_t + h[:, None] * qo_stride_h + d[None, :]
    tl.store(qo, cast_rtne(x1 * cos[None, :] - x2 * sin[None, :], q_out_ptr.dtype.element_ty), mask=qm)
    tl.store(qo + HALF, cast_rtne(x2 * cos[None, :] + x1 * sin[None, :], q_out_ptr.dtype.element_ty), mask=qm)

    slot = tl.load(slot_ptr + t).to(tl.int64)
    row = cache_ptr + (slot // PAGE) * c_stride_b + (slot % PAGE) * c_stride_o
    # Padding tokens (slot < 0) write nothing (masks of the block's shape: the interpreter mistypes a
    # block & scalar-bool mask).
    km = d_mask & ((d * 0 + slot) >= 0)
    k1 = tl.load(k_ptr + t * k_stride_t + first, mask=d_mask, other=0.0).to(tl.float32)
    k2 = tl.load(k_ptr + t * k_stride_t + second, mask=d_mask, other=0.0).to(tl.float32)
    tl.store(row + LORA + d, to_kv(k1 * cos - k2 * sin, cache_ptr.dtype.element_ty), mask=km)
    tl.store(row + LORA + HALF + d, to_kv(k2 * cos + k1 * sin, cache_ptr.dtype.element_ty), mask=km)
    c = tl.arange(0, BLOCK_LORA)
    cm = (c < LORA) & ((c * 0 + slot) >= 0)
    latent = tl.load(lat_ptr + t * lat_stride_t + c, mask=c < LORA, other=0.0).to(tl.float32)
    tl.store(row + c, to_kv(latent, cache_ptr.dtype.element_ty), mask=cm)


def mla_rope_write(q_rot: torch.Tensor, k_rot: torch.Tensor, latent: torch.Tensor, positions: torch.Tensor,
                   cos_sin: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
                   interleave: bool) -> torch.Tensor:
    """Same contract as mla_rope_write_ref; q_rot, k_rot and latent may be strided views (last dim
    contiguous), slices of the projections' outputs. The rotated q comes back contiguous."""
    check_tensor(q_rot, "q_rot", ndim=3, dtypes=FLOAT_DTYPES)
    device = q_rot.device
    n, heads, rope = q_rot.shape
    check(rope % 2 == 0, "the rotary width must be even, got {}", rope)
    check(q_rot.stride(2) == 1, "q_rot's last dimension must be contiguous")
    check_tensor(k_rot, "k_rot", ndim=2, dtypes=FLOAT_DTYPES, device=device)
    check_shape(k_rot, "k_rot", (n, rope))
    check(k_rot.stride(1) == 1, "k_rot's last dimension must be contiguous")
    check_tensor(latent, "latent", ndim=2, dtypes=FLOAT_DTYPES, device=device)
    lora = latent.shape[1]
    check_shape(latent, "latent", (n, lora))
    check(latent.stride(1) == 1, "latent's last dimension must be contiguous")
    for name, t in (("positions", positions), ("slot_mapping", slot_mapping)):
        check_tensor(t, name, ndim=1, dtypes=INDEX_DTYPES, device=device, contiguous=True)
        check_shape(t, name, (n,))
    check_tensor(cos_sin, "cos_sin", ndim=2, dtypes=(torch.float32,), device=device)
    check(cos_sin.shape[1] == rope, "cos_sin has {} columns, expected {}", cos_sin.shape[1], rope)
    check_tensor(cache, "cache", ndim=4, dtypes=FLOAT_DTYPES + (FP8_KV,), device=device)
    check_shape(cache, "cache", (cache.shape[0], cache.shape[1], 1, lora + rope))
    check(cache.stride(3) == 1 and cache.stride(2) == lora + rope, "the cache's rows must be contiguous")
    q_out = torch.empty((n, heads, rope), dtype=q_rot.dtype, device=device)
    if n == 0:
        return q_out
    _mla_rope_write_kernel[(n,)](
        q_rot, k_rot, latent, positions, cos_sin, cache, slot_mapping, q_out,
        q_rot.stride(0), q_rot.stride(1), k_rot.stride(0), latent.stride(0), cos_sin.stride(0),
        cache.stride(0), cache.stride(1), q_out.stride(0), q_out.stride(1),
        HEADS=heads, HALF=rope // 2, LORA=lora, INTERLEAVE=interleave, BLOCK_H=next_power_of_2(heads),
        BLOCK_HALF=next_power_of_2(rope // 2), BLOCK_LORA=next_power_of_2(lora), PAGE=cache.shape[1],
        num_warps=4)
    return q_out
