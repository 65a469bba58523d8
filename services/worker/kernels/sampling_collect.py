"""The sampler's second read split over chunks of the row (see sampling.py's kernel section).

The row program reads a row serially, one program per row: its read loop alone took ~75 µs at
B = 256 (H100, bf16 logits), and a batch of one row leaves all but one SM idle. Here the read is
split over up to COLLECT_SPLITS programs a row. A per-row launch before (_bounds_kernel) reduces
pass 1 and fixes C's bound; each chunk gathers its part of C into its own region of the row's
buffer (_chunk_scan); a per-row launch after (_collect_end_kernel) merges the
regions and ends the row as the row program would after its scan: the exact draw from the buffer,
or top-p's chain left to the rounds (a candidate, or a sure bound to read above), or top-k's to
the chain's serial finish. What needs a serial read of its own (t_k over the row, the sure bound's
read without rounds) is left to the row program, which then runs for that row alone (_SERIAL).
The split serves batches up to the SM count (sampling._collects); larger ones are read by the row
program alone.

A chunk's loop takes no block-wide step per tile while each lane holds at most two tokens of C
(registers, moved to the region once at the end): the row program's per-tile count and rank, each
a barrier, set its pace. Each region sits at a fixed place and is filled in a fixed order, so the
buffer, and with it every sum and draw, is the same whatever order the programs run in.
"""

from __future__ import annotations

import triton
import triton.language as tl

from services.worker.kernels.sampling_chain import _chain_row, _chain_start
from services.worker.kernels.sampling_grid import _c_bound, _plain_token, _row_start
from services.worker.kernels.sampling_scan import (_NEG_INF_KEY, _NONE, _append, _better, _compact, _drain, _finish,
                                                   _float_key, _key_float, _load_u, _row_key, _row_params,
                                                   _tile_select)

# A row's state between the launches (the first of cand's three rows per batch row); a token index
# (>= 0) is top-p's pending candidate.
_DONE = tl.constexpr(-1)
_BOUND = tl.constexpr(-2)  # the rounds read above a sure bound first (sampling_chain.py)
_SERIAL = tl.constexpr(-3)  # the row program reads it serially (sampling.py's _sample_kernel with GATE)
_COLLECT = tl.constexpr(-4)  # the chunked second read takes it

COLLECT_SPLITS = 8  # chunks a row's second read is split into, at most
_MIN_REGION = 256  # a chunk's part of the buffer, at least: top-p's band is ~1,300 tokens a row


def collect_splits(vocab: int, block_v: int, want: int | None = None) -> tuple[int, int, int]:
    """(chunk, splits, region) of the second read: whole tiles of block_v tokens per chunk, and per
    chunk a region of the row's block_v-token buffer (a power of two, so splits * region fits it). By
    the vocabulary and block_v alone: no variant follows the batch size. want: splits asked for
    (tests: small buffers split too), else COLLECT_SPLITS while regions keep _MIN_REGION tokens."""
    tiles = triton.cdiv(vocab, block_v)
    if want is None:
        want = min(COLLECT_SPLITS, block_v // _MIN_REGION)
    want = max(1, min(want, block_v // 16, tiles))
    want = 1 << (want.bit_length() - 1)
    per = triton.cdiv(tiles, want)
    return per * block_v, triton.cdiv(tiles, per), block_v // want


@triton.jit(do_not_specialize=["temp_ptr", "top_k_ptr", "top_p_ptr", "min_p_ptr", "num_splits", "n_u", "arrived_ptr",
                               "bound_ptr", "beta_ptr", "hi_ptr", "lo_p_ptr", "tail_ptr", "chain_first"])
def _bounds_kernel(
    logits_ptr, logits_stride, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, out_ptr, reads_ptr, part_score_ptr,
    part_idx_ptr, part_z_ptr, part_u_ptr, part_grid_ptr, part_draw_ptr, cand_ptr, arrived_ptr, m_ptr, z_ptr, bound_ptr,
    beta_ptr, hi_ptr, lo_p_ptr, tail_ptr, vocab, num_splits, n_u, chain_first, BLOCK_S: tl.constexpr,
    BLOCK_U: tl.constexpr, GRID_S: tl.constexpr, BAND: tl.constexpr, COUNT_READS: tl.constexpr,
):
    """One program per row, after pass 1, before the second read (the chunked one below, or the row
    program's): rows without filters take pass 1's draw; chain rows get m, Z and their first candidate,
    pass 1's winner w (sampling_chain.py), or w's l as a bound where w lies below min-p, or w as the
    draw where min-p alone filters the row and w passes it; the other filtered rows m, Z and C's
    bounds, and wait for that read (_COLLECT)."""
    row = tl.program_id(0).to(tl.int64)
    n_rows = tl.num_programs(0)
    _, simple, inv_t, top_k, top_p, min_p, use_k, use_p = _row_params(temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, row,
                                                                      vocab)
    s = tl.arange(0, BLOCK_S)
    part_score = tl.load(part_score_ptr + row * num_splits + s, mask=s < num_splits, other=float("-inf"))
    if simple:
        token = _plain_token(part_score, part_idx_ptr + row * num_splits, num_splits, vocab, BLOCK_S)
        tl.store(out_ptr + row, token.to(tl.int64))
        tl.store(cand_ptr + row, _DONE)
        if COUNT_READS:
            tl.store(reads_ptr + row, 1)
    elif _chain_row(use_k, use_p, min_p, chain_first):
        m, z, first = _chain_start(part_score, part_z_ptr + row * num_splits, part_draw_ptr + row * num_splits,
                                   part_idx_ptr + row * num_splits, num_splits, BLOCK_S)
        tl.store(m_ptr + row, m)
        tl.store(z_ptr + row, z)
        if first == _NONE:  # every l at -inf: nothing kept, index 0 (as the reference's argmax)
            tl.store(out_ptr + row, tl.zeros([], tl.int64))
            tl.store(cand_ptr + row, _DONE)
        else:
            l_w = tl.load(logits_ptr + row * logits_stride + first).to(tl.float32) * inv_t
            if tl.exp(l_w - m) >= min_p:
                if use_p:
                    tl.store(cand_ptr + row, first)
                else:  # min-p alone: the winner over all of the row, in its kept set, is the draw
                    tl.store(out_ptr + row, first.to(tl.int64))
                    tl.store(cand_ptr + row, _DONE)
            else:  # every kept token lies above w: the first round draws there
                tl.store(bound_ptr + row, l_w)
                tl.store(cand_ptr + row, _BOUND)
        if COUNT_READS:
            tl.store(reads_ptr + row, 1)
    else:
        m, z, lo_k, lo_p, hi_p = _row_start(part_score, part_z_ptr, part_u_ptr, part_grid_ptr, part_score_ptr, row,
                                            num_splits, n_u, top_k, top_p, use_k, use_p, BLOCK_S, BLOCK_U, GRID_S, BAND)
        beta, hi, tail = _c_bound(vocab, top_k, top_p, use_k, use_p, m, z, part_u_ptr + row * n_u, n_u, lo_k, lo_p,
                                  hi_p, BLOCK_U)
        tl.store(m_ptr + row, m)
        tl.store(z_ptr + row, z)
        tl.store(beta_ptr + row, beta)
        tl.store(hi_ptr + row, hi)
        tl.store(lo_p_ptr + row, lo_p)
        tl.store(tail_ptr + row, tail)
        tl.store(cand_ptr + row, _COLLECT)
    tl.store(arrived_ptr + row, 0)  # the chain's rounds count their chunks' arrivals here
    tl.store(arrived_ptr + n_rows + row, 0)  # and the second read its chunks' here


@triton.jit
def _in_c(l, idx, end, m, beta, strict, set_min_p):
    """A tile's tokens in C: above beta (at or above unless strict), before end, and at or above
    set_min_p where min-p thins C (exp only then)."""
    in_c = (idx < end) & tl.where(strict != 0, l > beta, l >= beta)
    if set_min_p > 0.0:
        in_c = in_c & (tl.exp(l - m) >= set_min_p)
    return in_c


@triton.jit
def _lane_take(l, idx, end, m, beta, strict, set_min_p, cnt, l_1, i_1, l_2, i_2):
    """One tile into the lanes' first two tokens of C, and their counts."""
    in_c = _in_c(l, idx, end, m, beta, strict, set_min_p)
    second = in_c & (cnt == 1)
    first = in_c & (cnt == 0)
    return (cnt + in_c.to(tl.int32), tl.where(first, l, l_1), tl.where(first, idx, i_1), tl.where(second, l, l_2),
            tl.where(second, idx, i_2))


@triton.jit
def _chunk_scan(base, buf_l, buf_i, start, end, inv_t, m, key, beta, strict, hi, set_min_p, min_p,
                BLOCK: tl.constexpr, REGION: tl.constexpr):
    """C's tokens in the chunk [start, end) into a region of REGION tokens: those below a cut kept at
    its front, the others drawn. Returns |C| in the chunk, how many tokens the region keeps, the cut,
    and the drawn tokens' mass and Gumbel winner among those with e >= min_p.

    First one read with no block-wide step per tile, which keeps all of C if it fits that way; else
    the row program's scan (sampling_scan._scan) on the smaller buffer: kept tokens in token order,
    drawn ones waiting at the region's far end, the cut from +inf down to hi, then -inf, as the kept
    tokens outgrow it; a tile's drawn tokens that not even an empty far end holds drawn in place."""
    cols = tl.arange(0, BLOCK)
    # The usual case first, with no block-wide step per tile (each one's barrier and count would set
    # the loop's pace, as in the row program): each lane keeps its first two tokens of C in registers
    # and counts the others. If no lane met a third and they fit, they are the chunk's C, moved to the
    # region once; else the chunk is read again by the loop below, which ranks each tile.
    cnt = tl.zeros([BLOCK], tl.int32)
    l_1 = tl.full([BLOCK], float("-inf"), tl.float32)
    l_2 = tl.full([BLOCK], float("-inf"), tl.float32)
    i_1 = tl.zeros([BLOCK], tl.int32)
    i_2 = tl.zeros([BLOCK], tl.int32)
    for v0 in range(start, end, 2 * BLOCK):  # two tiles a step, both read before either is used
        idx = v0 + cols
        x = tl.load(base + idx, mask=idx < end, other=float("-inf"))
        x2 = tl.load(base + idx + BLOCK, mask=idx + BLOCK < end, other=float("-inf"))
        cnt, l_1, i_1, l_2, i_2 = _lane_take(x.to(tl.float32) * inv_t, idx, end, m, beta, strict, set_min_p, cnt, l_1,
                                             i_1, l_2, i_2)
        cnt, l_1, i_1, l_2, i_2 = _lane_take(x2.to(tl.float32) * inv_t, idx + BLOCK, end, m, beta, strict, set_min_p,
                                             cnt, l_1, i_1, l_2, i_2)
    n_keep = tl.sum(cnt, axis=0)
    v0 = start
    if (tl.max(cnt, axis=0) <= 2) & (n_keep <= REGION):
        first = cnt >= 1
        _append(buf_l, buf_i, 0, l_1, i_1, first)
        _append(buf_l, buf_i, tl.sum(first.to(tl.int32), axis=0), l_2, i_2, cnt >= 2)
        v0 = end
    else:
        n_keep = tl.zeros([], tl.int32)
    x = tl.load(base + v0 + cols, mask=v0 + cols < end, other=float("-inf"))
    n = n_keep
    pending = tl.zeros([], tl.int32)  # drawn tokens not drawn yet, at [REGION - pending, REGION)
    cut = tl.full([], float("inf"), tl.float32)
    drawn = tl.zeros([], tl.float32)
    best_s = tl.full([], float("-inf"), tl.float32)
    best_i = tl.full([], _NONE, tl.int32)
    skip_d = tl.zeros([], tl.int32)  # this tile's drawn tokens were drawn in place: only its kept ones are left
    while v0 < end:
        idx = v0 + cols
        # The next tile's read is issued before this tile's work, so two are in flight.
        x_next = tl.load(base + idx + BLOCK, mask=idx + BLOCK < end, other=float("-inf"))
        l = x.to(tl.float32) * inv_t
        in_c = _in_c(l, idx, end, m, beta, strict, set_min_p)
        keep = in_c & (l < cut)
        # Kept and drawn tokens counted (and below, ranked) in one step: 16 bits each.
        draw = in_c & (l >= cut) & (skip_d == 0)
        both = keep.to(tl.int32) | (draw.to(tl.int32) << 16)
        counts = tl.sum(both, axis=0)
        n_k = counts & 0xFFFF
        n_d = counts >> 16
        if n_keep + n_k + pending + n_d <= REGION:
            if counts > 0:  # kept tokens to the front, drawn ones to the far end
                rank = tl.cumsum(both, axis=0)
                pos = tl.where(keep, n_keep + (rank & 0xFFFF) - 1, REGION - pending - n_d + (rank >> 16) - 1)
                tl.store(buf_l + pos, l, mask=both != 0)
                tl.store(buf_i + pos, idx, mask=both != 0)
            n_keep += n_k
            pending += n_d
            n += n_k + n_d
            v0 += BLOCK
            x = x_next
            skip_d = tl.zeros([], tl.int32)
        elif pending > 0:  # room first from the waiting drawn tokens; the tile is taken again
            best_s, best_i, w = _drain(buf_l, buf_i, REGION - pending, REGION, m, min_p, key, best_s, best_i, REGION)
            drawn += w
            pending = tl.zeros([], tl.int32)
        elif (n_keep + n_k > REGION) & (cut > float("-inf")):  # the kept ones do not fit: lower the cut
            cut = tl.where(cut > hi, hi, float("-inf"))
            n_keep, drawn, best_s, best_i = _compact(buf_l, buf_i, n_keep, cut, m, min_p, key, drawn, best_s,
                                                     best_i, REGION)
        else:  # the kept ones fit, the drawn ones not even in an empty far end: drawn here, from the tile,
            # and the tile taken again for its kept ones alone. (Not stored here: Triton 3.6 mis-compiles
            # a second ranking of the tile in this branch.)
            d = in_c & (l >= cut)
            e = tl.exp(l - m)
            drawn += tl.sum(tl.where(d, e, 0.0), axis=0)
            best_s, best_i = _better(l, idx, d & (e >= min_p), key, best_s, best_i)
            n += n_d
            skip_d = tl.full([], 1, tl.int32)
    if pending > 0:
        best_s, best_i, w = _drain(buf_l, buf_i, REGION - pending, REGION, m, min_p, key, best_s, best_i, REGION)
        drawn += w
    return n, n_keep, cut, drawn, best_s, best_i


@triton.jit
def _merge(buf_l, buf_i, part_f, part_i, splits, m, min_p, key, BLOCK_S: tl.constexpr, REGION: tl.constexpr,
           CAP: tl.constexpr):
    """The row's chunks after their scans: |C|, the lowest cut, the drawn mass and winner; the
    regions' kept tokens at or above that cut drawn too (a chunk that kept its cut higher holds
    some), the others moved to the buffer's front. Returns what the row program's scan returns:
    |C|, its mass, the tokens in the buffer, the cut, the drawn mass and winner."""
    s = tl.arange(0, BLOCK_S)
    ok_s = s < splits
    n = tl.sum(tl.load(part_i + s * 3, mask=ok_s, other=0), axis=0)
    cut = tl.min(tl.load(part_f + s * 3, mask=ok_s, other=float("inf")), axis=0)
    drawn = tl.sum(tl.load(part_f + s * 3 + 1, mask=ok_s, other=0.0), axis=0)
    score = tl.load(part_f + s * 3 + 2, mask=ok_s, other=float("-inf"))
    win = tl.load(part_i + s * 3 + 2, mask=ok_s, other=_NONE)
    best_s = tl.max(score, axis=0)
    best = tl.min(tl.where(score == best_s, win, _NONE), axis=0)
    cols = tl.arange(0, CAP)
    region = cols // REGION
    held = tl.load(part_i + region * 3 + 1, mask=region < splits, other=0)
    ok = (region < splits) & (cols % REGION < held)
    l = tl.load(buf_l + cols, mask=ok, other=float("-inf"))
    idx = tl.load(buf_i + cols, mask=ok, other=0)
    e = tl.where(ok, tl.exp(l - m), 0.0)
    if cut < float("inf"):
        d = ok & (l >= cut)
        drawn += tl.sum(tl.where(d, e, 0.0), axis=0)
        best_s, best = _better(l, idx, d & (e >= min_p), key, best_s, best)
        ok = ok & (l < cut)
    n_keep = tl.sum(ok.to(tl.int32), axis=0)
    mass = drawn + tl.sum(tl.where(ok, e, 0.0), axis=0)
    tl.debug_barrier()  # every thread has read its regions before the front is written
    _append(buf_l, buf_i, 0, l, idx, ok)
    tl.debug_barrier()  # the front is written before any thread reads it
    return n, mass, n_keep, cut, drawn, best_s, best


@triton.jit
def _collect_end(buf_l, buf_i, u_ptr, n_u, vocab, top_k, top_p, min_p, use_k, use_p, key, m, z, beta, lo_p, tail,
                 n, mass, n_keep, cut, drawn, best_s, best, rounds, BLOCK_U: tl.constexpr, CAP: tl.constexpr,
                 SMALL: tl.constexpr):
    """What the row program does after its first scan (sampling.py's _filtered_draw), short of any
    serial read. Returns (token, state: _DONE, _BOUND, _SERIAL or top-p's candidate, the sure bound)."""
    state = tl.full([], _DONE, tl.int32)
    token = tl.zeros([], tl.int32)
    bound = tl.full([], float("-inf"), tl.float32)
    if use_p & (use_k == 0) & (lo_p > tail) & (mass < top_p * z) & (tl.exp(beta - m) >= min_p):
        # The grid's lo_p was an estimate above T: read again from a sure bound, by the rounds.
        if rounds > 0:
            u = _load_u(u_ptr, n_u, BLOCK_U)
            sure = tl.maximum(_key_float(_tile_select(u, tl.exp(u - m), top_p * z, tl.full([], _NEG_INF_KEY, tl.int64),
                                                      _float_key(m).to(tl.int64))), tail)
            bound = _key_float(_float_key(sure).to(tl.int64) - 1)  # the float below: l > bound iff l >= sure
            state = tl.full([], _BOUND, tl.int32)
        else:
            state = tl.full([], _SERIAL, tl.int32)
    elif use_k & use_p & (cut < float("inf")):  # the top-k set outgrew the buffer: t_k over the row
        state = tl.full([], _SERIAL, tl.int32)
    else:
        in_buf = cut == float("inf")
        if (cut > float("-inf")) & (cut < float("inf")):  # C split at hi
            if drawn < top_p * z:  # T is below hi: every drawn token is kept, the buffer finishes the row
                in_buf = True
            else:  # the winner over all of C starts the chain
                best_s, best, _ = _drain(buf_l, buf_i, 0, n_keep, m, min_p, key, best_s, best, CAP)
        floor = tl.full([], float("-inf"), tl.float32)
        if in_buf & (n_keep <= SMALL):
            token = _finish(buf_l, buf_i, n_keep, floor, use_k, top_k, use_p, top_p, z, use_k & use_p, drawn, m, min_p,
                            key, best_s, best, SMALL)
        elif in_buf:
            token = _finish(buf_l, buf_i, n_keep, floor, use_k, top_k, use_p, top_p, z, use_k & use_p, drawn, m, min_p,
                            key, best_s, best, CAP)
        elif ((use_k == 0) & (use_p == 0)) | (best == _NONE):  # min-p alone: C is its kept set
            token = tl.where(best < _NONE, best, 0)
        else:  # the chain: top-p's in the rounds, then (as top-k's) serially from the candidate
            state = best
    return token, state, bound


# Per-row parameters are slices of one upload, and the state rows lie n_rows apart: their alignment
# follows the batch size, which must not pick a variant (see sampling.py's _NO_SPECIALIZE).
@triton.jit(do_not_specialize=["temp_ptr", "top_k_ptr", "top_p_ptr", "min_p_ptr", "seeds_ptr", "offsets_ptr", "m_ptr",
                               "beta_ptr", "hi_ptr"])
def _collect_kernel(logits_ptr, logits_stride, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seeds_ptr, offsets_ptr,
                    cand_ptr, m_ptr, beta_ptr, hi_ptr, part_f_ptr, part_i_ptr, buf_l_ptr, buf_i_ptr, vocab, chunk,
                    splits, BLOCK: tl.constexpr, REGION: tl.constexpr, CAP: tl.constexpr):
    """One chunk of a row the bounds launch left to this read (_COLLECT): its part of C into its
    region of the row's buffer, and its results (_collect_end_kernel ends the row)."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    if tl.load(cand_ptr + row) == _COLLECT:
        _, _, inv_t, _, _, min_p, use_k, use_p = _row_params(temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, row, vocab)
        m = tl.load(m_ptr + row)
        beta = tl.load(beta_ptr + row)
        key = _row_key(tl.load(seeds_ptr + row).to(tl.int64), tl.load(offsets_ptr + row).to(tl.int64))
        start = split * chunk
        buf_l = buf_l_ptr + row * CAP
        buf_i = buf_i_ptr + row * CAP
        # With top-k and top-p, Z is the top-k set's mass: min-p may not thin the set.
        n, n_keep, cut, drawn, best_s, best = _chunk_scan(
            logits_ptr + row * logits_stride, buf_l + split * REGION, buf_i + split * REGION, start,
            tl.minimum(start + chunk, vocab), inv_t, m, key, beta, (beta == float("-inf")).to(tl.int32),
            tl.load(hi_ptr + row), tl.where(use_k & use_p, 0.0, min_p), min_p, BLOCK, REGION)
        part_f = part_f_ptr + row * splits * 3
        part_i = part_i_ptr + row * splits * 3
        tl.store(part_f + split * 3, cut)
        tl.store(part_f + split * 3 + 1, drawn)
        tl.store(part_f + split * 3 + 2, best_s)
        tl.store(part_i + split * 3, n)
        tl.store(part_i + split * 3 + 1, n_keep)
        tl.store(part_i + split * 3 + 2, best)


@triton.jit(do_not_specialize=["temp_ptr", "top_k_ptr", "top_p_ptr", "min_p_ptr", "seeds_ptr", "offsets_ptr",
                               "m_ptr", "z_ptr", "bound_ptr", "beta_ptr", "lo_p_ptr", "tail_ptr", "n_u", "rounds"])
def _collect_end_kernel(temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seeds_ptr, offsets_ptr, out_ptr, reads_ptr, cand_ptr,
                        m_ptr, z_ptr, bound_ptr, beta_ptr, lo_p_ptr, tail_ptr, part_f_ptr, part_i_ptr, part_u_ptr,
                        buf_l_ptr, buf_i_ptr, vocab, splits, n_u, rounds, REGION: tl.constexpr, CAP: tl.constexpr,
                        BLOCK_S: tl.constexpr, BLOCK_U: tl.constexpr, SMALL: tl.constexpr,
                        COUNT_READS: tl.constexpr):
    """One program per row after the chunked read: its chunks' results and regions merged, the row
    ended as the row program would after its scan (_collect_end). A launch of its own, so that the
    read's programs keep few registers (and many of them fit an SM)."""
    row = tl.program_id(0).to(tl.int64)
    if tl.load(cand_ptr + row) == _COLLECT:
        _, _, _, top_k, top_p, min_p, use_k, use_p = _row_params(temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, row, vocab)
        m = tl.load(m_ptr + row)
        z = tl.load(z_ptr + row)
        key = _row_key(tl.load(seeds_ptr + row).to(tl.int64), tl.load(offsets_ptr + row).to(tl.int64))
        buf_l = buf_l_ptr + row * CAP
        buf_i = buf_i_ptr + row * CAP
        n, mass, n_keep, cut, drawn, best_s, best = _merge(buf_l, buf_i, part_f_ptr + row * splits * 3,
                                                           part_i_ptr + row * splits * 3, splits, m, min_p, key,
                                                           BLOCK_S, REGION, CAP)
        token, state, bound = _collect_end(
            buf_l, buf_i, part_u_ptr + row * n_u, n_u, vocab, top_k, top_p, min_p, use_k, use_p, key, m, z,
            tl.load(beta_ptr + row), tl.load(lo_p_ptr + row), tl.load(tail_ptr + row), n, mass, n_keep, cut, drawn,
            best_s, best, rounds, BLOCK_U, CAP, SMALL)
        if state == _DONE:
            tl.store(out_ptr + row, token.to(tl.int64))
        tl.store(bound_ptr + row, bound)
        tl.store(cand_ptr + row, state)
        if COUNT_READS:
            tl.store(reads_ptr + row, 2)
