"""Batched, per-request-seeded sampling (greedy, temperature, top-k, top-p, min-p): kernel and reference.

Semantics, shared exactly by the sort-based reference and the threshold-based kernel
(l = logits / T in fp32, m = max l, e = exp(l - m), so e_max = 1):
- temperature == 0: argmax of the raw logits, ties to the lowest index.
- top-k (0 < k < V): keep l >= t_k, t_k = the k-th largest l (every token tied with it is kept).
- top-p (p < 1): over the top-k set K, with Z = sum_K e, keep e >= t_p where t_p is the largest
  value with sum_{i in K, e_i >= t_p} e_i >= p * Z. That is the smallest prefix of K by
  descending probability whose mass reaches p, extended to every token tied with its last one.
- min-p (> 0): keep e >= min_p (p_i >= min_p * p_max; renormalising does not change the ratio).
- the draw: argmax over kept tokens of l + Gumbel noise, -log(-log(u)), where u comes from a
  counter-based hash of (seed, offset, token index): a request's draw at output position
  `offset` never depends on the rest of the batch.
The two can disagree only where a threshold sum lands within rounding of p * Z or exp differs
in its last bit at a boundary, and even then only if the boundary token wins the draw.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.worker.kernels._common import FLOAT_DTYPES, INDEX_DTYPES, check, check_shape, check_tensor

_M32 = 0xFFFFFFFF
_C1 = 0x7FEB352D  # lowbias32 (Chris Wellons' hash prospector)
_C2 = 0x846CA68B
_NEG_INF_KEY = tl.constexpr(-2139095041)  # _float_key(-inf): 0xFF800000 ^ 0x7FFFFFFF as int32
_ONE_BITS = tl.constexpr(0x3F800000)  # bits of 1.0f


# --- the noise, in torch (int64 holding uint32 values) -------------------------------------

def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 without int64 overflow: the high half is reduced before its shift."""
    return ((x & 0xFFFF) * c + (((x >> 16) * c) & 0xFFFF) * 65536) & _M32


def _lowbias32_ref(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, _C1)
    x = x ^ (x >> 15)
    x = _mul32(x, _C2)
    return x ^ (x >> 16)


def _row_keys_ref(seeds: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    seeds = seeds.long()
    lo = seeds & _M32
    hi = (seeds >> 32) & _M32
    key = _lowbias32_ref(lo ^ _lowbias32_ref(hi))
    return _lowbias32_ref(key ^ _lowbias32_ref(offsets.long() & _M32))


def uniform_noise_ref(seeds: torch.Tensor, offsets: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, V] float32 in (0, 1): u = ((h >> 9) + 0.5) * 2^-23 with h = hash(seed, offset, index).

    23 bits, not 24: (2^24 - 1) + 0.5 rounds up to 2^24 in fp32, which would give u == 1.
    """
    keys = _row_keys_ref(seeds, offsets)
    idx = torch.arange(vocab, dtype=torch.int64, device=seeds.device)
    h = _lowbias32_ref(keys[:, None] ^ _lowbias32_ref(idx)[None, :])
    return ((h >> 9).to(torch.float32) + 0.5) * (2.0 ** -23)


def gumbel_noise_ref(seeds: torch.Tensor, offsets: torch.Tensor, vocab: int) -> torch.Tensor:
    return -torch.log(-torch.log(uniform_noise_ref(seeds, offsets, vocab)))


# --- the reference -------------------------------------------------------------------------

def sample_ref(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
    min_p: torch.Tensor, seeds: torch.Tensor, offsets: torch.Tensor,
) -> torch.Tensor:
    """logits [B, V] -> [B] int64 token ids (see the module docstring for the exact rules)."""
    x = logits.float()
    n_rows, vocab = x.shape
    greedy_ids = x.argmax(dim=-1)
    if n_rows == 0:
        return greedy_ids
    greedy = temperature <= 0
    if bool(greedy.all()):
        return greedy_ids
    temp = torch.where(greedy, torch.ones_like(temperature), temperature).float()
    l = x / temp[:, None]
    m = l.max(dim=-1, keepdim=True).values
    keep = torch.ones_like(l, dtype=torch.bool)

    k = top_k.long()
    use_k = (k > 0) & (k < vocab)
    if bool(use_k.any()):
        k_max = int(torch.where(use_k, k, 1).max())
        top_vals = l.topk(k_max, dim=-1).values
        t_k = top_vals.gather(1, (torch.where(use_k, k, 1) - 1)[:, None])
        keep &= ~use_k[:, None] | (l >= t_k)

    e = torch.exp(l - m)
    use_p = top_p < 1.0
    if bool(use_p.any()):
        e_k = torch.where(keep, e, torch.zeros_like(e))
        e_sorted = e_k.sort(dim=-1, descending=True).values
        mass = e_sorted.double().cumsum(dim=-1)
        target = top_p.double()[:, None] * mass[:, -1:]
        n = (mass < target).sum(dim=-1, keepdim=True).clamp(max=vocab - 1)
        t_p = e_sorted.gather(1, n)
        keep &= ~use_p[:, None] | (e >= t_p)

    use_min_p = min_p > 0.0
    if bool(use_min_p.any()):
        keep &= ~use_min_p[:, None] | (e >= min_p.float()[:, None])

    scores = torch.where(keep, l + gumbel_noise_ref(seeds, offsets, vocab), float("-inf"))
    sampled = scores.argmax(dim=-1)
    return torch.where(greedy, greedy_ids, sampled)


# --- the kernel ----------------------------------------------------------------------------

@triton.jit
def _lowbias32(x):
    x ^= x >> 16
    x *= 0x7FEB352D
    x ^= x >> 15
    x *= 0x846CA68B
    x ^= x >> 16
    return x


@triton.jit
def _row_key(seed, offset):
    lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    key = _lowbias32(lo ^ _lowbias32(hi))
    return _lowbias32(key ^ _lowbias32((offset & 0xFFFFFFFF).to(tl.uint32)))


@triton.jit
def _uniform(row_key, idx):
    h = _lowbias32(row_key ^ _lowbias32(idx.to(tl.uint32)))
    return ((h >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2^-23


@triton.jit
def _float_key(x):
    """fp32 -> int32 whose signed order is the float order."""
    b = x.to(tl.int32, bitcast=True)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


@triton.jit
def _key_float(k):
    k = k.to(tl.int32)
    return (k ^ ((k >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _uniform_noise_kernel(seeds_ptr, offsets_ptr, out_ptr, vocab, out_stride, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    idx = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    key = _row_key(tl.load(seeds_ptr + row).to(tl.int64), tl.load(offsets_ptr + row).to(tl.int64))
    tl.store(out_ptr + row * out_stride + idx, _uniform(key, idx), mask=idx < vocab)


@triton.jit
def _sample_kernel(
    logits_ptr, logits_stride, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seeds_ptr, offsets_ptr, out_ptr,
    vocab,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * logits_stride
    cols = tl.arange(0, BLOCK_V)
    temp = tl.load(temp_ptr + row).to(tl.float32)

    # Pass 1: max and first argmax of the raw logits (the greedy answer).
    best = tl.full([BLOCK_V], float("-inf"), tl.float32)
    best_idx = cols
    for v0 in range(0, vocab, BLOCK_V):
        idx = v0 + cols
        x = tl.load(base + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32)
        better = x > best
        best = tl.where(better, x, best)
        best_idx = tl.where(better, idx, best_idx)
    x_max = tl.max(best, axis=0)
    result = tl.min(tl.where(best == x_max, best_idx, vocab), axis=0)

    if temp > 0.0:
        top_k = tl.load(top_k_ptr + row).to(tl.int32)
        top_p = tl.load(top_p_ptr + row).to(tl.float32)
        min_p = tl.load(min_p_ptr + row).to(tl.float32)
        # Division is monotone, so max(x / T) == max(x) / T exactly.
        m = tl.div_rn(x_max, temp)

        # Top-k: bisection on the order-preserving integer image of l, with both ends snapped to
        # data values after every pass (lo to the smallest l >= the probe, hi to the largest l
        # below it). Invariant: count(l >= lo) >= k and the k-th largest l lies in [lo, hi], so it
        # ends exactly on it, after about log2(distinct values) passes and never more than 32.
        t_k = tl.full([], float("-inf"), tl.float32)
        if (top_k > 0) & (top_k < vocab):
            lo = tl.full([], _NEG_INF_KEY, tl.int64)
            hi = _float_key(m).to(tl.int64)
            while lo < hi:
                probe = _key_float(lo + (hi - lo + 1) // 2)
                n_ge = tl.zeros([BLOCK_V], tl.int32)
                up = tl.full([BLOCK_V], float("inf"), tl.float32)
                down = tl.full([BLOCK_V], float("-inf"), tl.float32)
                for v0 in range(0, vocab, BLOCK_V):
                    idx = v0 + cols
                    x = tl.load(base + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32)
                    l = tl.div_rn(x, temp)
                    ge = l >= probe
                    n_ge += ge.to(tl.int32)
                    up = tl.minimum(up, tl.where(ge, l, float("inf")))
                    down = tl.maximum(down, tl.where(ge, float("-inf"), l))
                take = tl.sum(n_ge, axis=0) >= top_k
                lo = tl.where(take, _float_key(tl.min(up, axis=0)).to(tl.int64), lo)
                hi = tl.where(take, hi, _float_key(tl.max(down, axis=0)).to(tl.int64))
            t_k = _key_float(lo)

        # Top-p: the same snapped bisection on the bits of e over the top-k set (non-negative
        # floats order like their bits), for the largest t with mass(e >= t) >= top_p * Z.
        t_p = tl.full([], 0.0, tl.float32)
        if top_p < 1.0:
            z_acc = tl.zeros([BLOCK_V], tl.float32)
            for v0 in range(0, vocab, BLOCK_V):
                idx = v0 + cols
                x = tl.load(base + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32)
                l = tl.div_rn(x, temp)
                z_acc += tl.where(l >= t_k, tl.exp(l - m), 0.0)
            target = top_p * tl.sum(z_acc, axis=0)
            lo_p = tl.full([], 0, tl.int64)
            hi_p = tl.full([], _ONE_BITS, tl.int64)  # e of the max token is exp(0) = 1
            while lo_p < hi_p:
                mid = lo_p + (hi_p - lo_p + 1) // 2
                probe = mid.to(tl.int32).to(tl.float32, bitcast=True)
                mass_acc = tl.zeros([BLOCK_V], tl.float32)
                up = tl.full([BLOCK_V], float("inf"), tl.float32)
                down = tl.full([BLOCK_V], -1.0, tl.float32)
                for v0 in range(0, vocab, BLOCK_V):
                    idx = v0 + cols
                    x = tl.load(base + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32)
                    l = tl.div_rn(x, temp)
                    e = tl.where(l >= t_k, tl.exp(l - m), -1.0)  # -1: outside the top-k set
                    ge = e >= probe
                    mass_acc += tl.where(ge, e, 0.0)
                    up = tl.minimum(up, tl.where(ge, e, float("inf")))
                    down = tl.maximum(down, tl.where(ge, -1.0, e))
                take = tl.sum(mass_acc, axis=0) >= target
                e_up = tl.min(up, axis=0)
                e_down = tl.max(down, axis=0)
                lo_p = tl.where(take, tl.minimum(e_up.to(tl.int32, bitcast=True).to(tl.int64), hi_p), lo_p)
                hi_p = tl.where(take, hi_p, tl.where(e_down >= 0.0, e_down.to(tl.int32, bitcast=True).to(tl.int64),
                                                     lo_p))
            t_p = lo_p.to(tl.int32).to(tl.float32, bitcast=True)

        # The draw: Gumbel-max over the kept tokens.
        key = _row_key(tl.load(seeds_ptr + row).to(tl.int64), tl.load(offsets_ptr + row).to(tl.int64))
        e_min = tl.maximum(t_p, min_p)
        best = tl.full([BLOCK_V], float("-inf"), tl.float32)
        best_idx = cols
        for v0 in range(0, vocab, BLOCK_V):
            idx = v0 + cols
            x = tl.load(base + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32)
            l = tl.div_rn(x, temp)
            keep = (idx < vocab) & (l >= t_k) & (tl.exp(l - m) >= e_min)
            gumbel = -tl.log(-tl.log(_uniform(key, idx)))
            score = tl.where(keep, l + gumbel, float("-inf"))
            better = score > best
            best = tl.where(better, score, best)
            best_idx = tl.where(better, idx, best_idx)
        s_max = tl.max(best, axis=0)
        result = tl.min(tl.where(best == s_max, best_idx, vocab), axis=0)

    tl.store(out_ptr + row, result.to(tl.int64))


def _check_row_params(name: str, t: torch.Tensor, n_rows: int, dtypes, device) -> None:
    check_tensor(t, name, ndim=1, dtypes=dtypes, device=device, contiguous=True)
    check_shape(t, name, (n_rows,))


def sample(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
    min_p: torch.Tensor, seeds: torch.Tensor, offsets: torch.Tensor,
) -> torch.Tensor:
    """Same contract as sample_ref: one program per row, no host sync, graph-capturable."""
    check_tensor(logits, "logits", ndim=2, dtypes=FLOAT_DTYPES)
    device = logits.device
    n_rows, vocab = logits.shape
    check(vocab < 2**31 - 65536, f"vocabulary of {vocab} is too large")
    _check_row_params("temperature", temperature, n_rows, (torch.float32,), device)
    _check_row_params("top_k", top_k, n_rows, INDEX_DTYPES, device)
    _check_row_params("top_p", top_p, n_rows, (torch.float32,), device)
    _check_row_params("min_p", min_p, n_rows, (torch.float32,), device)
    _check_row_params("seeds", seeds, n_rows, (torch.int64,), device)
    _check_row_params("offsets", offsets, n_rows, INDEX_DTYPES, device)
    out = torch.empty((n_rows,), dtype=torch.int64, device=device)
    if n_rows == 0:
        return out
    block_v = min(4096, triton.next_power_of_2(max(vocab, 16)))
    _sample_kernel[(n_rows,)](
        logits, logits.stride(0), temperature, top_k, top_p, min_p, seeds, offsets, out, vocab,
        BLOCK_V=block_v, num_warps=8 if block_v >= 2048 else 4,
    )
    return out


def uniform_noise(seeds: torch.Tensor, offsets: torch.Tensor, vocab: int) -> torch.Tensor:
    """The kernel's noise, materialised (for tests and debugging): equals uniform_noise_ref bit for bit."""
    check_tensor(seeds, "seeds", ndim=1, dtypes=(torch.int64,), contiguous=True)
    n_rows = seeds.shape[0]
    _check_row_params("offsets", offsets, n_rows, INDEX_DTYPES, seeds.device)
    out = torch.empty((n_rows, vocab), dtype=torch.float32, device=seeds.device)
    if n_rows == 0 or vocab == 0:
        return out
    block_v = min(1024, triton.next_power_of_2(vocab))
    _uniform_noise_kernel[(n_rows, triton.cdiv(vocab, block_v))](
        seeds, offsets, out, vocab, out.stride(0), BLOCK_V=block_v, num_warps=4)
    return out
