"""What each read of a pivot-based exact sampler would cost at B = 256, V = 128,256, bf16 (H100 probe).

    python3 bench/pivot_probe.py

A sampler that never estimates: pass 1 gives each row's max m and Z; a pivot pass gives the exact mass
(and count) above P thresholds of l, so top-p's threshold lies in a known bracket; a collect pass
appends every token at or above the bracket's floor to the row's buffer (one atomic slot counter per
row); one program per row then finishes from the buffer. This times stand-ins of those reads as
CUDA-graph µs with a cold L2, per launch shape, on the broad mode's logits (top-p sets of thousands).
"""

from __future__ import annotations

import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from bench.gpu_kernels import graph_us, sampling_inputs  # noqa: E402
from services.worker.kernels.sampling_scan import _row_key, _uniform  # noqa: E402

V = 128256
B = 256


@triton.jit
def _chunk(x_ptr, stride, vocab, chunk, BLOCK: tl.constexpr):
    """This program's row and vocabulary chunk: (row, split, start, end, lanes, the row's base)."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    start = split * chunk
    return row, split, start, tl.minimum(start + chunk, vocab), tl.arange(0, BLOCK), x_ptr + row * stride


@triton.jit
def _tile(base, v0, cols, end, inv_t):
    """One tile's token ids and l = logits / T (-inf past the chunk)."""
    idx = v0 + cols
    return idx, tl.load(base + idx, mask=idx < end, other=float("-inf")).to(tl.float32) * inv_t


@triton.jit
def _stats(x_ptr, stride, m_part, z_part, inv_t, vocab, chunk, S, BLOCK: tl.constexpr):
    row, split, start, end, cols, base = _chunk(x_ptr, stride, vocab, chunk, BLOCK)
    lane_max = tl.full([BLOCK], float("-inf"), tl.float32)
    lane_z = tl.zeros([BLOCK], tl.float32)
    for v0 in range(start, end, BLOCK):
        _, l = _tile(base, v0, cols, end, inv_t)
        new = tl.maximum(lane_max, l)
        safe = tl.where(new > float("-inf"), new, 0.0)
        lane_z = lane_z * tl.exp(lane_max - safe) + tl.exp(l - safe)
        lane_max = new
    m = tl.max(lane_max, axis=0)
    z = tl.sum(tl.where(lane_max > float("-inf"), lane_z * tl.exp(lane_max - m), 0.0), axis=0)
    tl.store(m_part + row * S + split, m)
    tl.store(z_part + row * S + split, z)


@triton.jit
def _pivot(x_ptr, stride, m_ptr, lo_ptr, step_ptr, out_ptr, cnt_ptr, inv_t, vocab, chunk, S,
           P: tl.constexpr, BLOCK: tl.constexpr, COUNT: tl.constexpr, BINS: tl.constexpr):
    """The mass (and count) above P pivots lo + j * step: each token compared with every pivot, or
    (BINS) its one integer bin compared with every pivot's index."""
    row, split, start, end, cols, base = _chunk(x_ptr, stride, vocab, chunk, BLOCK)
    m = tl.load(m_ptr + row)
    lo = tl.load(lo_ptr + row)
    step = tl.load(step_ptr + row)
    jj = tl.arange(0, P)
    q = lo + jj.to(tl.float32) * step
    acc = tl.zeros([BLOCK, P], tl.float32)
    cnt = tl.zeros([BLOCK, P], tl.int32)
    for v0 in range(start, end, BLOCK):
        _, l = _tile(base, v0, cols, end, inv_t)
        e = tl.exp(l - m)
        if BINS:
            b = tl.minimum(tl.maximum(tl.floor((l - lo) * (1.0 / step)), -1.0), P).to(tl.int32)
            ge = b[:, None] >= jj[None, :]
        else:
            ge = l[:, None] >= q[None, :]
        acc += tl.where(ge, e[:, None], 0.0)
        if COUNT:
            cnt += ge.to(tl.int32)
    tl.store(out_ptr + (row * S + split) * P + jj, tl.sum(acc, axis=0))
    if COUNT:
        tl.store(cnt_ptr + (row * S + split) * P + jj, tl.sum(cnt, axis=0))


@triton.jit
def _collect(x_ptr, stride, a_ptr, n_ptr, buf_l, buf_i, inv_t, vocab, chunk, CAP, BLOCK: tl.constexpr):
    row, _, start, end, cols, base = _chunk(x_ptr, stride, vocab, chunk, BLOCK)
    a = tl.load(a_ptr + row)
    for v0 in range(start, end, BLOCK):
        idx, l = _tile(base, v0, cols, end, inv_t)
        keep = l >= a
        if tl.max(l, axis=0) >= a:
            k = keep.to(tl.int32)
            slot = tl.atomic_add(n_ptr + row, tl.sum(k, axis=0)) + tl.cumsum(k, axis=0) - 1
            ok = keep & (slot < CAP)
            tl.store(buf_l + row * CAP + slot, l, mask=ok)
            tl.store(buf_i + row * CAP + slot, idx, mask=ok)


@triton.jit
def _draw(x_ptr, stride, a_ptr, seeds_ptr, out_s, out_i, inv_t, vocab, chunk, S, BLOCK: tl.constexpr,
          GATED: tl.constexpr):
    row, split, start, end, cols, base = _chunk(x_ptr, stride, vocab, chunk, BLOCK)
    a = tl.load(a_ptr + row)
    key = _row_key(tl.load(seeds_ptr + row).to(tl.int64), row)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = cols
    for v0 in range(start, end, BLOCK):
        idx, l = _tile(base, v0, cols, end, inv_t)
        if GATED:
            if tl.max(l, axis=0) >= a:
                s = tl.where(l >= a, l - tl.log(-tl.log(_uniform(key, idx))), float("-inf"))
                better = s > best
                best = tl.where(better, s, best)
                best_i = tl.where(better, idx, best_i)
        else:
            s = l - tl.log(-tl.log(_uniform(key, idx)))
            better = s > best
            best = tl.where(better, s, best)
            best_i = tl.where(better, idx, best_i)
    bm = tl.max(best, axis=0)
    tl.store(out_s + row * S + split, bm)
    tl.store(out_i + row * S + split, tl.min(tl.where(best == bm, best_i, vocab), axis=0))


@triton.jit
def _finish(buf_l, buf_i, n_ptr, seeds_ptr, out_ptr, q0_ptr, CAP, ROUNDS: tl.constexpr, P: tl.constexpr,
            BLOCK: tl.constexpr):
    """One program a row over its buffer: ROUNDS pivot sweeps (the in-buffer refinement), then the draw."""
    row = tl.program_id(0).to(tl.int64)
    n = tl.minimum(tl.load(n_ptr + row), CAP)
    cols = tl.arange(0, BLOCK)
    q = tl.load(q0_ptr + row) + tl.arange(0, P).to(tl.float32) * 0.01
    tot = tl.zeros([P], tl.float32)
    for _ in range(ROUNDS):
        acc = tl.zeros([BLOCK, P], tl.float32)
        for s in range(0, n, BLOCK):
            i = s + cols
            l = tl.load(buf_l + row * CAP + i, mask=i < n, other=float("-inf"))
            acc += tl.where(l[:, None] >= q[None, :], tl.exp(l)[:, None], 0.0)
        tot += tl.sum(acc, axis=0)
        q = q + 0.001 * tl.max(tot, axis=0)
    key = _row_key(tl.load(seeds_ptr + row).to(tl.int64), row)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = cols
    for s in range(0, n, BLOCK):
        i = s + cols
        l = tl.load(buf_l + row * CAP + i, mask=i < n, other=float("-inf"))
        t = tl.load(buf_i + row * CAP + i, mask=i < n, other=0)
        sc = tl.where(l >= tl.min(q, axis=0), l - tl.log(-tl.log(_uniform(key, t))), float("-inf"))
        better = sc > best
        best = tl.where(better, sc, best)
        best_i = tl.where(better, t, best_i)
    bm = tl.max(best, axis=0)
    tl.store(out_ptr + row, tl.min(tl.where(best == bm, best_i, 2**30), axis=0))


def main() -> None:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    logits = sampling_inputs(B, "topp0.9-broad", dev, torch.bfloat16)[0]
    inv_t = 1.0 / 0.8
    l = logits.float() * inv_t
    m_true = l.max(-1).values
    z_true = torch.exp(l - m_true[:, None]).sum(-1)
    lo_sure = m_true + torch.log(0.1 * z_true / V)
    s, _ = l.sort(-1, descending=True)
    mass = torch.exp(s - m_true[:, None]).cumsum(-1)
    t_p = s.gather(1, (mass < 0.9 * z_true[:, None]).sum(-1, keepdim=True)).squeeze(1)
    rows = []

    def row(name, fn, extra=""):
        us = graph_us(fn)
        rows.append((name, us, extra))
        print(f"{name:44s} {us:8.1f} µs {extra}", flush=True)

    for S in (4, 8, 16):
        chunk = triton.cdiv(triton.cdiv(V, S), 2048) * 2048
        S_eff = triton.cdiv(V, chunk)
        mp = torch.empty(B, S_eff, device=dev)
        zp = torch.empty(B, S_eff, device=dev)
        for BLOCK, warps in ((1024, 4), (2048, 8), (2048, 4)):
            row(f"stats S={S_eff} BLOCK={BLOCK} w={warps}",
                lambda: _stats[(B, S_eff)](logits, logits.stride(0), mp, zp, inv_t, V, chunk, S_eff, BLOCK=BLOCK,
                                           num_warps=warps))
        for P in (4, 8, 16):
            step = ((m_true - lo_sure) / P).contiguous()
            out = torch.empty(B, S_eff, P, device=dev)
            cnt = torch.empty(B, S_eff, P, device=dev, dtype=torch.int32)
            for BLOCK, warps in ((1024, 4), (512, 4)):
                for count in (False, True):
                    for bins, kn in ((False, "cmp"), (True, "bins")):
                        row(f"pivot-{kn} S={S_eff} P={P} BLOCK={BLOCK} count={int(count)}",
                            lambda: _pivot[(B, S_eff)](logits, logits.stride(0), m_true, lo_sure, step, out, cnt, inv_t,
                                                       V, chunk, S_eff, P=P, BLOCK=BLOCK, COUNT=count, BINS=bins,
                                                       num_warps=warps))
        for gap, label in ((0.2, "a=T-0.2"), (-1.0, "a=T+1")):
            a = (t_p - gap).contiguous()
            n_true = int((l >= a[:, None]).sum(-1).float().mean())
            cap = 16384
            buf_l = torch.empty(B, cap, device=dev)
            buf_i = torch.empty(B, cap, device=dev, dtype=torch.int32)
            n = torch.zeros(B, device=dev, dtype=torch.int32)
            for BLOCK, warps in ((1024, 4), (2048, 8)):
                def go():
                    n.zero_()
                    _collect[(B, S_eff)](logits, logits.stride(0), a, n, buf_l, buf_i, inv_t, V, chunk, cap,
                                         BLOCK=BLOCK, num_warps=warps)
                row(f"collect S={S_eff} BLOCK={BLOCK} {label}", go, f"mean n {n_true}")
            if S == 8:
                seeds = torch.randint(0, 2**62, (B,), device=dev)
                os_ = torch.empty(B, S_eff, device=dev)
                oi = torch.empty(B, S_eff, device=dev, dtype=torch.int32)
                for gated in (False, True):
                    row(f"draw S={S_eff} gated={int(gated)} {label}",
                        lambda: _draw[(B, S_eff)](logits, logits.stride(0), a, seeds, os_, oi, inv_t, V, chunk, S_eff,
                                                  BLOCK=1024, GATED=gated, num_warps=4))
                go()
                out = torch.empty(B, device=dev, dtype=torch.int64)
                for rounds in (0, 3):
                    for BLOCK, warps in ((1024, 4), (2048, 8)):
                        row(f"finish rounds={rounds} P=16 BLOCK={BLOCK} {label}",
                            lambda: _finish[(B,)](buf_l, buf_i, n, seeds, out, a, cap, ROUNDS=rounds, P=16,
                                                  BLOCK=BLOCK, num_warps=warps), f"mean n {n_true}")
    bytes_ = logits.numel() * 2
    print(f"\none read of the logits: {bytes_ / 1e6:.1f} MB = {bytes_ / 3.0e12 * 1e6:.1f} µs at 3.0 TB/s")
    print(f"mean top-p set {float((l >= t_p[:, None]).sum(-1).float().mean()):.0f} tokens; "
          f"mean m - lo_sure {float((m_true - lo_sure).mean()):.2f}, m - T {float((m_true - t_p).mean()):.2f}")
    print("\nsummary (best per kind):")
    best = {}
    for name, us, extra in rows:
        kind = name.split()[0]
        if us is not None and (kind not in best or us < best[kind][1]):
            best[kind] = (name, us, extra)
    for kind, (name, us, extra) in best.items():
        print(f"  {name:44s} {us:8.1f} µs {extra}")


if __name__ == "__main__":
    main()
