"""Batched, per-request-seeded sampling (greedy, temperature, top-k, top-p, min-p): kernels and reference.

Semantics, shared exactly by the sort-based reference and the kernels (which never sort: see the
kernel section), with inv_t = 1 / T and l = logits * inv_t in fp32, m = max l, e = exp(l - m):
- temperature <= 0: argmax of the raw logits, ties to the lowest index.
- top-k (0 < k < V): keep l >= t_k, t_k = the k-th largest l (every token tied with it is kept).
- top-p (p < 1): within the top-k set K, with Z = sum_K e, keep l >= s_p where s_p is the largest
  l with sum_{i in K, l_i >= s_p} e_i >= p * Z: the smallest prefix of K by descending logit
  (= descending probability) whose mass reaches p, extended to every token tied with its last.
- min-p (> 0): keep e >= min_p (p_i >= min_p * p_max; renormalising does not change the ratio).
- the draw: argmax over kept tokens of l + Gumbel noise -log(-log(u)), u from a counter-based hash
  of (seed, offset, token index): a request's draw at output position `offset` never depends on
  the rest of the batch. The kernels' noise uses the GPU's approximate logs (sampling_scan._gumbel),
  within ~2e-6 of the reference's; every kernel computes it the same way, bit for bit.
The two can disagree only where a threshold's mass lands within fp32 rounding of p * Z (the kernels
sum e in fp32, in their own order, and weigh the mass above candidate tokens as well as above
thresholds), or exp differs in its last bits at a min-p boundary, and even then only if the
boundary token wins the draw; or where two tokens' scores lie within the noise's ~2e-6.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer, smid

from services.worker.kernels._common import FLOAT_DTYPES, INDEX_DTYPES, check, check_shape, check_tensor
# The reference (torch) lives beside the kernels; its names stay importable from here.
from services.worker.kernels.sampling_ref import gumbel_noise_ref, sample_ref, uniform_noise_ref  # noqa: F401
# The second read's buffer, scans and finish, and the noise and order keys, live beside this file.
from services.worker.kernels.sampling_chain import (CHAIN_ROUNDS, _chain, _chain_finish_kernel,  # noqa: F401
                                                    _chain_round_kernel, _chain_row, _first_winner, chain_splits)
from services.worker.kernels.sampling_scan import (_NEG_INF_KEY, _NONE, _drain, _float_key, _gumbel, _key_float,
                                                   _load_u, _row_count_select, _row_key, _row_params, _scan,
                                                   _tile_select, _uniform)
# The second read split over chunks of the row, and the row states between the launches.
from services.worker.kernels.sampling_collect import (_COLLECT, _SERIAL, COLLECT_SPLITS, _bounds_kernel,  # noqa: F401
                                                      _collect_end_kernel, _collect_kernel)
from services.worker.kernels.sampling_collect import collect_splits as _collect_splits
# Pass 1's grid of the lanes' largest values, and a row's pass-1 results reduced to its bounds.
from services.worker.kernels.sampling_grid import (_GRID_BINS, _c_bound, _chunk_grid, _lane_stats, _needs_grid,
                                                   _row_start)

# --- the kernel ----------------------------------------------------------------------------
#
# Pass 1 reads each row once, cut into vocabulary chunks (one program each): rows without filters
# draw there; filtered rows gather m, Z and the maxima of interleaved lane groups (u), and rows whose
# kept set can outgrow u (_needs_grid) a histogram of each lane's four largest values on a fixed grid
# of l (bins 1/8 wide): a sample of the row's top that holds its kept set unless the set is several
# times larger than the lanes are many. Every filter keeps an upper set {l >= T} and the draw is a
# Gumbel argmax, so T is never needed over the whole row:
# - pass 2 ("scan") reads the row for the set C of tokens at or above a lower bound lo of T (top-k:
#   where the sample or u holds k tokens; top-p: see below; min-p: its own test) and keeps C in a
#   one-tile buffer, where the exact thresholds and the draw cost no more reads;
# - top-p's set can be larger than the buffer. The grid weighs the sample (u exactly, the others at
#   their bins' middles) and [lo, hi) is a band of about 5/8 of a buffer of samples, mostly above the
#   bin where they reach p * Z. lo is then an estimate, not a bound: a C holding less than p of the
#   mass is read again from a sure bound (where u holds p of the mass, or m + log((1 - p) Z / V)), by
#   the chunked rounds when they run (sampling_chain.py);
# - when C outgrows the buffer, its tokens at or above hi are only drawn: the buffer keeps the band,
#   the scan the drawn tokens' Gumbel winner and mass M. If M < p * Z, T lies in the band, so every
#   drawn token is kept and the buffer finishes the row; min-p alone keeps all of C (hi = -inf);
# - else C yields its Gumbel winner w. w is kept iff fewer than k tokens and less than p * Z of the
#   mass lie strictly above l_w, and then w is the draw (the argmax over a subset holding w); else
#   every kept token lies above l_w, and the next scan, which counts and weighs that set, also yields
#   its winner. Each rejection shrinks the set; once it fits, the buffer finishes the row;
# - with top-k and top-p, Z is the top-k set's mass, so that whole set must be in the buffer (or t_k
#   known): when the bound leaves it too large, a select over the row finds t_k first.

# Nothing that follows the batch size may pick a kernel variant: a step would compile it (seconds)
# the first time a batch of that size samples. So the launches specialise on neither the chunk
# count nor the per-row parameters' pointers (slices of one upload: their alignment follows B), and
# the second kernel's block shapes follow only the vocabulary (launch_constants). Pass 1 keeps one
# variant per power of two of the chunk count (its lane groups), few and small: warm_up compiles them.
_NO_SPECIALIZE = ["temp_ptr", "top_k_ptr", "top_p_ptr", "min_p_ptr", "seeds_ptr", "offsets_ptr", "num_splits", "n_u",
                  "chain_first"]


@triton.jit
def _noise_kernel(seeds_ptr, offsets_ptr, out_ptr, vocab, out_stride, BLOCK_V: tl.constexpr, GUMBEL: tl.constexpr):
    """The draws' noise, materialised: u (_uniform), or the Gumbel noise made from it (_gumbel)."""
    row = tl.program_id(0).to(tl.int64)
    idx = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    key = _row_key(tl.load(seeds_ptr + row).to(tl.int64), tl.load(offsets_ptr + row).to(tl.int64))
    if GUMBEL:
        tl.store(out_ptr + row * out_stride + idx, _gumbel(key, idx), mask=idx < vocab)
    else:
        tl.store(out_ptr + row * out_stride + idx, _uniform(key, idx), mask=idx < vocab)


@triton.jit
def _draw_tile(x, idx, valid, greedy, inv_t, key, best, best_idx):
    """One tile of the simple rows' pass: raw x for greedy rows, x * inv_t + Gumbel otherwise."""
    if greedy:
        score = tl.where(valid, x, float("-inf"))
    else:
        score = tl.where(valid, x * inv_t + _gumbel(key, idx), float("-inf"))
    better = score > best
    return tl.where(better, score, best), tl.where(better, idx, best_idx)


@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _stats_kernel(
    logits_ptr, logits_stride, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seeds_ptr, offsets_ptr,
    part_score_ptr, part_idx_ptr, part_z_ptr, part_u_ptr, part_grid_ptr, part_draw_ptr, vocab, chunk, num_splits, n_u,
    chain_first, NL: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Pass 1 over one vocabulary chunk of one row. Rows without filters: the chunk's best draw
    (score, index). Chain rows (sampling_chain.py): the chunk's max l, its sum of exp(l - max) and its
    Gumbel winner (score, index). Other filtered rows: the chunk's max l, its sum of exp(l - max), NL
    maxima of lane groups, group j being lanes j, j + NL, ... (interleaved: neighbouring token ids,
    often alike, fall in different groups), and the lanes' four largest values on the grid
    (_chunk_grid)."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    greedy, simple, inv_t, top_k, _, _, use_k, use_p = _row_params(temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, row,
                                                                   vocab)
    base = logits_ptr + row * logits_stride
    cols = tl.arange(0, BLOCK_V)
    start = split * chunk
    end = tl.minimum(start + chunk, vocab)
    part = row * num_splits + split
    if simple:
        key = _row_key(tl.load(seeds_ptr + row).to(tl.int64), tl.load(offsets_ptr + row).to(tl.int64))
        best = tl.full([BLOCK_V], float("-inf"), tl.float32)
        best_idx = start + cols
        for v0 in range(start, end, 2 * BLOCK_V):  # two tiles a step: see _lane_stats
            idx = v0 + cols
            x = tl.load(base + idx, mask=idx < end, other=float("-inf")).to(tl.float32)
            x2 = tl.load(base + idx + BLOCK_V, mask=idx + BLOCK_V < end, other=float("-inf")).to(tl.float32)
            best, best_idx = _draw_tile(x, idx, idx < end, greedy, inv_t, key, best, best_idx)
            best, best_idx = _draw_tile(x2, idx + BLOCK_V, idx + BLOCK_V < end, greedy, inv_t, key, best, best_idx)
        s_max = tl.max(best, axis=0)
        tl.store(part_score_ptr + part, s_max)
        tl.store(part_idx_ptr + part, tl.min(tl.where(best == s_max, best_idx, vocab), axis=0))
    elif _chain_row(use_k, use_p, tl.load(min_p_ptr + row), chain_first):
        key = _row_key(tl.load(seeds_ptr + row).to(tl.int64), tl.load(offsets_ptr + row).to(tl.int64))
        m, z, s_max, s_idx = _first_winner(base, start, end, inv_t, key, BLOCK_V)
        tl.store(part_score_ptr + part, m)
        tl.store(part_z_ptr + part, z)
        tl.store(part_draw_ptr + part, s_max)
        tl.store(part_idx_ptr + part, s_idx)
    else:
        grid = _needs_grid(top_k, use_k, use_p, n_u)
        if grid:  # the grid's samples: four values a lane
            lane_max, lane_2nd, lane_3rd, lane_4th, lane_z = _lane_stats(base, start, end, inv_t, True, BLOCK_V)
        else:
            lane_max, lane_2nd, lane_3rd, lane_4th, lane_z = _lane_stats(base, start, end, inv_t, False, BLOCK_V)
        m = tl.max(lane_max, axis=0)
        lane_z = tl.where(lane_max > float("-inf"), lane_z * tl.exp(lane_max - m), 0.0)
        tl.store(part_score_ptr + part, m)
        tl.store(part_z_ptr + part, tl.sum(lane_z, axis=0))
        group_max = tl.max(tl.reshape(lane_max, [BLOCK_V // NL, NL]), axis=0)
        tl.store(part_u_ptr + part * NL + tl.arange(0, NL), group_max)
        if grid & (m > float("-inf")):  # the row's grid skips a chunk all at -inf
            _chunk_grid(lane_max, lane_2nd, lane_3rd, lane_4th, group_max, m, part_grid_ptr + part * _GRID_BINS)


@triton.jit
def _filtered_draw(base, buf_l, buf_i, vocab, inv_t, top_k, top_p, min_p, use_k, use_p, key, m, z, u_ptr, n_u,
                   lo_k, lo_p, hi_p, BLOCK_U: tl.constexpr, BLOCK_V: tl.constexpr, SMALL: tl.constexpr,
                   SCAN_ONLY: tl.constexpr, DEFER: tl.constexpr):
    """A row with filters, given pass 1's m, Z, group maxima u (at u_ptr, read only where needed: held
    through a scan they would take registers it needs) and the grid's bounds. Returns (token, reads
    of the row, the chain's first candidate when DEFER left top-p's chain to the chunked rounds, -2 when
    it left them the read from a sure bound, else -1; and that bound, as the float below it)."""
    m_key = _float_key(m).to(tl.int64)
    no_key = tl.full([], _NEG_INF_KEY, tl.int64)
    beta, hi, tail = _c_bound(vocab, top_k, top_p, use_k, use_p, m, z, u_ptr, n_u, lo_k, lo_p, hi_p, BLOCK_U)
    # With top-k and top-p, Z is the top-k set's mass: the buffer must hold all of that set, so
    # min-p may not thin it. Tokens at -inf are never drawn: a bound at -inf leaves them out.
    z_from_buf = use_k & use_p
    k_sel = use_k
    floor = tl.full([], float("-inf"), tl.float32)
    n, mass, n_keep, cut, drawn, best_s, best = _scan(
        base, buf_l, buf_i, vocab, inv_t, m, key, beta, (beta == float("-inf")).to(tl.int32), hi,
        tl.where(z_from_buf, 0.0, min_p), min_p, BLOCK_V)
    reads = tl.full([], 2, tl.int32)
    if SCAN_ONLY:  # probes: the cost of the first scan alone (bench/sampling_probe.py at aeec1a8); wrong draws
        return tl.where(best < _NONE, best, 0), reads, tl.full([], -1, tl.int32), tl.full([], float("-inf"), tl.float32)
    # The grid's lo_p is an estimate: if C holds less than p of the mass, and min-p leaves tokens below
    # it, T may lie below: read again from a sure bound (where u holds p of the mass, or the tail's).
    # With the chunked rounds, that read is theirs: the row waits there with the bound instead of a
    # candidate (pending -2), and a round's winner at or above the bound starts the chain (one
    # program's serial read of the row costs ~150 us; a round split over 16, ~10).
    bound_pending = tl.zeros([], tl.int32)
    bound = tl.full([], float("-inf"), tl.float32)
    if use_p & (use_k == 0) & (lo_p > tail) & (mass < top_p * z) & (tl.exp(beta - m) >= min_p):
        u = _load_u(u_ptr, n_u, BLOCK_U)
        beta = tl.maximum(_key_float(_tile_select(u, tl.exp(u - m), top_p * z, no_key, m_key)), tail)
        if DEFER:
            bound_pending = tl.full([], 1, tl.int32)
            bound = _key_float(_float_key(beta).to(tl.int64) - 1)  # the float below: l > bound iff l >= beta
        else:
            n, mass, n_keep, cut, drawn, best_s, best = _scan(
                base, buf_l, buf_i, vocab, inv_t, m, key, beta, (beta == float("-inf")).to(tl.int32), hi, min_p,
                min_p, BLOCK_V)
            reads += 1
    if z_from_buf & (cut < float("inf")):
        lo, cnt, steps = _row_count_select(base, vocab, inv_t, _float_key(beta).to(tl.int64), m_key, top_k, n,
                                           BLOCK_V)
        exact = cnt > BLOCK_V  # lo is t_k; else the top-k set fits in the buffer
        beta = _key_float(lo)
        n, mass, n_keep, cut, drawn, best_s, best = _scan(
            base, buf_l, buf_i, vocab, inv_t, m, key, beta, (beta == float("-inf")).to(tl.int32), float("inf"),
            0.0, min_p, BLOCK_V)
        floor = tl.where(exact, beta, floor)
        z = tl.where(exact, mass, z)  # the top-k set's mass
        k_sel = k_sel & (exact == 0)
        z_from_buf = z_from_buf & (exact == 0)
        reads += steps + 1
    in_buf = (cut == float("inf")) & (bound_pending == 0)
    # C split at hi (top-p alone, or with min-p)
    if (cut > float("-inf")) & (cut < float("inf")) & (bound_pending == 0):
        if drawn < top_p * z:  # T is below hi: every drawn token is kept, the buffer finishes the row
            in_buf = True
        else:  # the winner over all of C starts the chain
            best_s, best, _ = _drain(buf_l, buf_i, 0, n_keep, m, min_p, key, best_s, best, BLOCK_V)
    # The chain of Gumbel winners (see the top of this section); each scan strictly raises the bound.
    cand = tl.full([], _NONE, tl.int32)
    accepted = ((in_buf == 0) & (use_k == 0) & (use_p == 0)).to(tl.int32)  # min-p alone: C is exact
    if accepted != 0:
        cand = best
    pending = tl.full([], -1, tl.int32)
    token = tl.zeros([], tl.int32)
    if bound_pending != 0:
        pending = tl.full([], -2, tl.int32)
    elif DEFER & (use_k == 0) & (accepted == 0) & (in_buf == 0) & (best < _NONE):
        pending = best  # top-p's chain goes on in chunked rounds (_chain_round_kernel), not here
    else:
        token, reads = _chain(base, buf_l, buf_i, vocab, inv_t, top_k, top_p, min_p, use_p, key, m, z, cand, accepted,
                              in_buf, n, n_keep, drawn, best_s, best, floor, k_sel, z_from_buf, reads, BLOCK_V, SMALL)
    return token, reads, pending, bound


@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _sample_kernel(
    logits_ptr, logits_stride, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seeds_ptr, offsets_ptr, out_ptr,
    reads_ptr, times_ptr, part_score_ptr, part_idx_ptr, part_z_ptr, part_u_ptr, part_grid_ptr, buf_l_ptr, buf_i_ptr,
    cand_ptr, m_ptr, z_ptr, bound_ptr, vocab, num_splits, n_u,
    BLOCK_S: tl.constexpr, BLOCK_U: tl.constexpr, GRID_S: tl.constexpr, BLOCK_V: tl.constexpr,
    SMALL: tl.constexpr, SCAN_ONLY: tl.constexpr, COUNT_READS: tl.constexpr, TIMES: tl.constexpr,
    DEFER: tl.constexpr, GATE: tl.constexpr,
):
    """One program per row, after pass 1 and the bounds launch: reduces the chunks' results; the
    filtered rows in state GATE go on, reading the row serially: _COLLECT where no chunked second
    read runs (large batches), else _SERIAL, the rows that read left it (sampling_collect.py)."""
    row = tl.program_id(0).to(tl.int64)
    if TIMES:
        t0 = globaltimer()
    if tl.load(cand_ptr + row) == GATE:  # a filtered row: the bounds launch ended those without filters
        _, _, inv_t, top_k, top_p, min_p, use_k, use_p = _row_params(temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, row,
                                                                     vocab)
        s = tl.arange(0, BLOCK_S)
        part_score = tl.load(part_score_ptr + row * num_splits + s, mask=s < num_splits, other=float("-inf"))
        m, z, lo_k, lo_p, hi_p = _row_start(part_score, part_z_ptr, part_u_ptr, part_grid_ptr, part_score_ptr, row,
                                            num_splits, n_u, top_k, top_p, use_k, use_p, BLOCK_S, BLOCK_U, GRID_S,
                                            BLOCK_V * 5 // 8)
        key = _row_key(tl.load(seeds_ptr + row).to(tl.int64), tl.load(offsets_ptr + row).to(tl.int64))
        token, reads, pending, bound = _filtered_draw(
            logits_ptr + row * logits_stride, buf_l_ptr + row * BLOCK_V, buf_i_ptr + row * BLOCK_V, vocab, inv_t,
            top_k, top_p, min_p, use_k, use_p, key, m, z, part_u_ptr + row * n_u, n_u, lo_k, lo_p, hi_p, BLOCK_U,
            BLOCK_V, SMALL, SCAN_ONLY, DEFER)
        if GATE == _SERIAL:  # the chunked read before (_collect_kernel) found this row needs serial work
            reads += 1
        if DEFER:
            tl.store(m_ptr + row, m)
            tl.store(z_ptr + row, z)
            tl.store(bound_ptr + row, bound)
        tl.store(out_ptr + row, token.to(tl.int64))
        if DEFER:
            tl.store(cand_ptr + row, pending)
            tl.store(cand_ptr + tl.num_programs(0) + row, 0)  # the chunks a round has seen finish (none)
        if COUNT_READS:
            tl.store(reads_ptr + row, reads)
        if TIMES:
            tl.store(times_ptr + row * 3, t0)
            tl.store(times_ptr + row * 3 + 1, globaltimer())
            tl.store(times_ptr + row * 3 + 2, smid().to(tl.int64))


def _check_row_params(name: str, t: torch.Tensor, n_rows: int, dtypes, device) -> None:
    check_tensor(t, name, ndim=1, dtypes=dtypes, device=device, contiguous=True)
    check_shape(t, name, (n_rows,))


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


_GROUP_MAXIMA = 1024  # pass 1's lane-group maxima per row, over all chunks: one tile of pass 2
_GRID_CHUNKS = 16  # chunks' grids the row's program merges per step
_SCAN_ONLY = False  # probes only: filtered rows stop after their first scan (wrong draws)
# The chunked read's register cap at 8 warps: three programs an SM (H200, B = 256, bf16: 1-3 % faster
# than its 128 registers, no spills). Probes try others.
COLLECT_MAXNREG = 80


def _lane_groups(num_splits: int, split_block: int) -> int:
    """Pass 1's lane groups per chunk (its NL): the row's maxima stay near _GROUP_MAXIMA."""
    return min(split_block, max(1, _GROUP_MAXIMA // triton.next_power_of_2(num_splits)))


def _num_splits(vocab: int, n_rows: int, split_block: int, device: torch.device) -> int:
    """Chunks per row asked for: enough programs for four per SM, never a chunk below one block."""
    return min(triton.cdiv(vocab, split_block), max(1, triton.cdiv(4 * _num_sms(device), n_rows)))


def _chunking(vocab: int, num_splits: int, split_block: int) -> tuple[int, int]:
    """(chunk, chunks): num_splits chunks of whole blocks, so fewer where the blocks do not divide."""
    chunk = triton.cdiv(triton.cdiv(vocab, num_splits), split_block) * split_block
    return chunk, triton.cdiv(vocab, chunk)


@functools.lru_cache(maxsize=None)
def launch_constants(vocab: int, block_v: int) -> tuple[int, int, int, int]:
    """The block shapes that follow only the vocabulary (and block_v): pass 1's block, and the row
    program's BLOCK_S (chunks), BLOCK_U (lane-group maxima) and GRID_S (grids merged per step), each
    sized for the most chunks a row can have; masks cover the rest."""
    split_block = min(block_v, 2048)
    max_splits = triton.cdiv(vocab, split_block)
    block_s = triton.next_power_of_2(max_splits)
    # The most maxima a row can have: per power of two of the chunk count, its largest count.
    n_u = [min(p, max_splits) * _lane_groups(p, split_block) for p in (1 << i for i in range(block_s.bit_length()))]
    return split_block, block_s, triton.next_power_of_2(max(n_u)), min(block_s, _GRID_CHUNKS)


def max_splits(vocab: int, block_v: int | None = None) -> int:
    """The most chunks a row can have (one block each): a launch shape that no batch size changes,
    for callers that want one kernel variant whatever the batch (more programs for small batches)."""
    return triton.cdiv(vocab, launch_constants(vocab, _block_v(vocab, block_v))[0])


def warm_row_counts(vocab: int, max_rows: int, device: torch.device, block_v: int | None = None) -> list[int]:
    """Batch sizes, up to max_rows, whose draws compile every kernel variant any batch size launches
    (one per class of pass 1's lane groups, and per way of the second read: _collects), so that none
    compiles while serving. The first and the last take the two ways of the second read."""
    split_block = launch_constants(vocab, _block_v(vocab, block_v))[0]
    rows: dict[tuple[int, bool], int] = {}
    for n in range(1, max_rows + 1):
        chunks = _chunking(vocab, _num_splits(vocab, n, split_block, device), split_block)[1]
        rows.setdefault((_lane_groups(chunks, split_block), _collects(n, device)), n)
    return sorted(rows.values())


def workspace_bytes(n_rows: int, vocab: int, device: torch.device) -> int:
    """Device bytes sample() allocates for n_rows rows besides the logits, every launch taken: what the
    KV sizing reserves for a draw (gpu_memory.py), whose own dry run need not compile the kernels."""
    if n_rows <= 0:
        return 0
    block_v = _block_v(vocab, None)
    split_block = launch_constants(vocab, block_v)[0]
    splits = _chunking(vocab, _num_splits(vocab, n_rows, split_block, device), split_block)[1]
    groups = _lane_groups(splits, split_block)
    c_splits = _collect_splits(vocab, block_v)[1]
    rounds = chain_splits(vocab, min(block_v, 2048))[1]
    per_row = (8  # out
               + 8 * block_v  # buf_l, buf_i
               + splits * (4 * 4 + 4 * groups + 4 * _GRID_BINS.value)  # part_score, _idx, _z, _draw; part_u, part_grid
               + 4 * (3 + 3 + 4)  # cand, row_m / row_z / row_b, c_rows
               + 8 * 3 * c_splits  # the second read's part_f, part_i
               + 4 * 3 * rounds)  # the chain's part_idx, part_mass, part_score
    return n_rows * per_row


def _collects(n_rows: int, device: torch.device) -> bool:
    """Whether the second read of a batch of n_rows is split over chunks of each row (sampling_collect.py)
    rather than one program's per row: now always. The split wins where the row programs leave SMs
    idle (H100, bf16 logits, B = 1: 41 against 98 µs with top-k 50 and top-p 0.9) and, since top-p's
    sets of thousands take the chain rows' way (sampling_chain.py), at B = 256 too: top-k 50 and top-p
    0.9 141 against 184 µs, the mixed mode 172 against 250, top-k 1 132 against 136 (H100,
    2026-11-28); the chain rows' modes pay its empty launches, ~4 µs. (Before the chain rows, sets
    of thousands overflowed the chunks' regions at B = 256: 380 against 312 µs on an H200.) The row
    program's way stays for A/B runs (sample's collect_splits=0) and tests."""
    return True


def _block_v(vocab: int, block_v: int | None) -> int:
    if block_v is None:
        # 2048: the per-row program then fits in 128 registers at 8 warps, two per SM, so a batch
        # of up to 2 * SMs rows is read in one wave.
        block_v = min(2048, triton.next_power_of_2(max(vocab, 16)))
    check(block_v >= 16 and block_v & (block_v - 1) == 0, "block_v must be a power of two >= 16, got {}", block_v)
    return block_v


def sample(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
    min_p: torch.Tensor, seeds: torch.Tensor, offsets: torch.Tensor, *,
    block_v: int | None = None, num_splits: int | None = None, reads: torch.Tensor | None = None,
    times: torch.Tensor | None = None, chain_rounds: int = CHAIN_ROUNDS, chain_block: int | None = None,
    collect_splits: int | None = None, second_read: bool = True,
) -> torch.Tensor:
    """Same contract as sample_ref: no host sync, allocations sized by shapes, graph-capturable.

    The launches: pass 1 by num_splits programs per row (a vocabulary chunk each), which draws rows
    without filters (greedy, or plain temperature); one program per row that reduces the chunks'
    results and bounds the filtered rows' candidate sets (_bounds_kernel); the second read, split
    over chunks of each row (sampling_collect.py), and its end, one program per row; the row program
    for the rows left to a serial read (see the kernel section's comment); then top-p's chain, in
    chain_rounds chunked rounds (sampling_chain.py), and its serial finish.
    block_v and num_splits override the launch shape (tests use them). reads, an int32 [B] tensor,
    if given receives how many times each row was read in full (benchmarks and tests use it). times, an
    int64 [B, 3] tensor on a GPU, receives each row's start and end (globaltimer ns) and SM in the
    row program (probes). chain_rounds: CHAIN_ROUNDS by default; 0 leaves the chain to its serial
    finish (a caller that knows no row has top-p without top-k saves the rounds' launches so:
    engine/sampler.py). collect_splits: the second read's chunks per row (tests use small buffers
    split too); 0: the row program reads every filtered row alone, as before the split (A/B runs).
    chain_block: the rounds' tile (tests use small ones). second_read=False: the caller knows that no
    row needs the second read (launches_needed), whose launches are then skipped; a row that did
    would get no token."""
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
    if reads is not None:
        _check_row_params("reads", reads, n_rows, (torch.int32,), device)
    if times is not None:
        check_tensor(times, "times", ndim=2, dtypes=(torch.int64,), device=device, contiguous=True)
        check_shape(times, "times", (n_rows, 3))
    out = torch.empty((n_rows,), dtype=torch.int64, device=device)
    if n_rows == 0:
        return out
    block_v = _block_v(vocab, block_v)
    chain_block = min(block_v, 2048) if chain_block is None else chain_block
    check(chain_rounds >= 0, "chain_rounds must not be negative, got {}", chain_rounds)
    split_block, block_s, block_u, grid_s = launch_constants(vocab, block_v)
    if num_splits is None:
        num_splits = _num_splits(vocab, n_rows, split_block, device)
    check(num_splits >= 1, "num_splits must be positive, got {}", num_splits)
    chunk, num_splits = _chunking(vocab, num_splits, split_block)
    n_groups = _lane_groups(num_splits, split_block)
    f32, i32 = dict(dtype=torch.float32, device=device), dict(dtype=torch.int32, device=device)
    part_score = torch.empty((n_rows, num_splits), **f32)
    part_idx = torch.empty((n_rows, num_splits), **i32)
    part_z = torch.empty((n_rows, num_splits), **f32)
    part_u = torch.empty((n_rows, num_splits * n_groups), **f32)
    part_grid = torch.empty((n_rows, num_splits * _GRID_BINS.value), **i32)
    buf_l = torch.empty((n_rows, block_v), **f32)
    buf_i = torch.empty((n_rows, block_v), **i32)
    defer = chain_rounds > 0
    # Chain rows (sampling_chain.py) need a first round that only weighs and one that draws after it.
    chain_first = int(chain_rounds >= 2)
    if collect_splits is None:
        collect_splits = None if _collects(n_rows, device) else 0
    # cand: per row its state (_DONE, _COLLECT, ...; a candidate of top-p's chain), then the rounds'
    # and the second read's arrival counts; m, Z and the sure bound per row (the rounds read them).
    cand = torch.empty((3, n_rows), **i32)
    row_m, row_z, row_b = (torch.empty((n_rows,), **f32) for _ in range(3))
    part_draw = torch.empty((n_rows, num_splits), **f32)
    _stats_kernel[(n_rows, num_splits)](
        logits, logits.stride(0), temperature, top_k, top_p, min_p, seeds, offsets,
        part_score, part_idx, part_z, part_u, part_grid, part_draw, vocab, chunk, num_splits, num_splits * n_groups,
        chain_first, NL=n_groups, BLOCK_V=split_block, num_warps=8 if split_block >= 2048 else 4,
        enable_fp_fusion=False,
    )
    counts = out if reads is None else reads
    # Rows without filters end here, chain rows (sampling_chain.py) wait for the rounds with their first
    # candidate (or end here), the other filtered rows for the second read (_COLLECT).
    c_rows = torch.empty((4, n_rows), **f32)  # C's bound, hi, the grid's lo_p and top-p's tail
    _bounds_kernel[(n_rows,)](
        logits, logits.stride(0), temperature, top_k, top_p, min_p, out, counts, part_score, part_idx, part_z, part_u,
        part_grid, part_draw, cand, cand[1], row_m, row_z, row_b, c_rows[0], c_rows[1], c_rows[2], c_rows[3], vocab,
        num_splits, num_splits * n_groups, chain_first, BLOCK_S=block_s, BLOCK_U=block_u, GRID_S=grid_s, BAND=block_v * 5 // 8,
        COUNT_READS=reads is not None, num_warps=4)
    if second_read:
        _second_read(logits, temperature, top_k, top_p, min_p, seeds, offsets, out, counts, times, part_score,
                      part_idx, part_z, part_u, part_grid, buf_l, buf_i, cand, row_m, row_z, row_b, c_rows, n_groups,
                      num_splits, block_v, collect_splits, chain_rounds, reads is not None)
    # The rounds, then the serial finish, which also ends top-k's chains that the chunked read leaves.
    if defer or (second_read and collect_splits != 0):
        _chain_rounds(logits, temperature, top_k, top_p, min_p, seeds, offsets, cand, row_m, row_z, row_b, out, reads,
                      buf_l, buf_i, block_v, chain_rounds, chain_block)
    return out


def _second_read(logits, temperature, top_k, top_p, min_p, seeds, offsets, out, counts, times, part_score, part_idx,
                 part_z, part_u, part_grid, buf_l, buf_i, cand, row_m, row_z, row_b, c_rows, n_groups, num_splits,
                 block_v, collect_splits, chain_rounds, count_reads):
    """The filtered rows that are not chain rows (_COLLECT): split over chunks of each row, then the row
    program for those that read left it (_SERIAL); or (collect_splits 0) the row program alone."""
    n_rows, vocab = logits.shape
    device = logits.device
    f32, i32 = dict(dtype=torch.float32, device=device), dict(dtype=torch.int32, device=device)
    _, block_s, block_u, grid_s = launch_constants(vocab, block_v)
    row_program = dict(
        BLOCK_S=block_s, BLOCK_U=block_u, GRID_S=grid_s, BLOCK_V=block_v, SMALL=min(block_v, 256),
        SCAN_ONLY=_SCAN_ONLY, COUNT_READS=count_reads, TIMES=times is not None, DEFER=chain_rounds > 0,
        # 128 registers at 8 warps: two programs per SM (ptxas would take ~180 with no need to).
        num_warps=8 if block_v >= 2048 else 4, maxnreg=128 if block_v >= 2048 else None, enable_fp_fusion=False)
    row_args = (logits, logits.stride(0), temperature, top_k, top_p, min_p, seeds, offsets, out, counts,
                out if times is None else times, part_score, part_idx, part_z, part_u, part_grid, buf_l, buf_i, cand,
                row_m, row_z, row_b, vocab, num_splits, num_splits * n_groups)
    if collect_splits == 0:
        _sample_kernel[(n_rows,)](*row_args, GATE=_COLLECT.value, **row_program)
        return
    c_chunk, c_splits, region = _collect_splits(vocab, block_v, collect_splits)
    part_f = torch.empty((n_rows, c_splits * 3), **f32)
    part_i = torch.empty((n_rows, c_splits * 3), **i32)
    _collect_kernel[(n_rows, c_splits)](
        logits, logits.stride(0), temperature, top_k, top_p, min_p, seeds, offsets, cand, row_m, c_rows[0], c_rows[1],
        part_f, part_i, buf_l, buf_i, vocab, c_chunk, c_splits, BLOCK=block_v, REGION=region, CAP=block_v,
        num_warps=8 if block_v >= 2048 else 4, maxnreg=COLLECT_MAXNREG if block_v >= 2048 else None,
        enable_fp_fusion=False)
    _collect_end_kernel[(n_rows,)](
        temperature, top_k, top_p, min_p, seeds, offsets, out, counts, cand, row_m, row_z, row_b, c_rows[0],
        c_rows[2], c_rows[3], part_f, part_i, part_u, buf_l, buf_i, vocab, c_splits, num_splits * n_groups,
        chain_rounds, REGION=region, CAP=block_v, BLOCK_S=triton.next_power_of_2(c_splits), BLOCK_U=block_u,
        SMALL=min(block_v, 256), COUNT_READS=count_reads, num_warps=8 if block_v >= 2048 else 4,
        enable_fp_fusion=False)
    _sample_kernel[(n_rows,)](*row_args, GATE=_SERIAL.value, **row_program)


def _chain_rounds(logits, temperature, top_k, top_p, min_p, seeds, offsets, cand, row_m, row_z, row_b, out, reads,
                  buf_l, buf_i, block_v, rounds, chain_block):
    """Top-p's chain for the rows the row program left pending: `rounds` chunked rounds, then the
    serial chain for any row still pending (sampling_chain.py)."""
    n_rows, vocab = logits.shape
    chunk, splits = chain_splits(vocab, chain_block)
    f32, i32 = dict(dtype=torch.float32, device=logits.device), dict(dtype=torch.int32, device=logits.device)
    part_idx = torch.empty((n_rows, splits), **i32)
    part_mass, part_score = torch.empty((n_rows, splits), **f32), torch.empty((n_rows, splits), **f32)
    counts = reads if reads is not None else out
    for r in range(rounds):
        _chain_round_kernel[(n_rows, splits)](
            logits, logits.stride(0), temperature, top_k, top_p, min_p, seeds, offsets, cand[0], cand[1], row_m, row_z,
            row_b,
            out, counts, part_mass, part_score, part_idx, vocab, chunk, splits, BLOCK=chain_block,
            BLOCK_S=triton.next_power_of_2(splits), COUNT_READS=reads is not None,
            # The first round only weighs (sampling_chain.py) where chain rows exist (two rounds or
            # more: the serial finish takes candidates, not bounds).
            FIRST=r == 0 and rounds >= 2, num_warps=8 if chain_block >= 2048 else 4, enable_fp_fusion=False)
    _chain_finish_kernel[(n_rows,)](
        logits, logits.stride(0), temperature, top_k, top_p, min_p, seeds, offsets, cand[0], row_m, row_z, out,
        counts, buf_l, buf_i, vocab, BLOCK_V=block_v, SMALL=min(block_v, 256), COUNT_READS=reads is not None,
        num_warps=8 if block_v >= 2048 else 4, maxnreg=128 if block_v >= 2048 else None, enable_fp_fusion=False)


def launches_needed(temperature, top_k, top_p, min_p, vocab: int) -> tuple[bool, bool]:
    """Which of sample()'s optional launches a batch needs, by its per-row parameters on the host
    (sequences): (chain, second_read). chain: some row is a chain row (sampled, top-p or min-p, no
    top-k: sampling_chain.py), so sample() needs its chain_rounds; without one, chain_rounds=0 skips
    the rounds' launches (~4 µs each at B = 256 on an H100). second_read: some sampled row has top-k
    (every other filtered row is a chain row when the rounds run); without one, second_read=False
    skips that read's launches (~6 µs)."""
    chain = second = False
    for t, k, p, mp in zip(temperature, top_k, top_p, min_p):
        if t > 0.0:
            if 0 < k < vocab:
                second = True
            elif p < 1.0 or mp > 0.0:
                chain = True
            if chain and second:
                break
    return chain, second


def gumbel_noise(seeds: torch.Tensor, offsets: torch.Tensor, vocab: int) -> torch.Tensor:
    """The Gumbel noise the draws add, materialised (tests): within ~2e-6 of gumbel_noise_ref."""
    return _noise(seeds, offsets, vocab, gumbel=True)


def uniform_noise(seeds: torch.Tensor, offsets: torch.Tensor, vocab: int) -> torch.Tensor:
    """The kernel's noise, materialised (for tests and debugging): equals uniform_noise_ref bit for bit."""
    return _noise(seeds, offsets, vocab, gumbel=False)


def _noise(seeds: torch.Tensor, offsets: torch.Tensor, vocab: int, gumbel: bool) -> torch.Tensor:
    check_tensor(seeds, "seeds", ndim=1, dtypes=(torch.int64,), contiguous=True)
    n_rows = seeds.shape[0]
    _check_row_params("offsets", offsets, n_rows, INDEX_DTYPES, seeds.device)
    out = torch.empty((n_rows, vocab), dtype=torch.float32, device=seeds.device)
    if n_rows == 0 or vocab == 0:
        return out
    block_v = min(1024, triton.next_power_of_2(vocab))
    _noise_kernel[(n_rows, triton.cdiv(vocab, block_v))](seeds, offsets, out, vocab, out.stride(0), BLOCK_V=block_v,
                                                         GUMBEL=gumbel, num_warps=4)
    return out
