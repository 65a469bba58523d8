"""What an exact sampler built on a histogram of bf16 logit values would cost at B = 256 (H100 probe).

    python3 bench/hist_probe.py

bf16 logits take few distinct values near a row's max: 128 per binade. A histogram of counts over the
NB values just below each chunk's max (tl.histogram) gives, once the chunks are merged, the exact count
and mass at every value of the row's top, so top-k, top-p and min-p thresholds are found from it without
another read, and one more read draws the Gumbel winner over the kept tokens. This times stand-ins of
the reads (CUDA-graph µs, cold L2) on the broad mode's logits and checks the draws against sample_ref.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from bench.gpu_kernels import graph_us, sampling_inputs  # noqa: E402
from bench.pivot_probe import _chunk  # noqa: E402  (a program's row and vocabulary chunk)
from services.worker.kernels.sampling_ref import sample_ref  # noqa: E402
from services.worker.kernels.sampling_scan import _row_key, _uniform  # noqa: E402

V = 128256
B = 256


@triton.jit
def _key16(x_bf16):
    """bf16 -> int32 whose order is the float order (the 16 bits, sign-folded)."""
    k = x_bf16.to(tl.int16, bitcast=True).to(tl.int32)
    return k ^ ((k >> 15) & 0x7FFF)


@triton.jit
def _val16(key):
    k = key ^ ((key >> 15) & 0x7FFF)
    return k.to(tl.int16).to(tl.bfloat16, bitcast=True).to(tl.float32)


@triton.jit
def _stats_hist(x_ptr, stride, temp_ptr, kc_ptr, m_ptr, z_ptr, am_ptr, hist_ptr, vocab, chunk, S,
                NB: tl.constexpr, BLOCK: tl.constexpr, HIST: tl.constexpr, HBLOCK: tl.constexpr):
    row, split, start, end, cols, base = _chunk(x_ptr, stride, vocab, chunk, BLOCK)
    inv_t = 1.0 / tl.load(temp_ptr + row)
    kmax = tl.full([BLOCK], -65536, tl.int32)
    kidx = cols
    lane_m = tl.full([BLOCK], float("-inf"), tl.float32)
    lane_z = tl.zeros([BLOCK], tl.float32)
    for v0 in range(start, end, BLOCK):
        idx = v0 + cols
        x = tl.load(base + idx, mask=idx < end, other=float("-inf"))
        k = _key16(x)
        up = k > kmax
        kidx = tl.where(up, idx, kidx)
        kmax = tl.where(up, k, kmax)
        l = x.to(tl.float32) * inv_t
        new = tl.maximum(lane_m, l)
        safe = tl.where(new > float("-inf"), new, 0.0)
        lane_z = lane_z * tl.exp(lane_m - safe) + tl.exp(l - safe)
        lane_m = new
    kc = tl.max(kmax, axis=0)
    m = tl.max(lane_m, axis=0)
    z = tl.sum(tl.where(lane_m > float("-inf"), lane_z * tl.exp(lane_m - m), 0.0), axis=0)
    o = row * S + split
    tl.store(kc_ptr + o, kc)
    tl.store(m_ptr + o, m)
    tl.store(z_ptr + o, z)
    tl.store(am_ptr + o, tl.min(tl.where(kmax == kc, kidx, vocab), axis=0))
    if HIST:
        acc = tl.zeros([NB], tl.int32)
        hcols = tl.arange(0, HBLOCK)  # a histogram call's cost follows its bins: few calls, large tiles
        for v0 in range(start, end, HBLOCK):
            idx = v0 + hcols
            x = tl.load(base + idx, mask=idx < end, other=float("-inf"))
            b = tl.minimum(kc - _key16(x), NB - 1)  # the last bin takes everything further down
            acc += tl.histogram(b, NB)
        tl.store(hist_ptr + o * NB + tl.arange(0, NB), acc)


@triton.jit
def _finish(temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, kc_ptr, m_ptr, z_ptr, hist_ptr, t_ptr, flag_ptr, S, vocab,
            NB: tl.constexpr, SB: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    inv_t = 1.0 / tl.load(temp_ptr + row)
    top_k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    min_p = tl.load(min_p_ptr + row)
    s = tl.arange(0, SB)
    kcs = tl.load(kc_ptr + row * S + s, mask=s < S, other=-65536)
    K = tl.max(kcs, axis=0)
    ms = tl.load(m_ptr + row * S + s, mask=s < S, other=float("-inf"))
    zs = tl.load(z_ptr + row * S + s, mask=s < S, other=0.0)
    j = tl.arange(0, NB)
    m = _val16(K) * inv_t
    Z = tl.sum(tl.where(ms > float("-inf"), zs * tl.exp(ms - m), 0.0), axis=0)
    count = tl.zeros([NB], tl.int32)
    for c in range(0, S):
        kc = tl.load(kc_ptr + row * S + c)
        src = j - (K - kc)
        count += tl.load(hist_ptr + (row * S + c) * NB + src, mask=(src >= 0) & (src < NB - 1) & (j < NB - 1), other=0)
    e = tl.exp(_val16(K - j) * inv_t - m)
    mass = count.to(tl.float32) * e
    cum_n = tl.cumsum(count, axis=0)
    cum_m = tl.cumsum(mass, axis=0)
    use_k = (top_k > 0) & (top_k < vocab)
    jk = tl.min(tl.where(cum_n >= top_k, j, NB), axis=0)
    zk = tl.where(use_k, tl.sum(tl.where(j == jk, cum_m, 0.0), axis=0), Z)
    jp = tl.min(tl.where(cum_m >= top_p * zk, j, NB), axis=0)
    jm = tl.max(tl.where((e >= min_p) & (count > 0), j, -1), axis=0)
    tj = NB - 1
    flag = 0
    tj = tl.where(use_k, tl.minimum(tj, jk), tj)
    flag = tl.where(use_k & (jk >= NB - 1), 1, flag)
    tj = tl.where(top_p < 1.0, tl.minimum(tj, jp), tj)
    flag = tl.where((top_p < 1.0) & (jp >= NB - 1), 1, flag)
    tj = tl.where(min_p > 0.0, tl.minimum(tj, jm), tj)
    tl.store(t_ptr + row, K - tj)
    tl.store(flag_ptr + row, flag)


@triton.jit
def _draw(x_ptr, stride, temp_ptr, t_ptr, seeds_ptr, offs_ptr, out_s, out_i, vocab, chunk, S,
          BLOCK: tl.constexpr, FAST: tl.constexpr):
    row, split, start, end, cols, base = _chunk(x_ptr, stride, vocab, chunk, BLOCK)
    inv_t = 1.0 / tl.load(temp_ptr + row)
    t = tl.load(t_ptr + row)
    key = _row_key(tl.load(seeds_ptr + row), tl.load(offs_ptr + row))
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = cols
    for v0 in range(start, end, BLOCK):
        idx = v0 + cols
        x = tl.load(base + idx, mask=idx < end, other=float("-inf"))
        k = _key16(x)
        if tl.max(k, axis=0) >= t:
            u = _uniform(key, idx)
            if FAST:
                g = -tl.extra.cuda.libdevice.fast_logf(-tl.extra.cuda.libdevice.fast_logf(u))
            else:
                g = -tl.log(-tl.log(u))
            sc = tl.where(k >= t, x.to(tl.float32) * inv_t + g, float("-inf"))
            better = sc > best
            best = tl.where(better, sc, best)
            best_i = tl.where(better, idx, best_i)
    bm = tl.max(best, axis=0)
    tl.store(out_s + row * S + split, bm)
    tl.store(out_i + row * S + split, tl.min(tl.where(best == bm, best_i, vocab), axis=0))


@triton.jit
def _merge(out_s, out_i, out_ptr, S, SB: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, SB)
    sc = tl.load(out_s + row * S + s, mask=s < S, other=float("-inf"))
    ix = tl.load(out_i + row * S + s, mask=s < S, other=2**30)
    bm = tl.max(sc, axis=0)
    tl.store(out_ptr + row, tl.min(tl.where(sc == bm, ix, 2**30), axis=0).to(tl.int64))


def main() -> None:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    modes = ("topp0.9-broad", "topp0.9", "topk50-topp0.9", "topp0.95-minp0.05", "topk1")
    S = 8
    chunk = triton.cdiv(triton.cdiv(V, S), 8192) * 8192
    S_eff = triton.cdiv(V, chunk)
    # (bins, values per histogram call, warps)
    shapes = ((1024, 1024, 4), (256, 4096, 8), (512, 4096, 8), (256, 8192, 8), (512, 8192, 16), (1024, 8192, 16))
    for mode in modes:
        logits, temp, top_k, top_p, min_p, seeds, offs = sampling_inputs(B, mode, dev, torch.bfloat16)
        want = sample_ref(logits, temp, top_k, top_p, min_p, seeds, offs)
        kc = torch.empty(B, S_eff, device=dev, dtype=torch.int32)
        mp = torch.empty(B, S_eff, device=dev)
        zp = torch.empty(B, S_eff, device=dev)
        am = torch.empty(B, S_eff, device=dev, dtype=torch.int32)
        t = torch.empty(B, device=dev, dtype=torch.int32)
        flag = torch.empty(B, device=dev, dtype=torch.int32)
        os_ = torch.empty(B, S_eff, device=dev)
        oi = torch.empty(B, S_eff, device=dev, dtype=torch.int32)
        out = torch.empty(B, device=dev, dtype=torch.int64)
        for NB, HB, warps in shapes:
            hist = torch.empty(B, S_eff, NB, device=dev, dtype=torch.int32)
            res = {}
            for hist_on in (False, True):
                res[f"stats{'+hist' if hist_on else ''}"] = graph_us(
                    lambda h=hist_on: _stats_hist[(B, S_eff)](logits, logits.stride(0), temp, kc, mp, zp, am, hist,
                                                              V, chunk, S_eff, NB=NB, BLOCK=1024, HIST=h, HBLOCK=HB,
                                                              num_warps=warps))
            res["finish"] = graph_us(lambda: _finish[(B,)](temp, top_k, top_p, min_p, kc, mp, zp, hist, t, flag,
                                                           S_eff, V, NB=NB, SB=16, num_warps=8))
            res["draw-fast"] = graph_us(lambda: _draw[(B, S_eff)](logits, logits.stride(0), temp, t, seeds, offs, os_,
                                                                   oi, V, chunk, S_eff, BLOCK=1024, FAST=True,
                                                                   num_warps=4))
            res["merge"] = graph_us(lambda: _merge[(B,)](os_, oi, out, S_eff, SB=16))
            _draw[(B, S_eff)](logits, logits.stride(0), temp, t, seeds, offs, os_, oi, V, chunk, S_eff,
                              BLOCK=1024, FAST=True, num_warps=4)
            _merge[(B,)](os_, oi, out, S_eff, SB=16)
            ok = flag == 0
            res["diff"] = int((out[ok] != want[ok]).sum())
            res["fallback"] = int(flag.sum())
            total = res["stats+hist"] + res["finish"] + res["draw-fast"] + res["merge"]
            print(f"{mode:18s} S={S_eff} NB={NB} per-call={HB} warps={warps} " + " ".join(
                f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in res.items())
                  + f" total={total:.1f}", flush=True)


if __name__ == "__main__":
    main()
