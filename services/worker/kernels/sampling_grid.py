"""Pass 1's sample of a row's top, and what the row program reads from it (see sampling.py's kernel
section): each lane of a chunk keeps its four largest values, which are counted on a fixed grid of l
per chunk; the row program merges the chunks' grids and takes from them a lower bound of top-k's
threshold and a band around top-p's. Also a row's pass-1 results reduced: its plain draw, or its m,
Z and the bounds of its candidate set C (_row_start, _c_bound), for the row program and for the
bounds launch before the chunked second read."""

from __future__ import annotations

import triton
import triton.language as tl

from services.worker.kernels.sampling_scan import _NEG_INF_KEY, _float_key, _key_float, _load_u, _tile_select

# Pass 1's grid: bins per unit of l, a power of two so that bin edges are exact; and how many bins
# below a chunk's max it counts: top-p's T lies within log(V / (1 - p)) of m (14.1 at V = 128k and
# p = 0.9), top-k's and min-p's usually closer.
_GRID = tl.constexpr(8.0)
_GRID_BINS = tl.constexpr(128)


@triton.jit
def _grid_bin(x, top):
    """x's bin on the grid, counted down from bin 0 = [top, top + 1) / _GRID: bin j holds
    (top - j) / _GRID <= x < (top - j + 1) / _GRID; _GRID_BINS for x below the last bin (or -inf).
    Scaling by a power of two and flooring are exact, so a bin's edges bound its values exactly."""
    j = top - tl.floor(x * _GRID)
    return tl.where(j < _GRID_BINS, j, _GRID_BINS).to(tl.int32)


@triton.jit
def _needs_grid(top_k, use_k, use_p, n_u):
    """Whether a row's sets can outgrow what u bounds: top-p's (without top-k) can hold far more
    tokens than u has values, and so can a top-k set of more than a quarter as many tokens as u
    (the k-th largest of u lies ever further below t_k as the k tokens share groups). Other rows
    skip the grid: its samples and histograms cost (pass 1 of a grid row 72 µs against 43 without,
    B = 256, bf16 logits, H100, 2026-11-27)."""
    return (use_p & (use_k == 0)) | (use_k & (top_k * 4 > n_u))


@triton.jit
def _chunk_grid(lane_max, lane_2nd, lane_3rd, lane_4th, group_max, m, grid_ptr):
    """The chunk's sample on the grid whose bin 0 holds m (the chunk's max): per bin, how many of the
    lanes' four largest values fall in it, apart from the group maxima u, and how many of u do (in
    the high and low 16 bits: at most 4 * BLOCK_V each). The row's program weighs u exactly, the
    others at their bin's middle."""
    top = tl.floor(m * _GRID)
    bins = tl.arange(0, _GRID_BINS)
    b1 = _grid_bin(lane_max, top)
    b2 = _grid_bin(lane_2nd, top)
    b3 = _grid_bin(lane_3rd, top)
    b4 = _grid_bin(lane_4th, top)
    bu = _grid_bin(group_max, top)
    n_u = tl.histogram(bu, _GRID_BINS, mask=bu < _GRID_BINS)
    # Each group max is one lane's max, in the same bin: the lanes' maxima less u are the others,
    # counted once each even where lanes tie with their group's max (bf16 logits tie often).
    n_others = (tl.histogram(b1, _GRID_BINS, mask=b1 < _GRID_BINS) - n_u
                + tl.histogram(b2, _GRID_BINS, mask=b2 < _GRID_BINS)
                + tl.histogram(b3, _GRID_BINS, mask=b3 < _GRID_BINS)
                + tl.histogram(b4, _GRID_BINS, mask=b4 < _GRID_BINS))
    tl.store(grid_ptr + bins, (n_others << 16) | n_u)


@triton.jit
def _lane_update(l, lane_max, lane_2nd, lane_3rd, lane_4th, lane_z, SAMPLES: tl.constexpr):
    """One tile into the lanes: their largest values (four with SAMPLES, else only the max) and
    their sum of exp(l - max), one exp a token: the smaller of (l, lane max) relative to the larger
    (ref 0 keeps -inf - -inf out of a lane all -inf so far, which sums nothing)."""
    new_max = tl.maximum(lane_max, l)
    if SAMPLES:
        t = tl.minimum(lane_max, l)
        lane_4th = tl.maximum(lane_4th, tl.minimum(lane_3rd, t))
        lane_3rd = tl.maximum(lane_3rd, tl.minimum(lane_2nd, t))
        lane_2nd = tl.maximum(lane_2nd, t)
    ref = tl.where(new_max > float("-inf"), new_max, 0.0)
    d = tl.exp(tl.minimum(lane_max, l) - ref)
    lane_z = tl.where(l > lane_max, lane_z * d + 1.0, lane_z + d)
    return new_max, lane_2nd, lane_3rd, lane_4th, lane_z


@triton.jit
def _lane_stats(base, start, end, inv_t, SAMPLES: tl.constexpr, BLOCK_V: tl.constexpr):
    """A chunk [start, end) of a filtered row, lane j holding tokens start + j, start + j + BLOCK_V,
    ...: per lane its max, 2nd, 3rd and 4th largest l (-inf without SAMPLES) and its sum of
    exp(l - max). Two tiles a step, both read before either is used: one program's loop waits on
    each read's latency, so what it has in flight sets its rate (a bf16 tile is half an fp32 one)."""
    cols = tl.arange(0, BLOCK_V)
    lane_max = tl.full([BLOCK_V], float("-inf"), tl.float32)
    lane_2nd = tl.full([BLOCK_V], float("-inf"), tl.float32)
    lane_3rd = tl.full([BLOCK_V], float("-inf"), tl.float32)
    lane_4th = tl.full([BLOCK_V], float("-inf"), tl.float32)
    lane_z = tl.zeros([BLOCK_V], tl.float32)
    for v0 in range(start, end, 2 * BLOCK_V):
        idx = v0 + cols
        x = tl.load(base + idx, mask=idx < end, other=float("-inf"))
        x2 = tl.load(base + idx + BLOCK_V, mask=idx + BLOCK_V < end, other=float("-inf"))
        lane_max, lane_2nd, lane_3rd, lane_4th, lane_z = _lane_update(
            x.to(tl.float32) * inv_t, lane_max, lane_2nd, lane_3rd, lane_4th, lane_z, SAMPLES)
        lane_max, lane_2nd, lane_3rd, lane_4th, lane_z = _lane_update(
            x2.to(tl.float32) * inv_t, lane_max, lane_2nd, lane_3rd, lane_4th, lane_z, SAMPLES)
    return lane_max, lane_2nd, lane_3rd, lane_4th, lane_z


@triton.jit
def _row_grid(grid_ptr, part_m_ptr, num_splits, m, GRID_S: tl.constexpr):
    """The chunks' samples on the row's grid, whose bin 0 holds m: a chunk's bin j is the row's bin
    j + (how many bins the chunk's max lies below m). Returns the grid's top (m's bin, floor(m *
    _GRID)), and per bin the samples other than u, and those of u."""
    top = tl.floor(m * _GRID)
    bins = tl.arange(0, _GRID_BINS)
    others = tl.zeros([_GRID_BINS], tl.int32)
    of_u = tl.zeros([_GRID_BINS], tl.int32)
    for s0 in range(0, num_splits, GRID_S):
        s = s0 + tl.arange(0, GRID_S)
        m_s = tl.load(part_m_ptr + s, mask=s < num_splits, other=float("-inf"))
        src = bins[None, :] - (top - tl.floor(m_s * _GRID))[:, None]  # -inf where a chunk is all -inf
        ok = src >= 0
        packed = tl.load(grid_ptr + s[:, None] * _GRID_BINS + tl.where(ok, src, 0).to(tl.int32), mask=ok, other=0)
        others += tl.sum(packed >> 16, axis=0)
        of_u += tl.sum(packed & 0xFFFF, axis=0)
    return top, others, of_u


@triton.jit
def _grid_bounds(others, of_u, top, m, u, e_u, top_k, top_p, z, band):
    """From the row's grid, weighing u exactly and the other samples at their bin's middle: lo_k, the
    highest bin edge where the samples hold top_k tokens (a lower bound of t_k); and for top-p, a
    band [lo_p, hi) of about `band` samples, an eighth of them below the bin where their mass reaches
    p * Z (hi = +inf if all samples above lo_p are that few: the buffer holds them). lo_p is an estimate, not a
    bound: the scan's mass tells. -inf / +inf where the grid holds too few samples."""
    bins = tl.arange(0, _GRID_BINS)
    edge = (top - bins.to(tl.float32)) / _GRID
    at_or_above = tl.cumsum(others + of_u, axis=0)  # samples at or above each bin's lower edge
    j_k = tl.min(tl.where(at_or_above >= top_k, bins, _GRID_BINS), axis=0)
    lo_k = tl.where(j_k < _GRID_BINS, (top - j_k) / _GRID, float("-inf"))
    # The first bin where the samples' mass reaches p * Z, by bisection (the mass grows bin by bin).
    others_mass = tl.cumsum(others.to(tl.float32) * tl.exp(edge + 0.5 / _GRID - m), axis=0)
    j_lo = tl.zeros([], tl.int32)
    j_hi = tl.full([], _GRID_BINS, tl.int32)
    while j_lo < j_hi:
        mid = (j_lo + j_hi) // 2
        reached = (tl.sum(tl.where(u >= (top - mid) / _GRID, e_u, 0.0), axis=0)
                   + tl.sum(tl.where(bins == mid, others_mass, 0.0), axis=0)) >= top_p * z
        j_lo = tl.where(reached, j_lo, mid + 1)
        j_hi = tl.where(reached, mid, j_hi)
    at_p = tl.sum(tl.where(bins == j_lo, at_or_above, 0), axis=0)
    # An eighth of the band below that bin, the rest above: the samples' mass undercounts the row's
    # where lanes hold more than four tokens above a level, so T lies above the estimate more often
    # than below (on the H100, B = 256, top-p 0.9 alone, two samples a lane: 223 against 228 µs
    # centred; with four, broad rows placed a half below or an eighth read alike on the CPU).
    j_p = tl.max(tl.where(at_or_above <= at_p + band // 8, bins, 0), axis=0)
    c_p = tl.sum(tl.where(bins == j_p, at_or_above, 0), axis=0)
    j_band = tl.minimum(tl.min(tl.where(at_or_above >= c_p - band, bins, _GRID_BINS), axis=0), j_p - 1)
    lo_p = tl.where(j_lo < _GRID_BINS, (top - j_p) / _GRID, float("-inf"))
    hi = tl.where((j_lo < _GRID_BINS) & (c_p > band), (top - j_band) / _GRID, float("inf"))
    return lo_k, lo_p, hi


@triton.jit
def _plain_token(part_score, part_idx_ptr, num_splits, vocab, BLOCK_S: tl.constexpr):
    """A row without filters: the best of its chunks' draws (part_score, loaded), ties to the lowest index."""
    s = tl.arange(0, BLOCK_S)
    part_idx = tl.load(part_idx_ptr + s, mask=s < num_splits, other=vocab)
    s_max = tl.max(part_score, axis=0)
    return tl.min(tl.where(part_score == s_max, part_idx, vocab), axis=0)


@triton.jit
def _row_start(part_score, part_z_ptr, part_u_ptr, part_grid_ptr, part_score_ptr, row, num_splits, n_u, top_k, top_p,
               use_k, use_p, BLOCK_S: tl.constexpr, BLOCK_U: tl.constexpr, GRID_S: tl.constexpr, BAND: tl.constexpr):
    """A filtered row's pass-1 results reduced (part_score: its chunks' maxima, loaded): m, Z, and the
    grid's bounds lo_k, lo_p and hi (-inf / -inf / +inf where it has none; see _grid_bounds)."""
    s = tl.arange(0, BLOCK_S)
    m = tl.max(part_score, axis=0)
    part_z = tl.load(part_z_ptr + row * num_splits + s, mask=s < num_splits, other=0.0)
    z = tl.sum(tl.where(part_score > float("-inf"), part_z * tl.exp(part_score - m), 0.0), axis=0)
    lo_k = tl.full([], float("-inf"), tl.float32)
    lo_p = tl.full([], float("-inf"), tl.float32)
    hi_p = tl.full([], float("inf"), tl.float32)
    # |m * _GRID| < 2^23: the grid's bin numbers are exact in fp32.
    if _needs_grid(top_k, use_k, use_p, n_u) & (tl.abs(m) < 1048576.0):
        top, others, of_u = _row_grid(part_grid_ptr + row * num_splits * _GRID_BINS,
                                      part_score_ptr + row * num_splits, num_splits, m, GRID_S)
        u = _load_u(part_u_ptr + row * n_u, n_u, BLOCK_U)
        lo_k, lo_p, hi_p = _grid_bounds(others, of_u, top, m, u, tl.exp(u - m), top_k, top_p, z, BAND)
    return m, z, lo_k, lo_p, hi_p


@triton.jit
def _c_bound(vocab, top_k, top_p, use_k, use_p, m, z, u_ptr, n_u, lo_k, lo_p, hi_p, BLOCK_U: tl.constexpr):
    """The bound beta of C = {l >= beta} (strict where beta is -inf: tokens at -inf are never drawn),
    the level hi above which C's tokens are drawn rather than kept once C outgrows its buffer, and
    top-p's tail bound. The grid's bounds when it has them (lo_k is a bound, lo_p an estimate checked
    after the scan), else a select over u (which holds values of the row, so at least k tokens, or p
    of the mass, lie at or above it)."""
    m_key = _float_key(m).to(tl.int64)
    no_key = tl.full([], _NEG_INF_KEY, tl.int64)
    beta = tl.full([], float("-inf"), tl.float32)
    hi = tl.full([], float("inf"), tl.float32)
    tail = beta
    if use_k:
        beta = lo_k
        if beta == float("-inf"):
            u = _load_u(u_ptr, n_u, BLOCK_U)
            beta = _key_float(_tile_select(u, (u > float("-inf")).to(tl.float32), top_k.to(tl.float32), no_key,
                                           m_key))
    elif use_p:
        # Below m + log((1 - p) * Z / V) lie at most V tokens, each of e < (1 - p) * Z / V.
        tail = m + tl.log((1.0 - top_p) * z / vocab)
        beta = tl.maximum(lo_p, tail)
        hi = hi_p
        if lo_p == float("-inf"):
            u = _load_u(u_ptr, n_u, BLOCK_U)
            beta = tl.maximum(_key_float(_tile_select(u, tl.exp(u - m), top_p * z, no_key, m_key)), tail)
    else:
        hi = float("-inf")  # min-p alone: C is the kept set, and only needs drawing
    return beta, hi, tail
