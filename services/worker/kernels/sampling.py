"""Batched, per-request-seeded sampling (greedy, temperature, top-k, top-p, min-p): kernels and reference.

Semantics, shared exactly by the sort-based reference and the threshold-based kernels
(inv_t = 1 / T and l = logits * inv_t in fp32, m = max l, e = exp(l - m), so e_max = 1):
- temperature <= 0: argmax of the raw logits, ties to the lowest index.
- top-k (0 < k < V): keep l >= t_k, t_k = the k-th largest l (every token tied with it is kept).
- top-p (p < 1): within the top-k set K, with Z = sum_K e, keep l >= s_p where s_p is the largest
  l with sum_{i in K, l_i >= s_p} e_i >= p * Z: the smallest prefix of K by descending logit
  (= descending probability) whose mass reaches p, extended to every token tied with its last.
- min-p (> 0): keep e >= min_p (p_i >= min_p * p_max; renormalising does not change the ratio).
- the draw: argmax over kept tokens of l + Gumbel noise -log(-log(u)), u from a counter-based hash
  of (seed, offset, token index): a request's draw at output position `offset` never depends on
  the rest of the batch.
The two can disagree only where a threshold's mass lands within fp32 rounding of p * Z, or exp
differs in its last bit at a min-p boundary, and even then only if the boundary token wins the draw.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from services.worker.kernels._common import FLOAT_DTYPES, INDEX_DTYPES, check, check_shape, check_tensor

_M32 = 0xFFFFFFFF
_C1 = 0x7FEB352D  # lowbias32 (Chris Wellons' hash prospector)
_C2 = 0x846CA68B
_GOLDEN = 0x9E3779B9  # 2^32 / golden ratio
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
    """[B, V] float32 in (0, 1): u = ((h >> 9) + 0.5) * 2^-23, h = lowbias32(key ^ index * golden),
    key = lowbias32(lowbias32(lo ^ lowbias32(hi)) ^ lowbias32(offset)) for seed = hi:lo.

    23 bits, not 24: (2^24 - 1) + 0.5 rounds up to 2^24 in fp32, which would give u == 1.
    """
    keys = _row_keys_ref(seeds, offsets)
    idx = torch.arange(vocab, dtype=torch.int64, device=seeds.device)
    h = _lowbias32_ref(keys[:, None] ^ _mul32(idx, _GOLDEN)[None, :])
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
    inv_t = 1.0 / torch.where(greedy, torch.ones_like(temperature), temperature).float()
    l = x * inv_t[:, None]
    m = l.max(dim=-1, keepdim=True).values
    keep = torch.ones_like(l, dtype=torch.bool)

    k = top_k.long()
    use_k = (k > 0) & (k < vocab)
    if bool(use_k.any()):
        k_eff = torch.where(use_k, k, 1)
        t_k = l.topk(int(k_eff.max()), dim=-1).values.gather(1, (k_eff - 1)[:, None])
        keep &= ~use_k[:, None] | (l >= t_k)

    e = torch.exp(l - m)
    use_p = top_p < 1.0
    if bool(use_p.any()):
        l_sorted, order = torch.where(keep, l, float("-inf")).sort(dim=-1, descending=True)
        e_sorted = torch.where(l_sorted > float("-inf"), e.gather(1, order), 0.0)
        mass = e_sorted.double().cumsum(dim=-1)
        target = top_p.double()[:, None] * mass[:, -1:]
        n = (mass < target).sum(dim=-1, keepdim=True).clamp(max=vocab - 1)
        s_p = l_sorted.gather(1, n)
        keep &= ~use_p[:, None] | (l >= s_p)

    use_min_p = min_p > 0.0
    if bool(use_min_p.any()):
        keep &= ~use_min_p[:, None] | (e >= min_p.float()[:, None])

    scores = torch.where(keep, l + gumbel_noise_ref(seeds, offsets, vocab), float("-inf"))
    return torch.where(greedy, greedy_ids, scores.argmax(dim=-1))


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
    # One mixing round per token: the golden-ratio multiply spreads consecutive indices first.
    h = _lowbias32(row_key ^ (idx.to(tl.uint32) * 0x9E3779B9))
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
def _row_params(temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, row, vocab):
    temp = tl.load(temp_ptr + row).to(tl.float32)
    top_k = tl.load(top_k_ptr + row).to(tl.int32)
    top_p = tl.load(top_p_ptr + row).to(tl.float32)
    min_p = tl.load(min_p_ptr + row).to(tl.float32)
    greedy = temp <= 0.0
    use_k = (top_k > 0) & (top_k < vocab)
    use_p = top_p < 1.0
    use_min_p = min_p > 0.0
    # Rows with no filter need no max and no thresholds: one pass (or one split pass) suffices.
    simple = greedy | ((use_k | use_p | use_min_p) == 0)
    inv_t = tl.div_rn(1.0, tl.where(greedy, 1.0, temp))
    return greedy, simple, inv_t, top_k, top_p, min_p, use_k, use_p


@triton.jit
def _draw_tile(x, idx, valid, greedy, inv_t, key, best, best_idx):
    """One tile of the simple rows' pass: raw x for greedy rows, x * inv_t + Gumbel otherwise."""
    if greedy:
        score = tl.where(valid, x, float("-inf"))
    else:
        score = tl.where(valid, x * inv_t - tl.log(-tl.log(_uniform(key, idx))), float("-inf"))
    better = score > best
    return tl.where(better, score, best), tl.where(better, idx, best_idx)


@triton.jit
def _sample_split_kernel(
    logits_ptr, logits_stride, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seeds_ptr, offsets_ptr,
    part_score_ptr, part_idx_ptr, vocab, chunk, num_splits,
    BLOCK_V: tl.constexpr,
):
    """The simple rows' pass, cut into num_splits chunks of the vocabulary (one program each)."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    greedy, simple, inv_t, _, _, _, _, _ = _row_params(temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, row, vocab)
    if simple == 0:
        return
    key = _row_key(tl.load(seeds_ptr + row).to(tl.int64), tl.load(offsets_ptr + row).to(tl.int64))
    base = logits_ptr + row * logits_stride
    cols = tl.arange(0, BLOCK_V)
    start = split * chunk
    end = tl.minimum(start + chunk, vocab)
    best = tl.full([BLOCK_V], float("-inf"), tl.float32)
    best_idx = start + cols
    for v0 in range(start, end, BLOCK_V):
        idx = v0 + cols
        valid = idx < end
        x = tl.load(base + idx, mask=valid, other=float("-inf")).to(tl.float32)
        best, best_idx = _draw_tile(x, idx, valid, greedy, inv_t, key, best, best_idx)
    s_max = tl.max(best, axis=0)
    tl.store(part_score_ptr + row * num_splits + split, s_max)
    tl.store(part_idx_ptr + row * num_splits + split, tl.min(tl.where(best == s_max, best_idx, vocab), axis=0))


@triton.jit
def _accumulate(l, probe, m, n_ge, mass, up, down, MASS: tl.constexpr):
    ge = l >= probe
    n_ge += ge.to(tl.int32)
    if MASS:
        mass += tl.where(ge, tl.exp(l - m), 0.0)
    up = tl.minimum(up, tl.where(ge, l, float("inf")))
    down = tl.maximum(down, tl.where(ge, float("-inf"), l))
    return n_ge, mass, up, down


@triton.jit
def _probe_stats(base, cand_l_ptr, use_cand, n_cand, vocab, inv_t, m, probe,
                 MASS: tl.constexpr, BLOCK_V: tl.constexpr):
    """For l >= probe: count, mass (sum of e), smallest l; and the largest l below the probe.
    Over the compacted candidates when there are some, else over the whole row."""
    cols = tl.arange(0, BLOCK_V)
    n_ge = tl.zeros([BLOCK_V], tl.int32)
    mass = tl.zeros([BLOCK_V], tl.float32)
    up = tl.full([BLOCK_V], float("inf"), tl.float32)
    down = tl.full([BLOCK_V], float("-inf"), tl.float32)
    if use_cand != 0:
        l = tl.load(cand_l_ptr + cols, mask=cols < n_cand, other=float("-inf"))
        n_ge, mass, up, down = _accumulate(l, probe, m, n_ge, mass, up, down, MASS)
    else:
        for v0 in range(0, vocab, BLOCK_V):
            idx = v0 + cols
            x = tl.load(base + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32)
            n_ge, mass, up, down = _accumulate(x * inv_t, probe, m, n_ge, mass, up, down, MASS)
    return tl.sum(n_ge, axis=0), tl.sum(mass, axis=0), tl.min(up, axis=0), tl.max(down, axis=0)


@triton.jit
def _compact(base, cand_l_ptr, cand_i_ptr, vocab, inv_t, threshold, BLOCK_V: tl.constexpr):
    """Copies every l >= threshold (at most BLOCK_V of them) and its index, in index order."""
    cols = tl.arange(0, BLOCK_V)
    n = tl.zeros([], tl.int32)
    for v0 in range(0, vocab, BLOCK_V):
        idx = v0 + cols
        x = tl.load(base + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32)
        l = x * inv_t
        take = (idx < vocab) & (l >= threshold)
        pos = n + tl.cumsum(take.to(tl.int32), axis=0) - 1
        tl.store(cand_l_ptr + pos, l, mask=take)
        tl.store(cand_i_ptr + pos, idx, mask=take)
        n += tl.sum(take.to(tl.int32), axis=0)
    tl.debug_barrier()  # the whole program reads what each of its threads wrote
    return n


@triton.jit
def _select(base, cand_l_ptr, cand_i_ptr, use_cand, n_cand, vocab, inv_t, m, target, lo, hi, cnt_lo,
            MASS: tl.constexpr, BLOCK_V: tl.constexpr):
    """The largest data value t in [lo, hi] (order-preserving integer keys of l) with
    stat(l >= t) >= target, stat = count or mass. Bisection with both ends snapped to data values
    after each pass (lo up to the smallest l >= the probe, hi down to the largest l below it), so it
    ends exactly, after about log2(distinct values) passes, at most 32. Invariant: stat(l >= lo) >=
    target, the answer lies in [lo, hi], cnt_lo = count(l >= lo). Once at most BLOCK_V tokens are
    >= lo, they are compacted and every later pass reads one tile instead of the row."""
    while lo < hi:
        probe = _key_float(lo + (hi - lo + 1) // 2)
        n_ge, mass, up, down = _probe_stats(base, cand_l_ptr, use_cand, n_cand, vocab, inv_t, m, probe,
                                            MASS, BLOCK_V)
        if MASS:
            take = mass >= target
        else:
            take = n_ge.to(tl.float32) >= target
        lo = tl.where(take, tl.minimum(_float_key(up).to(tl.int64), hi), lo)
        cnt_lo = tl.where(take, n_ge, cnt_lo)
        hi = tl.where(take, hi, _float_key(down).to(tl.int64))
        if (use_cand == 0) & (cnt_lo <= BLOCK_V) & (lo < hi) & (vocab > BLOCK_V):
            n_cand = _compact(base, cand_l_ptr, cand_i_ptr, vocab, inv_t, _key_float(lo), BLOCK_V)
            use_cand = tl.zeros([], tl.int32) + 1
    return lo, cnt_lo, use_cand, n_cand


@triton.jit
def _sample_kernel(
    logits_ptr, logits_stride, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seeds_ptr, offsets_ptr, out_ptr,
    part_score_ptr, part_idx_ptr, cand_l_ptr, cand_i_ptr, vocab, num_splits,
    SPLIT: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * logits_stride
    cols = tl.arange(0, BLOCK_V)
    greedy, simple, inv_t, top_k, top_p, min_p, use_k, use_p = _row_params(
        temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, row, vocab)
    key = _row_key(tl.load(seeds_ptr + row).to(tl.int64), tl.load(offsets_ptr + row).to(tl.int64))
    result = tl.zeros([], tl.int32)

    if simple:
        if SPLIT:
            s = tl.arange(0, BLOCK_S)
            score = tl.load(part_score_ptr + row * num_splits + s, mask=s < num_splits, other=float("-inf"))
            idx = tl.load(part_idx_ptr + row * num_splits + s, mask=s < num_splits, other=vocab)
            s_max = tl.max(score, axis=0)
            result = tl.min(tl.where(score == s_max, idx, vocab), axis=0)
        else:
            best = tl.full([BLOCK_V], float("-inf"), tl.float32)
            best_idx = cols
            for v0 in range(0, vocab, BLOCK_V):
                idx = v0 + cols
                valid = idx < vocab
                x = tl.load(base + idx, mask=valid, other=float("-inf")).to(tl.float32)
                best, best_idx = _draw_tile(x, idx, valid, greedy, inv_t, key, best, best_idx)
            s_max = tl.max(best, axis=0)
            result = tl.min(tl.where(best == s_max, best_idx, vocab), axis=0)
    else:
        row_cand_l = cand_l_ptr + row * BLOCK_V
        row_cand_i = cand_i_ptr + row * BLOCK_V
        x_max = tl.full([BLOCK_V], float("-inf"), tl.float32)
        for v0 in range(0, vocab, BLOCK_V):
            idx = v0 + cols
            x_max = tl.maximum(x_max, tl.load(base + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32))
        # Multiplying by inv_t > 0 is monotone, so max(x * inv_t) == max(x) * inv_t exactly.
        m = tl.max(x_max, axis=0) * inv_t
        use_cand = tl.zeros([], tl.int32)
        n_cand = tl.zeros([], tl.int32)
        cnt = vocab + tl.zeros([], tl.int32)
        t_k = tl.full([], float("-inf"), tl.float32)
        if use_k:
            lo, cnt, use_cand, n_cand = _select(
                base, row_cand_l, row_cand_i, use_cand, n_cand, vocab, inv_t, m, top_k.to(tl.float32),
                tl.full([], _NEG_INF_KEY, tl.int64), _float_key(m).to(tl.int64), cnt, False, BLOCK_V)
            t_k = _key_float(lo)
        threshold = t_k
        if use_p:
            _, z, _, _ = _probe_stats(base, row_cand_l, use_cand, n_cand, vocab, inv_t, m, t_k, True, BLOCK_V)
            lo, cnt, use_cand, n_cand = _select(
                base, row_cand_l, row_cand_i, use_cand, n_cand, vocab, inv_t, m, top_p * z,
                _float_key(t_k).to(tl.int64), _float_key(m).to(tl.int64), cnt, True, BLOCK_V)
            threshold = _key_float(lo)

        # The draw: Gumbel-max over the kept tokens.
        best = tl.full([BLOCK_V], float("-inf"), tl.float32)
        best_idx = cols
        if use_cand != 0:
            valid = cols < n_cand
            l = tl.load(row_cand_l + cols, mask=valid, other=float("-inf"))
            idx = tl.load(row_cand_i + cols, mask=valid, other=0)
            keep = valid & (l >= threshold) & (tl.exp(l - m) >= min_p)
            best = tl.where(keep, l - tl.log(-tl.log(_uniform(key, idx))), float("-inf"))
            best_idx = idx
        else:
            for v0 in range(0, vocab, BLOCK_V):
                idx = v0 + cols
                x = tl.load(base + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32)
                l = x * inv_t
                keep = (idx < vocab) & (l >= threshold) & (tl.exp(l - m) >= min_p)
                score = tl.where(keep, l - tl.log(-tl.log(_uniform(key, idx))), float("-inf"))
                better = score > best
                best = tl.where(better, score, best)
                best_idx = tl.where(better, idx, best_idx)
        s_max = tl.max(best, axis=0)
        result = tl.min(tl.where(best == s_max, best_idx, vocab), axis=0)

    tl.store(out_ptr + row, result.to(tl.int64))


def _check_row_params(name: str, t: torch.Tensor, n_rows: int, dtypes, device) -> None:
    check_tensor(t, name, ndim=1, dtypes=dtypes, device=device, contiguous=True)
    check_shape(t, name, (n_rows,))


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def sample(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
    min_p: torch.Tensor, seeds: torch.Tensor, offsets: torch.Tensor, *,
    block_v: int | None = None, num_splits: int | None = None,
) -> torch.Tensor:
    """Same contract as sample_ref: no host sync, allocations sized by shapes, graph-capturable.

    Rows without filters (greedy, or plain temperature) are drawn by num_splits programs per row
    (a vocabulary chunk each) and a reduction; rows with top-k / top-p / min-p by one program per
    row, in passes. block_v and num_splits override the launch shape (tests use them)."""
    check_tensor(logits, "logits", ndim=2, dtypes=FLOAT_DTYPES)
    device = logits.device
    n_rows, vocab = logits.shape
    check(0 < vocab < 2**31 - 2**20, "vocabulary of {} is out of range", vocab)
    _check_row_params("temperature", temperature, n_rows, (torch.float32,), device)
    _check_row_params("top_k", top_k, n_rows, INDEX_DTYPES, device)
    _check_row_params("top_p", top_p, n_rows, (torch.float32,), device)
    _check_row_params("min_p", min_p, n_rows, (torch.float32,), device)
    _check_row_params("seeds", seeds, n_rows, (torch.int64,), device)
    _check_row_params("offsets", offsets, n_rows, INDEX_DTYPES, device)
    out = torch.empty((n_rows,), dtype=torch.int64, device=device)
    if n_rows == 0:
        return out
    if block_v is None:
        block_v = min(4096, triton.next_power_of_2(max(vocab, 16)))
    check(block_v >= 16 and block_v & (block_v - 1) == 0, "block_v must be a power of two >= 16, got {}", block_v)
    split_block = min(block_v, 2048)
    if num_splits is None:
        num_splits = min(triton.cdiv(vocab, split_block), max(1, triton.cdiv(4 * _num_sms(device), n_rows)))
    check(num_splits >= 1, "num_splits must be positive, got {}", num_splits)
    chunk = triton.cdiv(triton.cdiv(vocab, num_splits), split_block) * split_block
    num_splits = triton.cdiv(vocab, chunk)
    split = num_splits > 1
    part_score = torch.empty((n_rows, num_splits) if split else (1,), dtype=torch.float32, device=device)
    part_idx = torch.empty((n_rows, num_splits) if split else (1,), dtype=torch.int32, device=device)
    cand_l = torch.empty((n_rows, block_v), dtype=torch.float32, device=device)
    cand_i = torch.empty((n_rows, block_v), dtype=torch.int32, device=device)
    if split:
        _sample_split_kernel[(n_rows, num_splits)](
            logits, logits.stride(0), temperature, top_k, top_p, min_p, seeds, offsets,
            part_score, part_idx, vocab, chunk, num_splits,
            BLOCK_V=split_block, num_warps=8 if split_block >= 2048 else 4, enable_fp_fusion=False,
        )
    _sample_kernel[(n_rows,)](
        logits, logits.stride(0), temperature, top_k, top_p, min_p, seeds, offsets, out,
        part_score, part_idx, cand_l, cand_i, vocab, num_splits,
        SPLIT=split, BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_V=block_v,
        num_warps=8 if block_v >= 2048 else 4, enable_fp_fusion=False,
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
