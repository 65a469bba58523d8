"""The sampler's second read (see sampling.py's kernel section): the row's tokens at or above a
bound into a one-tile buffer per row, the drawn ones folded into a Gumbel argmax as they pass, and
the exact thresholds and draw from the buffer; with the counter-based noise and the fp32 order keys
that both of the sampler's passes use."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from services.worker.kernels._common import INTERPRET

_NEG_INF_KEY = tl.constexpr(-2139095041)  # _float_key(-inf): 0xFF800000 ^ 0x7FFFFFFF as int32
_NONE = tl.constexpr(2**31 - 1)  # "no token yet" in a running argmax
_BINS = tl.constexpr(256)  # key ranges counted per read by the top-k select over the row


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
def _bits23(row_key, idx):
    """The token's 23 random bits (u is (n + 0.5) * 2^-23): one mixing round per token, after the
    golden-ratio multiply spreads consecutive indices."""
    return _lowbias32(row_key ^ (idx.to(tl.uint32) * 0x9E3779B9)) >> 9


@triton.jit
def _uniform(row_key, idx):
    return (_bits23(row_key, idx).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2^-23


@triton.jit
def _log2(x):
    """log2 by the GPU's approximate instruction (lg2.approx: 2^-22 relative, 2^-22.6 absolute on
    [0.5, 2)); the exact one under TRITON_INTERPRET, which has no libdevice."""
    if INTERPRET:
        return tl.log2(x)
    else:
        return libdevice.fast_log2f(x)


@triton.jit
def _gumbel(row_key, idx):
    """-log(-log u) for the token's u (_uniform), within ~2e-6 of the exact value: two approximate
    logs cost half of what two exact ones do, and the noise is most of a draw's arithmetic. The inner
    log is the one that needs care: near u = 1, -log u is tiny and an absolute error of 2^-22.6 would
    swamp it, so there it is the series of -log(1 - w) in w = 1 - u (exact: u is on a 2^-23 grid)."""
    n = _bits23(row_key, idx)
    u = (n.to(tl.float32) + 0.5) * 1.1920928955078125e-07
    w = ((8388607 - n).to(tl.float32) + 0.5) * 1.1920928955078125e-07
    near_one = w * (1.0 + w * (0.5 + w * (0.3333333333 + w * (0.25 + w * (0.2 + w * (0.1666666667 + w * (
        0.1428571429 + w * 0.125)))))))  # w <= 1/16: the first omitted term is below 2^-32 of the sum
    e = tl.where(w < 0.0625, near_one, -0.6931471805599453 * _log2(u))
    return -0.6931471805599453 * _log2(e)


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
    # Rows with no filter need no max and no thresholds: pass 1 draws them.
    simple = greedy | ((use_k | use_p | use_min_p) == 0)
    inv_t = tl.div_rn(1.0, tl.where(greedy, 1.0, temp))
    return greedy, simple, inv_t, top_k, top_p, min_p, use_k, use_p


@triton.jit
def _load_u(u_ptr, n_u, BLOCK_U: tl.constexpr):
    j = tl.arange(0, BLOCK_U)
    return tl.load(u_ptr + j, mask=j < n_u, other=float("-inf"))


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
def _tile_select(v, w, target, lo, hi):
    """The largest value t of v with sum(w[v >= t]) >= target, as an order key; lo if there is none
    above lo (lo: a key that qualifies, or the -inf key). A bisection over keys within [lo, hi], both
    ends snapped to values of v after each step, so it ends exactly, after about log2(distinct values)
    steps, at most 32."""
    while lo < hi:
        probe = _key_float(lo + (hi - lo + 1) // 2)
        ge = v >= probe
        take = tl.sum(tl.where(ge, w, 0.0), axis=0) >= target
        up = tl.min(tl.where(ge, v, float("inf")), axis=0)
        down = tl.max(tl.where(ge, float("-inf"), v), axis=0)
        lo = tl.where(take, tl.minimum(_float_key(up).to(tl.int64), hi), lo)
        hi = tl.where(take, hi, _float_key(down).to(tl.int64))
    return lo


@triton.jit
def _better(l, idx, take, key, best_s, best_i):
    """Folds the Gumbel argmax over the tokens in take into (best_s, best_i): ties go to the lowest
    index, whatever order the tokens come in."""
    score = tl.where(take, l + _gumbel(key, idx), float("-inf"))
    s = tl.max(score, axis=0)
    i = tl.min(tl.where(take & (score == s), idx, _NONE), axis=0)
    better = (s > best_s) | ((s == best_s) & (i < best_i))
    return tl.where(better, s, best_s), tl.where(better, i, best_i)


@triton.jit
def _append(buf_l, buf_i, at, l, idx, take):
    """Stores the tokens in take at buffer positions at, at + 1, ... in index order."""
    pos = at + tl.cumsum(take.to(tl.int32), axis=0) - 1
    tl.store(buf_l + pos, l, mask=take)
    tl.store(buf_i + pos, idx, mask=take)


@triton.jit
def _drain(buf_l, buf_i, start, end, m, min_p, key, best_s, best_i, BLOCK_V: tl.constexpr):
    """Folds the draw over the buffer's tokens at positions [start, end) into (best_s, best_i); also
    returns their mass."""
    tl.debug_barrier()  # the program's stores are seen by all of its threads
    cols = tl.arange(0, BLOCK_V)
    ok = (cols >= start) & (cols < end)
    l = tl.load(buf_l + cols, mask=ok, other=float("-inf"))
    idx = tl.load(buf_i + cols, mask=ok, other=0)
    e = tl.where(ok, tl.exp(l - m), 0.0)
    best_s, best_i = _better(l, idx, ok & (e >= min_p), key, best_s, best_i)
    tl.debug_barrier()  # every thread has read before the buffer is refilled
    return best_s, best_i, tl.sum(e, axis=0)


@triton.jit
def _compact(buf_l, buf_i, n_keep, cut, m, min_p, key, drawn, best_s, best_i, BLOCK_V: tl.constexpr):
    """Draws the buffer's first n_keep tokens that lie at or above cut (their mass added to drawn) and
    moves the others to the front. Returns how many stay, drawn and the draw so far."""
    tl.debug_barrier()  # the program's stores are seen by all of its threads
    cols = tl.arange(0, BLOCK_V)
    ok = cols < n_keep
    l = tl.load(buf_l + cols, mask=ok, other=float("-inf"))
    idx = tl.load(buf_i + cols, mask=ok, other=0)
    e = tl.exp(l - m)
    draw = ok & (l >= cut)
    drawn += tl.sum(tl.where(draw, e, 0.0), axis=0)
    best_s, best_i = _better(l, idx, draw & (e >= min_p), key, best_s, best_i)
    stay = ok & (l < cut)
    tl.debug_barrier()  # every thread has read before the buffer is rewritten
    _append(buf_l, buf_i, 0, l, idx, stay)
    return tl.sum(stay.to(tl.int32), axis=0), drawn, best_s, best_i


@triton.jit
def _scan(base, buf_l, buf_i, vocab, inv_t, m, key, beta, strict, hi, set_min_p, min_p, BLOCK_V: tl.constexpr):
    """One read of the row for the set C = {l > beta} if strict else {l >= beta}, less the tokens
    with e < set_min_p. The buffer keeps C's tokens below a cut, in index order at its front; the
    others are only drawn. The cut starts at +inf and drops when the kept tokens would not fit: to
    hi, then to -inf (none kept). Returns |C|, its mass, how many tokens the buffer keeps, the cut
    (+inf: all of C is in the buffer), and the drawn tokens' mass and Gumbel winner among those with
    e >= min_p (score and index, _NONE if none). Noise is drawn only for drawn tokens, which wait at
    the buffer's far end and are drawn a tile at a time.

    The loops are bound by the block-wide steps of each tile (reductions, scans: a barrier each), so
    a tile takes as few as it can: masses are summed where tokens are drawn, and over the kept
    tokens once at the end."""
    cols = tl.arange(0, BLOCK_V)
    n = tl.zeros([], tl.int32)
    n_keep = tl.zeros([], tl.int32)
    v0 = tl.zeros([], tl.int32)
    x = tl.load(base + cols, mask=cols < vocab, other=float("-inf"))
    # The usual case in a loop of its own, whose few registers then never spill: all of C so far
    # fits in the buffer. The first tile that does not is read again by the second loop.
    fits = tl.full([], 1, tl.int32)
    while (v0 < vocab) & (fits != 0):
        idx = v0 + cols
        # The next tile's read is issued before this tile's work, so two are in flight.
        x_next = tl.load(base + idx + BLOCK_V, mask=idx + BLOCK_V < vocab, other=float("-inf"))
        l = x.to(tl.float32) * inv_t
        in_c = (idx < vocab) & tl.where(strict != 0, l > beta, l >= beta)
        if set_min_p > 0.0:  # exp only where min-p thins C (exp >= 0 keeps every token)
            in_c = in_c & (tl.exp(l - m) >= set_min_p)
        cnt = tl.sum(in_c.to(tl.int32), axis=0)
        if n_keep + cnt <= BLOCK_V:
            if cnt > 0:
                _append(buf_l, buf_i, n_keep, l, idx, in_c)
            n_keep += cnt
            v0 += BLOCK_V
            x = x_next
        else:
            fits = tl.zeros([], tl.int32)
    n = n_keep
    pending = tl.zeros([], tl.int32)  # drawn tokens not drawn yet, at [BLOCK_V - pending, BLOCK_V)
    cut = tl.full([], float("inf"), tl.float32)
    drawn = tl.zeros([], tl.float32)
    best_s = tl.full([], float("-inf"), tl.float32)
    best_i = tl.full([], _NONE, tl.int32)
    while v0 < vocab:
        idx = v0 + cols
        x_next = tl.load(base + idx + BLOCK_V, mask=idx + BLOCK_V < vocab, other=float("-inf"))
        l = x.to(tl.float32) * inv_t
        in_c = (idx < vocab) & tl.where(strict != 0, l > beta, l >= beta) & (tl.exp(l - m) >= set_min_p)
        keep = in_c & (l < cut)
        # Kept and drawn tokens counted (and below, ranked) in one step: 16 bits each.
        both = keep.to(tl.int32) | ((in_c & (l >= cut)).to(tl.int32) << 16)
        counts = tl.sum(both, axis=0)
        n_k = counts & 0xFFFF
        n_d = counts >> 16
        if n_keep + n_k + pending + n_d > BLOCK_V:
            # No room: draw the waiting tokens, or if none wait, lower the cut (to -inf at worst, where
            # nothing is kept and a tile always fits), and read the tile again: nothing of it is held
            # meanwhile.
            if pending > 0:
                best_s, best_i, w = _drain(buf_l, buf_i, BLOCK_V - pending, BLOCK_V, m, min_p, key, best_s, best_i,
                                           BLOCK_V)
                drawn += w
                pending = tl.zeros([], tl.int32)
            else:
                cut = tl.where(cut > hi, hi, float("-inf"))
                n_keep, drawn, best_s, best_i = _compact(buf_l, buf_i, n_keep, cut, m, min_p, key, drawn, best_s,
                                                         best_i, BLOCK_V)
            x = tl.load(base + idx, mask=idx < vocab, other=float("-inf"))
        else:
            if counts > 0:  # kept tokens to the front, drawn ones to the far end, to be drawn in batches
                rank = tl.cumsum(both, axis=0)
                pos = tl.where(keep, n_keep + (rank & 0xFFFF) - 1, BLOCK_V - pending - n_d + (rank >> 16) - 1)
                tl.store(buf_l + pos, l, mask=in_c)
                tl.store(buf_i + pos, idx, mask=in_c)
            n_keep += n_k
            pending += n_d
            n += n_k + n_d
            v0 += BLOCK_V
            x = x_next
    if pending > 0:
        best_s, best_i, w = _drain(buf_l, buf_i, BLOCK_V - pending, BLOCK_V, m, min_p, key, best_s, best_i,
                                   BLOCK_V)
        drawn += w
    tl.debug_barrier()  # the kept tokens are read next, by all of the program's threads
    kept = cols < n_keep
    mass = drawn + tl.sum(tl.where(kept, tl.exp(tl.load(buf_l + cols, mask=kept, other=0.0) - m), 0.0), axis=0)
    return n, mass, n_keep, cut, drawn, best_s, best_i


@triton.jit
def _row_count_select(base, vocab, inv_t, lo, hi, k, cnt_lo, BLOCK_V: tl.constexpr):
    """t_k over the row, for a row with top-k and top-p whose top-k set the bound from pass 1 left
    larger than the buffer (top-p needs that whole set). Radix-select style: each read counts the
    tokens in _BINS equal ranges of order keys covering [lo, hi] and keeps the range holding t_k, so
    a key is exact after 4 reads. Invariant: cnt_lo >= k tokens have keys >= lo; t_k's key is in
    [lo, hi]. Stops as soon as those tokens fit in the buffer. Returns (lo, cnt_lo, reads)."""
    cols = tl.arange(0, BLOCK_V)
    bins = tl.arange(0, _BINS)
    reads = tl.zeros([], tl.int32)
    while (lo < hi) & (cnt_lo > BLOCK_V):
        shift = tl.zeros([], tl.int64)
        while ((hi - lo) >> shift) >= _BINS:
            shift += 1
        counts = tl.zeros([_BINS], tl.int32)
        for v0 in range(0, vocab, BLOCK_V):
            idx = v0 + cols
            l = tl.load(base + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32) * inv_t
            above_lo = _float_key(l).to(tl.int64) - lo
            counts += tl.histogram(tl.minimum(above_lo >> shift, _BINS - 1).to(tl.int32), _BINS,
                                   mask=(idx < vocab) & (above_lo >= 0))
        at_or_above = tl.cumsum(counts, axis=0, reverse=True)  # tokens at or above each range's start
        j = tl.max(tl.where(at_or_above >= k, bins, 0), axis=0)
        cnt_lo = tl.sum(tl.where(bins == j, at_or_above, 0), axis=0)
        hi = tl.minimum(hi, lo + ((j + 1).to(tl.int64) << shift) - 1)
        lo = lo + (j.to(tl.int64) << shift)
        reads += 1
    return lo, cnt_lo, reads


@triton.jit
def _finish(buf_l, buf_i, n, floor, k_sel, top_k, use_p, top_p, z, z_from_buf, drawn, m, min_p, key, best_s,
            best_i, TILE: tl.constexpr):
    """The draw from the buffer: n tokens, which with the drawn ones (mass drawn, winner (best_s,
    best_i); all above the buffer's and all kept) make an upper set of the row holding every kept
    token, so the thresholds found here are exact. floor: t_k when already known, else -inf. k_sel:
    t_k is the top_k-th largest in the buffer (-inf when it holds fewer: then they all are in the
    top-k set). z_from_buf: the buffer holds the whole top-k set and Z is its mass."""
    cols = tl.arange(0, TILE)
    ok = cols < n
    l = tl.load(buf_l + cols, mask=ok, other=float("-inf"))
    idx = tl.load(buf_i + cols, mask=ok, other=0)
    e = tl.exp(l - m)
    m_key = _float_key(m).to(tl.int64)
    t = floor
    if k_sel:
        t = _key_float(_tile_select(l, ok.to(tl.float32), top_k.to(tl.float32),
                                    tl.full([], _NEG_INF_KEY, tl.int64), m_key))
    if use_p:
        if z_from_buf:
            z = tl.sum(tl.where(l >= t, e, 0.0), axis=0)
        t = _key_float(_tile_select(l, e, top_p * z - drawn, _float_key(t).to(tl.int64), m_key))
    _, best = _better(l, idx, ok & (l >= t) & (e >= min_p), key, best_s, best_i)
    return tl.where(best < _NONE, best, 0)  # nothing kept (min_p > 1): index 0, as argmax over -inf
