"""GPU check and timing of every Triton kernel at Llama-3.1-8B shapes (bf16), against its torch reference.

Usage (on the H100, from the repository root): python3 bench/gpu_kernels.py --out kernels.json
Each case runs the kernel once on fresh random inputs with poisoned outputs (NaN caches and a
NaN-filling torch.empty) and compares it with the reference on the GPU, then times it with
triton.testing.do_bench (median, L2 flushed between runs), inside a CUDA graph where it can be
captured (no launch overhead; also proves the wrapper graph-safe), and on the host (checks +
launch). Achieved bandwidth (GB/s, % of roofline) uses the kernel time: the graph replay's where
there is one, else do_bench's; bytes are what each kernel must move at least once, and the roofline
is HBM at 3.0 TB/s. Exits non-zero if any check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

HBM_BYTES_PER_S = 3.0e12
HIDDEN, N_Q, N_KV, HEAD_DIM, INTER, VOCAB, PAGE = 4096, 32, 8, 128, 14336, 128256, 16
DTYPE = torch.bfloat16
BF16_TOL = 1e-2


@dataclass
class Result:
    kernel: str
    shape: str
    ok: bool
    rel_err: float | None = None
    us: float | None = None
    graph_us: float | None = None
    cpu_us: float | None = None
    bytes: int = 0
    gbps: float | None = None
    roofline_us: float | None = None
    pct_roofline: float | None = None
    note: str = ""
    error: str | None = None
    extra: dict = field(default_factory=dict)


# --- helpers -------------------------------------------------------------------------------

@contextlib.contextmanager
def poisoned_empty():
    """Every torch.empty inside hands out NaN (floats) or int max: unwritten outputs show."""
    real = torch.empty

    def empty(*args, **kwargs):
        t = real(*args, **kwargs)
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype != torch.bool:
            t.fill_(torch.iinfo(t.dtype).max)
        return t

    torch.empty = empty
    try:
        yield
    finally:
        torch.empty = real


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out64, ref64 = out.double(), ref.double()
    denom = ref64.norm().item()
    return (out64 - ref64).norm().item() / (denom if denom > 0 else 1.0)


def time_us(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


def graph_us(fn) -> float | None:
    """do_bench of one CUDA-graph replay of fn: GPU time with a cold L2 and no launch overhead
    (the host's replay call is far shorter than do_bench's L2 flush). None if fn cannot be captured."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return time_us(graph.replay)
    except Exception:  # noqa: BLE001 - reported as "not capturable"; the check is separate
        torch.cuda.synchronize()
        return None


def cpu_us(fn, calls: int = 100) -> float:
    """Host time per call (argument checks + launch), with the GPU kept ahead of nothing."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def finish(res: Result, fn, nbytes: int, tol_ok: bool) -> Result:
    res.ok = tol_ok
    res.bytes = int(nbytes)
    res.us = time_us(fn)
    res.graph_us = graph_us(fn)
    res.cpu_us = cpu_us(fn)
    # The GPU time of the kernels themselves: the graph replay's where there is one (do_bench's
    # figure of a direct call also holds the host's launch time when that exceeds its L2 flush).
    kernel_us = min(res.us, res.graph_us) if res.graph_us is not None else res.us
    res.roofline_us = nbytes / HBM_BYTES_PER_S * 1e6
    res.gbps = nbytes / (kernel_us * 1e-6) / 1e9
    res.pct_roofline = 100.0 * res.roofline_us / kernel_us
    return res


def paged_cache(lens, device, spare=4):
    """bf16 K/V pools with shuffled block ids; every slot no sequence owns is NaN, and unused
    table entries point at a NaN block (a valid id, so a stray read poisons instead of faulting)."""
    need = [-(-n // PAGE) for n in lens]
    n_blocks = sum(need) + spare
    kc = torch.randn(n_blocks, PAGE, N_KV, HEAD_DIM, device=device, dtype=DTYPE)
    vc = torch.randn_like(kc)
    perm = torch.randperm(n_blocks, device=device).to(torch.int32)
    nan_block = int(perm[-1])
    tables = torch.full((len(lens), max(need)), nan_block, dtype=torch.int32, device=device)
    used = torch.zeros(n_blocks, dtype=torch.bool, device=device)
    cursor = 0
    for b, (n, k) in enumerate(zip(lens, need)):
        ids = perm[cursor:cursor + k]
        cursor += k
        tables[b, :k] = ids
        used[ids.long()] = True
        tail = n % PAGE
        if tail:
            kc[int(ids[-1]), tail:] = float("nan")
            vc[int(ids[-1]), tail:] = float("nan")
    kc[~used] = float("nan")
    vc[~used] = float("nan")
    return kc, vc, tables


# --- cases ---------------------------------------------------------------------------------

def case_rmsnorm(t: int, fused: bool, device) -> Result:
    from services.worker.kernels import rmsnorm as K

    name = "add_rmsnorm" if fused else "rmsnorm"
    res = Result(name, f"T={t} H={HIDDEN}", ok=False)
    x = torch.randn(t, HIDDEN, device=device, dtype=DTYPE)
    w = (1 + 0.1 * torch.randn(HIDDEN, device=device)).to(DTYPE)
    eps = 1e-5
    if fused:
        r = torch.randn_like(x)
        with poisoned_empty():
            out, new_r = K.fused_add_rmsnorm(x, r, w, eps)
        ref, ref_r = K.fused_add_rmsnorm_ref(x, r, w, eps)
        res.rel_err = max(rel_err(out, ref), rel_err(new_r, ref_r))
        nbytes = 4 * x.numel() * 2 + HIDDEN * 2
        return finish(res, lambda: K.fused_add_rmsnorm(x, r, w, eps), nbytes, res.rel_err <= BF16_TOL)
    with poisoned_empty():
        out = K.rmsnorm(x, w, eps)
    res.rel_err = rel_err(out, K.rmsnorm_ref(x, w, eps))
    nbytes = 2 * x.numel() * 2 + HIDDEN * 2
    return finish(res, lambda: K.rmsnorm(x, w, eps), nbytes, res.rel_err <= BF16_TOL)


def case_silu_mul(t: int, device) -> Result:
    from services.worker.kernels import silu_mul as K

    res = Result("silu_mul", f"T={t} I={INTER}", ok=False)
    x = torch.randn(t, 2 * INTER, device=device, dtype=DTYPE) * 2
    with poisoned_empty():
        out = K.silu_mul(x)
    res.rel_err = rel_err(out, K.silu_mul_ref(x))
    nbytes = 3 * t * INTER * 2
    return finish(res, lambda: K.silu_mul(x), nbytes, res.rel_err <= BF16_TOL)


def case_linear_fp8(t: int, n: int, k: int, device) -> Result:
    """--quantization fp8: row quantizer + cuBLASLt fp8 GEMM against the reference on the same
    fp8 values; extra: the bf16 GEMM's time on the same shape and both TFLOP/s."""
    import torch.nn.functional as F

    from services.worker.kernels import fp8_linear as K

    res = Result("linear_fp8", f"T={t} N={n} K={k}", ok=False)
    x = torch.randn(t, k, device=device, dtype=DTYPE)
    w = torch.randn(n, k, device=device, dtype=DTYPE) * 0.02
    wq, ws = K.quantize_weight(w)

    def run():
        xq, xs = K.quantize_rows(x)
        return K.linear_fp8(xq, xs, wq, ws, DTYPE)
    out = run()
    xq, xs = K.quantize_rows_ref(x)
    res.rel_err = rel_err(out, K.linear_fp8_ref(xq, xs, wq, ws, DTYPE))
    res.extra["vs_bf16_rel_err"] = rel_err(out, F.linear(x, w))
    nbytes = n * k + t * k * 3 + t * n * 2
    res = finish(res, run, nbytes, res.rel_err <= BF16_TOL and res.extra["vs_bf16_rel_err"] < 0.06)
    bf16_us = graph_us(lambda: F.linear(x, w)) or time_us(lambda: F.linear(x, w))
    flops = 2 * t * n * k
    res.extra.update(bf16_us=bf16_us, fp8_tflops=flops / (res.graph_us or res.us) / 1e6,
                     bf16_tflops=flops / bf16_us / 1e6)
    res.note = f"bf16 {bf16_us:.1f} us; {res.extra['fp8_tflops']:.0f} vs {res.extra['bf16_tflops']:.0f} TFLOP/s"
    return res


def case_gemv_fp8(n: int, k: int, silu: bool, device) -> Result:
    """--quantization fp8 at batch 1: the GEMV streaming e4m3 weights (x unquantized), against the
    reference on the same values; extra: the bf16 GEMV on the same shape."""
    from services.worker.kernels import gemv as K
    from services.worker.kernels.fp8_linear import quantize_weight

    res = Result("gemv_fp8", f"M=1 N={n} K={k}" + (" silu" if silu else ""), ok=False)
    x = torch.randn(1, 2 * k if silu else k, device=device, dtype=DTYPE)
    w = torch.randn(n, k, device=device, dtype=DTYPE) * 0.02
    wq, ws = quantize_weight(w)
    fn, ref = (K.silu_mul_linear, K.silu_mul_linear_ref) if silu else (K.linear, K.linear_ref)
    with poisoned_empty():
        out = fn(x, wq, None, scale=ws)
    res.rel_err = rel_err(out, ref(x, wq, None, ws))
    res = finish(res, lambda: fn(x, wq, None, scale=ws), n * k + n * 4 + x.numel() * 2, res.rel_err <= BF16_TOL)
    bf16_us = graph_us(lambda: fn(x, w))
    res.extra["bf16_us"] = bf16_us
    res.note = f"bf16 GEMV {bf16_us:.1f} us"
    return res


def case_gemv_norm(n: int, k: int, device) -> Result:
    """Batch 1: the residual add and RMS norm fused into the GEMV after them (add_rmsnorm_linear),
    against the reference; extra: the unfused pair (norm kernel, then the GEMV) on the same shape."""
    from services.worker.kernels import gemv as K
    from services.worker.kernels.rmsnorm import fused_add_rmsnorm

    res = Result("gemv_norm", f"M=1 N={n} K={k}", ok=False)
    x, r = (torch.randn(1, k, device=device, dtype=DTYPE) for _ in range(2))
    nw = (1 + 0.1 * torch.randn(k, device=device)).to(DTYPE)
    w = torch.randn(n, k, device=device, dtype=DTYPE) * 0.02
    with poisoned_empty():
        out, new_r = K.add_rmsnorm_linear(x, r, nw, 1e-5, w)
    ref, ref_r = K.add_rmsnorm_linear_ref(x, r, nw, 1e-5, w)
    res.rel_err = max(rel_err(out, ref), rel_err(new_r, ref_r))
    res = finish(res, lambda: K.add_rmsnorm_linear(x, r, nw, 1e-5, w), n * k * 2 + 6 * k,
                 res.rel_err <= BF16_TOL and torch.equal(new_r, ref_r))

    def unfused():
        h, _ = fused_add_rmsnorm(x, r, nw, 1e-5)
        return K.linear(h, w)
    res.extra["unfused_us"] = graph_us(unfused)
    res.note = f"norm + GEMV {res.extra['unfused_us']:.1f} us"
    return res


def case_rope(t: int, device) -> Result:
    from services.worker.kernels import rope as K

    res = Result("rope_kv_write", f"T={t} Hq={N_Q} Hkv={N_KV} D={HEAD_DIM}", ok=False)
    qkv = torch.randn(t, (N_Q + 2 * N_KV) * HEAD_DIM, device=device, dtype=DTYPE)
    q = qkv[:, : N_Q * HEAD_DIM].view(t, N_Q, HEAD_DIM)
    k = qkv[:, N_Q * HEAD_DIM:(N_Q + N_KV) * HEAD_DIM].view(t, N_KV, HEAD_DIM)
    v = qkv[:, (N_Q + N_KV) * HEAD_DIM:].view(t, N_KV, HEAD_DIM)
    cos_sin = K.rope_cos_sin_cache(HEAD_DIM, 8192, 500000.0, device=device)
    positions = torch.randint(0, 8192, (t,), device=device)
    n_blocks = 4 * t // PAGE + 1
    slots = torch.randperm(n_blocks * PAGE, device=device)[:t]
    kc = torch.full((n_blocks, PAGE, N_KV, HEAD_DIM), float("nan"), device=device, dtype=DTYPE)
    vc = torch.full_like(kc, float("nan"))
    kc_ref, vc_ref = kc.clone(), vc.clone()
    with poisoned_empty():
        q_rot, k_rot = K.rope_kv_write(q, k, v, positions, cos_sin, kc, vc, slots)
    q_ref, k_ref = K.rope_kv_write_ref(q, k, v, positions, cos_sin, kc_ref, vc_ref, slots)
    written = torch.zeros(n_blocks * PAGE, dtype=torch.bool, device=device)
    written[slots] = True
    flat_k, flat_v = kc.view(-1, N_KV, HEAD_DIM), vc.view(-1, N_KV, HEAD_DIM)
    untouched_ok = bool(torch.isnan(flat_k[~written]).all()) and bool(torch.isnan(flat_v[~written]).all())
    res.rel_err = max(rel_err(q_rot, q_ref), rel_err(k_rot, k_ref),
                      rel_err(flat_k[written], kc_ref.view(-1, N_KV, HEAD_DIM)[written]),
                      rel_err(flat_v[written], vc_ref.view(-1, N_KV, HEAD_DIM)[written]))
    if not untouched_ok:
        res.note = "slots not targeted were written"
    nbytes = (t * (N_Q + 2 * N_KV) * HEAD_DIM * 2  # q, k, v in
              + t * HEAD_DIM * 4 + 2 * t * 8  # cos/sin rows, positions, slots
              + t * (N_Q + N_KV) * HEAD_DIM * 2  # q_rot, k_rot out
              + 2 * t * N_KV * HEAD_DIM * 2)  # the cache writes
    return finish(res, lambda: K.rope_kv_write(q, k, v, positions, cos_sin, kc, vc, slots), nbytes,
                  untouched_ok and res.rel_err <= BF16_TOL)


def case_decode(batch: int, ctx: int, device, fp8: bool = False) -> Result:
    """fp8: the cache in e4m3 (--kv-cache-dtype fp8), half the bytes; checked against the
    reference on the same fp8 values."""
    from services.worker.kernels import decode_attention as K

    lens = [ctx] * batch
    kc, vc, tables = paged_cache(lens, device)
    if fp8:
        kc, vc = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    q = torch.randn(batch, N_Q, HEAD_DIM, device=device, dtype=DTYPE)
    scale = HEAD_DIM ** -0.5
    splits = K.choose_num_splits(batch, N_KV, ctx)
    res = Result("decode_attention", f"B={batch} ctx={ctx}" + (" fp8 KV" if fp8 else ""), ok=False,
                 note=f"splits={splits}")
    with poisoned_empty():
        out = K.paged_decode_attention(q, kc, vc, tables, seq_lens, scale, max_seq_len=ctx)
    res.rel_err = rel_err(out, K.paged_decode_attention_ref(q, kc, vc, tables, seq_lens, scale))
    nbytes = sum(lens) * N_KV * HEAD_DIM * 2 * kc.element_size() + 2 * q.numel() * 2 + tables.numel() * 4
    return finish(res, lambda: K.paged_decode_attention(q, kc, vc, tables, seq_lens, scale, max_seq_len=ctx),
                  nbytes, res.rel_err <= BF16_TOL)


def case_extend(device) -> Result:
    from services.worker.kernels import extend_attention as K

    q_lens = [256] * 8
    lens = [256] * 7 + [256 + 128]  # the last one extends 128 cached prefix tokens
    kc, vc, tables = paged_cache(lens, device)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device=device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    q = torch.randn(sum(q_lens), N_Q, HEAD_DIM, device=device, dtype=DTYPE)
    scale = HEAD_DIM ** -0.5
    res = Result("extend_attention", "8 seqs x 256 new (1 on a 128 prefix)", ok=False)
    with poisoned_empty():
        out = K.paged_extend_attention(q, kc, vc, tables, qsl, seq_lens, scale, max_query_len=256)
    res.rel_err = rel_err(out, K.paged_extend_attention_ref(q, kc, vc, tables, qsl, seq_lens, scale))
    nbytes = sum(lens) * N_KV * HEAD_DIM * 2 * 2 + 2 * q.numel() * 2
    pairs = sum(n * (c - n) + n * (n + 1) // 2 for n, c in zip(q_lens, lens))
    flops = 4 * N_Q * HEAD_DIM * pairs
    res = finish(res, lambda: K.paged_extend_attention(q, kc, vc, tables, qsl, seq_lens, scale, max_query_len=256),
                 nbytes, res.rel_err <= BF16_TOL)
    res.extra["tflops"] = flops / (res.us * 1e-6) / 1e12
    res.note = f"{res.extra['tflops']:.0f} TFLOP/s (causal)"
    return res


def sampling_inputs(batch: int, mode: str, device, dtype=torch.float32) -> tuple:
    """sample()'s arguments for a named mode: logits of a model-like shape (fp32, or bf16 as the
    engine's LM head gives them: the same values rounded), per-row filters."""
    logits = torch.randn(batch, VOCAB, device=device) * 2.0
    if mode == "topp0.9-wide":  # no dominant tokens: top-p keeps hundreds to thousands
        logits *= 1.5
    else:  # a few likely tokens, as in a real model; lower, they leave top-p sets of thousands
        logits[:, torch.randint(0, VOCAB, (64,), device=device)] += 6.0 if mode == "topp0.9-broad" else 8.0
    temperature = torch.full((batch,), 0.8, device=device)
    top_k = torch.zeros(batch, dtype=torch.int32, device=device)
    top_p = torch.ones(batch, device=device)
    min_p = torch.zeros(batch, device=device)
    if mode == "topk50-topp0.9":
        top_k.fill_(50)
        top_p.fill_(0.9)
    elif mode == "topp0.95-minp0.05":
        top_p.fill_(0.95)
        min_p.fill_(0.05)
    elif mode in ("topp0.9", "topp0.9-wide", "topp0.9-broad"):  # top-p alone: kept sets up to thousands of tokens
        top_p.fill_(0.9)
    elif mode == "topk1":  # one token kept: the second read with (almost) nothing to append
        top_k.fill_(1)
    elif mode == "mixed":
        temperature[0::4] = 0.0
        top_k[1::4] = 40
        top_p[2::4] = 0.9
        min_p[3::4] = 0.1
    seeds = torch.randint(-(2**62), 2**62, (batch,), device=device)
    offsets = torch.randint(0, 4096, (batch,), device=device)
    return logits.to(dtype), temperature, top_k, top_p, min_p, seeds, offsets


def engine_rounds(args) -> dict:
    """sample()'s optional launches as the engine asks for them (sampler.py): the chain's rounds and
    the second read only for batches with rows that need them."""
    from services.worker.kernels import sampling as K

    t, k, p, mp = (x.tolist() for x in args[1:5])
    chain, second_read = K.launches_needed(t, k, p, mp, args[0].shape[1])
    return dict(chain_rounds=K.CHAIN_ROUNDS if chain else 0, second_read=second_read)


def case_sampling(batch: int, mode: str, device, dtype=torch.float32) -> Result:
    from services.worker.kernels import sampling as K

    args = sampling_inputs(batch, mode, device, dtype)
    logits, temperature = args[:2]
    tag = "" if dtype == torch.float32 else " bf16"
    res = Result("sampling", f"B={batch} V={VOCAB} {mode}{tag}", ok=False)
    kw = engine_rounds(args)
    with poisoned_empty():
        got = K.sample(*args, **kw)
    want = K.sample_ref(*args)
    greedy = temperature == 0
    greedy_ok = bool(torch.equal(got[greedy], logits[greedy].argmax(-1)))
    mismatches = int((got != want).sum())
    # Exact but for fp32 rounding at a threshold (sum order, exp's last bit): allow 1% of rows.
    allowed = max(1, batch // 100) if batch > 1 else 0
    res.rel_err = mismatches / batch
    # How many times the kernels read each row in full: the path each row took (1: no filter;
    # 2: the bound from pass 1 fit the buffer, or the band around top-p's threshold did; 3: the first
    # Gumbel winner was checked, or top-p's estimated bound was too high; more: rejections or the
    # top-k select). The time is of calls without this count.
    reads = torch.zeros(batch, dtype=torch.int32, device=device)
    same = bool(torch.equal(K.sample(*args, reads=reads, **kw), got))
    hist = {int(n): int(c) for n, c in zip(*torch.unique(reads, return_counts=True))}
    res.extra["reads_per_row"] = hist
    res.note = f"{mismatches} of {batch} rows differ; rows by reads {hist}"
    nbytes = logits.numel() * logits.element_size() + batch * 8 * 5
    return finish(res, lambda: K.sample(*args, **kw), nbytes, greedy_ok and same and mismatches <= allowed
                  and bool(((got >= 0) & (got < VOCAB)).all()))


def all_cases(device):
    """(kernel name, thunk) pairs, in the order of the table."""
    yield "decode_attention", lambda: case_decode(1, 384, device)
    yield "decode_attention", lambda: case_decode(64, 512, device)
    yield "decode_attention", lambda: case_decode(256, 512, device)
    yield "decode_attention", lambda: case_decode(8, 8192, device)
    yield "decode_attention", lambda: case_decode(256, 512, device, fp8=True)
    yield "decode_attention", lambda: case_decode(1024, 384, device)
    yield "decode_attention", lambda: case_decode(1024, 384, device, fp8=True)
    yield "extend_attention", lambda: case_extend(device)
    for t in (1, 256, 4096):
        yield "rmsnorm", lambda t=t: case_rmsnorm(t, False, device)
        yield "add_rmsnorm", lambda t=t: case_rmsnorm(t, True, device)
    yield "rope_kv_write", lambda: case_rope(256, device)
    yield "silu_mul", lambda: case_silu_mul(256, device)
    for t in (1, 1024, 8192):
        yield "linear_fp8", lambda t=t: case_linear_fp8(t, 2 * INTER, HIDDEN, device)
    yield "gemv_fp8", lambda: case_gemv_fp8(2 * INTER, HIDDEN, False, device)
    yield "gemv_fp8", lambda: case_gemv_fp8(HIDDEN, INTER, True, device)
    yield "gemv_fp8", lambda: case_gemv_fp8(N_Q * HEAD_DIM + 2 * N_KV * HEAD_DIM, HIDDEN, False, device)
    yield "gemv_norm", lambda: case_gemv_norm(N_Q * HEAD_DIM + 2 * N_KV * HEAD_DIM, HIDDEN, device)
    yield "gemv_norm", lambda: case_gemv_norm(2 * INTER, HIDDEN, device)
    for b in (1, 64, 256):
        for mode in ("plain", "topk50-topp0.9", "topp0.95-minp0.05", "topp0.9", "topp0.9-wide", "topp0.9-broad",
                     "mixed"):
            yield "sampling", lambda b=b, mode=mode: case_sampling(b, mode, device)
    for mode in ("topk50-topp0.9", "topp0.95-minp0.05", "topp0.9", "topp0.9-broad", "mixed"):  # the engine's logits
        yield "sampling", lambda mode=mode: case_sampling(256, mode, device, torch.bfloat16)


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--only", default="", help="run only cases whose kernel name contains this")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: this benchmark runs on the GPU machine", file=sys.stderr)
        return 2
    import triton

    device = torch.device("cuda")
    torch.manual_seed(int(time.time()))  # fresh inputs on every run
    results: list[Result] = []
    for name, make in all_cases(device):
        if args.only and args.only not in name:
            continue
        try:
            res = make()
        except Exception as e:  # noqa: BLE001 - one broken kernel must not hide the others
            res = Result(name, "?", ok=False, error="".join(traceback.format_exception_only(type(e), e)).strip())
            traceback.print_exc()
        results.append(res)
        print(f"{'ok  ' if res.ok else 'FAIL'} {res.kernel:17s} {res.shape:40s} err={fmt(res.rel_err, '.2e')} "
              f"{fmt(res.us, '.1f')} us", flush=True)

    header = f"{'kernel':17s} {'shape':40s} {'rel err':>9s} {'us':>9s} {'graph us':>9s} {'cpu us':>7s} " \
             f"{'GB/s':>8s} {'roof us':>8s} {'%roof':>6s}  note"
    print("\n" + header + "\n" + "-" * len(header))
    for r in results:
        print(f"{r.kernel:17s} {r.shape:40s} {fmt(r.rel_err, '9.2e')} {fmt(r.us, '9.1f')} {fmt(r.graph_us, '9.1f')} "
              f"{fmt(r.cpu_us, '7.1f')} {fmt(r.gbps, '8.0f')} {fmt(r.roofline_us, '8.1f')} "
              f"{fmt(r.pct_roofline, '6.1f')}  "
              f"{'' if r.ok else 'FAILED '}{r.note}{(' ' + r.error) if r.error else ''}")
    failed = [r for r in results if not r.ok]
    print(f"\n{len(results) - len(failed)} of {len(results)} checks passed")
    if args.out:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                "hbm_bytes_per_s": HBM_BYTES_PER_S, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
        rows = [{k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(r).items()}
                for r in results]
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "results": rows, "all_ok": not failed}, f, indent=2)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
