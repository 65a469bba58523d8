"""Top-p's chain of Gumbel winners in chunked rounds (see sampling.py's kernel section).

A winner w of the draw over a set that holds the kept set S is kept iff less than p * Z of the mass
lies strictly above l_w; else S lies above l_w, and the next winner is drawn there. The row program
(one per row) follows this chain serially, one full read of the row per link, at one program's
~9 GB/s: with top-p sets of thousands of tokens most rows need such links (212 of 256 in the broad
mode, 621 µs at B = 256 on an H100, 2026-11-25). For rows with top-p and no top-k, the row program
now stops where the chain starts and leaves its first candidate; then each round reads every
pending row split over CHAIN_SPLITS programs (_chain_round_kernel: mass and Gumbel winner above
the candidate, per chunk), and the row's last chunk to finish keeps the candidate or moves to the
next one (_chain_step). A round keeps a pending candidate with probability >= p (the mass of S over
that of the set it was drawn from), so after CHAIN_ROUNDS rounds hardly any row is left; those finish serially
(_chain_finish_kernel, the row program's own chain). Top-k rows keep the serial chain: their links
are kept with probability mass(top-k set) / mass(set), which can be small, and the buffer ends them.
The launches are fixed in number and shape (CUDA graphs); rows without a candidate return at once.

Chain rows (top-p or min-p, without top-k, when rounds run: _chain_row) skip the second read and
the row program altogether. Pass 1 also draws each chunk's Gumbel winner over all of its tokens
(_first_winner); the bounds launch takes the row's winner w as the chain's first candidate
(_chain_start), or as the draw where min-p alone filters the row and w passes it, or as a bound (its
l) to draw above where w lies below min-p. The first round (FIRST) only weighs the mass above a
candidate, drawing nothing (no noise: half of a draw's arithmetic) since p or more of the candidates
are kept there; a rejected one leaves its l as a bound that the next round draws above. Without
top-p, the winner above a bound is the draw. (B = 256, H100, bf16: the broad mode's row program
alone took 186 µs; this way the whole draw takes 194. Z summed in the first round rather than in
pass 1 made pass 1 20 µs faster and the rounds 25 slower: that round then takes an exp for every
token, where above a candidate most tiles hold none.)
A row whose first scan showed pass 1's estimate above the threshold waits with a sure bound instead
of a candidate (-2): its first round draws the winner above that bound, which a row program would
have read alone, serially.

Timed on an H100 (B = 256, 2026-11-27, bench/sampling_variants.py): the broad mode's 668 µs became
467 at 3 rounds; every other mode pays 12-14 µs for the rounds' launches when no row is pending.
"""

from __future__ import annotations

import triton
import triton.language as tl

from services.worker.kernels.sampling_grid import _lane_update
from services.worker.kernels.sampling_scan import _NONE, _better, _finish, _gumbel, _row_key, _scan

CHAIN_ROUNDS = 5  # chain rows start here: a round keeps each candidate with probability >= p
CHAIN_SPLITS = 16  # programs per row in a round (at most): a lone pending row is read 16 ways


def chain_splits(vocab: int, block: int) -> tuple[int, int]:
    """(chunk, splits) of a round: whole tiles per program, by the vocabulary alone (no batch-size
    variants to compile)."""
    blocks = triton.cdiv(vocab, block)
    per = triton.cdiv(blocks, min(blocks, CHAIN_SPLITS))
    return per * block, triton.cdiv(blocks, per)


@triton.jit
def _chain_row(use_k, use_p, min_p, chain_first):
    """Whether a filtered row is a chain row: top-p or min-p without top-k, when the rounds run."""
    return (use_p | (min_p > 0.0)) & (use_k == 0) & (chain_first != 0)


@triton.jit
def _first_tile(x, idx, end, inv_t, key, lane_max, lane_z, best, best_idx):
    """One tile of a chain row's pass 1: the lanes' max and sum of exp(l - max) (_lane_update), and
    their Gumbel winners over every token (ties: the lane's first)."""
    ok = idx < end
    l = tl.where(ok, x.to(tl.float32) * inv_t, float("-inf"))
    score = tl.where(ok, l + _gumbel(key, idx), float("-inf"))
    better = score > best
    lane_max, _, _, _, lane_z = _lane_update(l, lane_max, lane_max, lane_max, lane_max, lane_z, False)
    return lane_max, lane_z, tl.where(better, score, best), tl.where(better, idx, best_idx)


@triton.jit
def _first_winner(base, start, end, inv_t, key, BLOCK_V: tl.constexpr):
    """A chain row's chunk [start, end) in pass 1: (max l, sum of exp(l - max), the Gumbel winner's
    score and index, ties to the lowest index). Two tiles a step, both read before either is used."""
    cols = tl.arange(0, BLOCK_V)
    lane_max = tl.full([BLOCK_V], float("-inf"), tl.float32)
    lane_z = tl.zeros([BLOCK_V], tl.float32)
    best = tl.full([BLOCK_V], float("-inf"), tl.float32)
    best_idx = start + cols
    for v0 in range(start, end, 2 * BLOCK_V):
        idx = v0 + cols
        x = tl.load(base + idx, mask=idx < end, other=float("-inf"))
        x2 = tl.load(base + idx + BLOCK_V, mask=idx + BLOCK_V < end, other=float("-inf"))
        lane_max, lane_z, best, best_idx = _first_tile(x, idx, end, inv_t, key, lane_max, lane_z, best, best_idx)
        lane_max, lane_z, best, best_idx = _first_tile(x2, idx + BLOCK_V, end, inv_t, key, lane_max, lane_z, best,
                                                       best_idx)
    m = tl.max(lane_max, axis=0)
    z = tl.sum(tl.where(lane_max > float("-inf"), lane_z * tl.exp(lane_max - m), 0.0), axis=0)
    s_max = tl.max(best, axis=0)
    return m, z, s_max, tl.min(tl.where(best == s_max, best_idx, _NONE), axis=0)


@triton.jit
def _chain_start(part_score, part_z_ptr, part_draw_ptr, part_idx_ptr, num_splits, BLOCK_S: tl.constexpr):
    """A chain row's pass-1 results reduced (part_score: its chunks' maxima, loaded; the others at their
    row's start): m, Z and the row's Gumbel winner (_NONE if every l is -inf)."""
    s = tl.arange(0, BLOCK_S)
    ok = s < num_splits
    m = tl.max(part_score, axis=0)
    part_z = tl.load(part_z_ptr + s, mask=ok, other=0.0)
    z = tl.sum(tl.where(part_score > float("-inf"), part_z * tl.exp(part_score - m), 0.0), axis=0)
    draw = tl.load(part_draw_ptr + s, mask=ok, other=float("-inf"))
    best_s = tl.max(draw, axis=0)
    best = tl.min(tl.where(ok & (draw == best_s), tl.load(part_idx_ptr + s, mask=ok, other=_NONE), _NONE), axis=0)
    return m, z, tl.where(best_s > float("-inf"), best, _NONE)


@triton.jit
def _chain(base, buf_l, buf_i, vocab, inv_t, top_k, top_p, min_p, use_p, key, m, z, cand, accepted, in_buf, n,
           n_keep, drawn, best_s, best, floor, k_sel, z_from_buf, reads, BLOCK_V: tl.constexpr, SMALL: tl.constexpr):
    """The chain from the state a scan left (candidate, accepted, buffer), serially: each scan reads
    the row above the rejected winner, until a winner is kept or the set above it fits the buffer,
    which finishes the row. Returns (token, reads)."""
    while (accepted == 0) & (in_buf == 0) & (best < _NONE):
        cand = best
        l_c = tl.load(base + cand).to(tl.float32) * inv_t
        n, mass, n_keep, cut, drawn, best_s, best = _scan(
            base, buf_l, buf_i, vocab, inv_t, m, key, l_c, tl.full([], 1, tl.int32), float("inf"), 0.0, min_p,
            BLOCK_V)
        reads += 1
        in_buf = cut == float("inf")
        accepted = (((k_sel == 0) | (n < top_k)) & ((use_p == 0) | (mass < top_p * z))).to(tl.int32)
    token = tl.zeros([], tl.int32)  # nothing kept (min_p > 1): index 0, as argmax over -inf
    if accepted != 0:
        token = tl.where(cand < _NONE, cand, 0)
    elif in_buf & (n_keep <= SMALL):
        token = _finish(buf_l, buf_i, n_keep, floor, k_sel, top_k, use_p, top_p, z, z_from_buf, drawn, m, min_p,
                        key, best_s, best, SMALL)
    elif in_buf:
        token = _finish(buf_l, buf_i, n_keep, floor, k_sel, top_k, use_p, top_p, z, z_from_buf, drawn, m, min_p,
                        key, best_s, best, BLOCK_V)
    return token, reads


@triton.jit
def _chain_step(row, top_p_ptr, cand_ptr, z_ptr, bound_ptr, out_ptr, reads_ptr, part_mass_ptr, part_score_ptr,
                part_idx_ptr, splits, cand, cand_ok, l_c, drew, BLOCK_S: tl.constexpr, COUNT_READS: tl.constexpr):
    """A pending row after its round: its candidate is kept (the draw), or the winner above it is
    the next candidate; with none there, nothing is kept (index 0, as the serial chain). A round
    that did not draw (drew 0: FIRST) leaves a rejected candidate's l as the bound to draw above;
    without top-p, a winner above a bound is the draw. The
    chunks' results are read through L2 (.cg): other programs wrote them this round, and an L1 line
    of an earlier round's read may still be here."""
    s = tl.arange(0, BLOCK_S)
    ok = s < splits
    at = row * splits + s
    mass = tl.sum(tl.load(part_mass_ptr + at, mask=ok, other=0.0, cache_modifier=".cg"), axis=0)
    score = tl.load(part_score_ptr + at, mask=ok, other=float("-inf"), cache_modifier=".cg")
    idx = tl.load(part_idx_ptr + at, mask=ok, other=_NONE, cache_modifier=".cg")
    best_s = tl.max(score, axis=0)
    best = tl.min(tl.where(score == best_s, idx, _NONE), axis=0)
    z = tl.load(z_ptr + row)
    top_p = tl.load(top_p_ptr + row).to(tl.float32)
    # A row waiting at a sure bound (cand -2) has no candidate to keep: the winner above it is its first;
    # nor has one whose candidate (a chain row's first) lies below min-p.
    kept = (cand >= 0) & cand_ok & ((top_p >= 1.0) | (mass < top_p * z))
    if kept:
        tl.store(out_ptr + row, cand.to(tl.int64))
        tl.store(cand_ptr + row, -1)
    elif drew == 0:
        tl.store(bound_ptr + row, l_c)
        tl.store(cand_ptr + row, -2)
    elif (top_p >= 1.0) & (best < _NONE):  # min-p alone: the winner above the bound is the draw
        tl.store(out_ptr + row, best.to(tl.int64))
        tl.store(cand_ptr + row, -1)
    elif best == _NONE:
        tl.store(out_ptr + row, tl.zeros([], tl.int64))
        tl.store(cand_ptr + row, -1)
    else:
        tl.store(cand_ptr + row, best)
    if COUNT_READS:
        tl.store(reads_ptr + row, tl.load(reads_ptr + row) + 1)


@triton.jit
def _round_tile(l, idx, end, l_c, m, min_p, key, mass, best_s, best_i, draw):
    """One tile of a round: the mass above the candidate, and (draw) the Gumbel winner there."""
    above = (idx < end) & (l > l_c)
    if tl.max(above.to(tl.int32), axis=0) > 0:  # most tiles hold none above a late candidate: no exp, no noise
        e = tl.exp(l - m)
        mass += tl.sum(tl.where(above, e, 0.0), axis=0)
        if draw:
            best_s, best_i = _better(l, idx, above & (e >= min_p), key, best_s, best_i)
    return mass, best_s, best_i


# Per-row parameters are slices of one upload and arrived_ptr lies n_rows past cand_ptr: their
# alignment follows the batch size, which must not pick a variant (see sampling.py's _NO_SPECIALIZE).
@triton.jit(do_not_specialize=["temp_ptr", "top_k_ptr", "top_p_ptr", "min_p_ptr", "seeds_ptr", "offsets_ptr",
                               "arrived_ptr"])
def _chain_round_kernel(logits_ptr, logits_stride, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seeds_ptr, offsets_ptr,
                        cand_ptr,
                        arrived_ptr, m_ptr, z_ptr, bound_ptr, out_ptr, reads_ptr, part_mass_ptr, part_score_ptr,
                        part_idx_ptr, vocab, chunk, splits, BLOCK: tl.constexpr, BLOCK_S: tl.constexpr,
                        COUNT_READS: tl.constexpr, FIRST: tl.constexpr):
    """One chunk of a pending row: the mass of the tokens strictly above the candidate's l, and the
    Gumbel winner among those at or above min-p (as the serial scan finds them; FIRST: only for rows
    with no candidate to keep, see the top). No count: a pending row has no top-k. The row's last
    chunk to finish (arrived_ptr counts them; the bounds launch set it to 0) takes the row's step, so
    a round is one launch. (A few programs per SM walking the
    pairs instead cost twice as much a round: each waits for its rows' candidates one by one.)"""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    cand = tl.load(cand_ptr + row)
    top_k = tl.load(top_k_ptr + row)
    # A candidate, or (-2) a sure bound to read above; top-k's candidates wait for the serial finish.
    if ((cand >= 0) & ((top_k <= 0) | (top_k >= vocab))) | (cand == -2):
        temp = tl.load(temp_ptr + row).to(tl.float32)
        inv_t = tl.div_rn(1.0, tl.where(temp <= 0.0, 1.0, temp))
        min_p = tl.load(min_p_ptr + row).to(tl.float32)
        m = tl.load(m_ptr + row)
        key = _row_key(tl.load(seeds_ptr + row).to(tl.int64), tl.load(offsets_ptr + row).to(tl.int64))
        base = logits_ptr + row * logits_stride
        cand_ok = cand >= 0
        if cand >= 0:
            l_c = tl.load(base + cand).to(tl.float32) * inv_t
            cand_ok = tl.exp(l_c - m) >= min_p  # a chain row's first winner may lie below min-p
        else:
            l_c = tl.load(bound_ptr + row)
        drew = (FIRST == 0) | (cand_ok == 0)
        cols = tl.arange(0, BLOCK)
        mass = tl.zeros([], tl.float32)
        best_s = tl.full([], float("-inf"), tl.float32)
        best_i = tl.full([], _NONE, tl.int32)
        start = split * chunk
        end = tl.minimum(start + chunk, vocab)
        for v0 in range(start, end, 2 * BLOCK):  # two tiles in flight (a bf16 tile is half an fp32 one)
            idx = v0 + cols
            x = tl.load(base + idx, mask=idx < end, other=float("-inf"))
            x2 = tl.load(base + idx + BLOCK, mask=idx + BLOCK < end, other=float("-inf"))
            mass, best_s, best_i = _round_tile(x.to(tl.float32) * inv_t, idx, end, l_c, m, min_p, key, mass, best_s,
                                               best_i, drew)
            mass, best_s, best_i = _round_tile(x2.to(tl.float32) * inv_t, idx + BLOCK, end, l_c, m, min_p, key, mass,
                                               best_s, best_i, drew)
        at = row * splits + split
        tl.store(part_mass_ptr + at, mass)
        tl.store(part_score_ptr + at, best_s)
        tl.store(part_idx_ptr + at, best_i)
        # Release: this chunk's results before its arrival; acquire: the others' before the step.
        if tl.atomic_add(arrived_ptr + row, 1, sem="acq_rel", scope="gpu") == splits - 1:
            tl.store(arrived_ptr + row, 0)
            _chain_step(row, top_p_ptr, cand_ptr, z_ptr, bound_ptr, out_ptr, reads_ptr, part_mass_ptr, part_score_ptr,
                        part_idx_ptr, splits, cand, cand_ok, l_c, drew, BLOCK_S, COUNT_READS)


@triton.jit(do_not_specialize=["temp_ptr", "top_k_ptr", "top_p_ptr", "min_p_ptr", "seeds_ptr", "offsets_ptr"])
def _chain_finish_kernel(logits_ptr, logits_stride, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seeds_ptr, offsets_ptr,
                         cand_ptr, m_ptr, z_ptr, out_ptr, reads_ptr, buf_l_ptr, buf_i_ptr, vocab,
                         BLOCK_V: tl.constexpr, SMALL: tl.constexpr, COUNT_READS: tl.constexpr):
    """Rows still pending after the rounds (rare), and top-k's chains: the serial chain from their
    candidate."""
    row = tl.program_id(0).to(tl.int64)
    cand = tl.load(cand_ptr + row)
    if cand >= 0:
        temp = tl.load(temp_ptr + row).to(tl.float32)
        inv_t = tl.div_rn(1.0, tl.where(temp <= 0.0, 1.0, temp))
        key = _row_key(tl.load(seeds_ptr + row).to(tl.int64), tl.load(offsets_ptr + row).to(tl.int64))
        reads = tl.zeros([], tl.int32)
        if COUNT_READS:
            reads = tl.load(reads_ptr + row)
        zero = tl.zeros([], tl.int32)
        no = zero != 0  # the serial chain's flags are booleans
        neg_inf = tl.full([], float("-inf"), tl.float32)
        top_k = tl.load(top_k_ptr + row).to(tl.int32)
        top_p = tl.load(top_p_ptr + row).to(tl.float32)
        # No row here has both: with top-k and top-p the second read ends in its buffer, or serially.
        use_k = (top_k > 0) & (top_k < vocab)
        token, reads = _chain(logits_ptr + row * logits_stride, buf_l_ptr + row * BLOCK_V, buf_i_ptr + row * BLOCK_V,
                              vocab, inv_t, top_k, top_p, tl.load(min_p_ptr + row).to(tl.float32), top_p < 1.0, key,
                              tl.load(m_ptr + row), tl.load(z_ptr + row), cand, zero, no, zero, zero,
                              tl.zeros([], tl.float32), neg_inf, cand, neg_inf, use_k, no, reads, BLOCK_V, SMALL)
        tl.store(out_ptr + row, token.to(tl.int64))
        tl.store(cand_ptr + row, -1)
        if COUNT_READS:
            tl.store(reads_ptr + row, reads)
