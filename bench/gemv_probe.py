"""The decode GEMV (services/worker/kernels/gemv.py) against cuBLAS at M = 1..8 rows, Llama-3.1-8B
projections in bf16: µs, GB/s and error of each block-size configuration, the best per shape, the
SiLU-fused down projection, and a decode step's sum (32 layers + the LM head).

Usage (on the GPU, from the repository root): python3 bench/gemv_probe.py [--m 1,2,4,8] [--tp 2]
Each time is the median of 7 replays of a CUDA graph of 20 calls, divided by 20; the calls rotate
over copies of the weight that together pass 4x the 50 MB L2, so every call reads its weights from
HBM. GB/s counts the bytes each call must move once (weights + x + out). Error: ||out - ref|| /
||ref|| against the fp32 product of the same bf16 inputs. Runs in well under a minute (most of
it Triton compiles, ~40 variants; cached for a second run). The summary tables come last.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from services.worker.kernels import gemv  # noqa: E402
from services.worker.kernels.gemv import GemvConfig  # noqa: E402
from services.worker.kernels.silu_mul import silu_mul, silu_mul_ref  # noqa: E402

DTYPE = torch.bfloat16
HBM_ROOFLINE = 3.0e12  # bytes/s a read stream can reach on an H100 (peak 3.35e12)
L2_DEFEAT_BYTES = 4 * 50 * 2**20
CALLS, REPS = 20, 7
LAYERS = 32
C = GemvConfig
# name, N, K, calls per decode step
SHAPES = [("qkv", 6144, 4096, LAYERS), ("o_proj", 4096, 4096, LAYERS), ("gate_up", 28672, 4096, LAYERS),
          ("down", 4096, 14336, LAYERS), ("lm_head", 128256, 4096, 1)]
FUSED = "down+act"  # the down projection from the gate_up output: silu_mul + GEMV, or fused
# M = 1 compares widely; M > 1 a few (each M is a compile of every configuration).
CONFIGS_M1 = [C(1, 1024, 3), C(2, 1024, 3), C(4, 512, 3), C(4, 512, 4), C(4, 1024, 1), C(4, 1024, 3),
              C(8, 512, 3), C(8, 1024, 2), C(8, 1024, 3), C(8, 1024, 4), C(8, 2048, 3), C(16, 512, 3), C(16, 1024, 3)]
CONFIGS_MN = [C(2, 512, 3), C(4, 512, 3), C(4, 1024, 3), C(8, 512, 3), C(8, 1024, 3)]
# The fused down projection is timed with the default and the unfused down's best few
# configurations; past FUSED_SILU_MAX_ROWS only with one of them, to confirm it loses there.
FUSED_TOP = 3


@dataclass(slots=True)
class Row:
    shape: str
    m: int
    method: str  # "cublas", "gemv", "silu+gemv", "fused", "silu+cublas"
    config: GemvConfig | None
    us: float | None
    gbps: float | None
    err: float | None
    note: str = ""

    @property
    def label(self) -> str:
        c = self.config
        cfg = f" n{c.block_n} k{c.block_k} s{c.num_stages}" if c is not None else ""
        return self.method + cfg


def graph_us(call, weights) -> float:
    """Median µs per call of a graph of CALLS calls rotating over `weights`."""
    call(weights[0])  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS):
            call(weights[i % len(weights)])
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / CALLS)
    del graph
    return statistics.median(times)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def measure(shape, m, method, config, call, weights, ref, nbytes) -> Row:
    try:
        err = rel_err(call(weights[0]), ref)
        us = graph_us(call, weights)
    except Exception as e:  # a configuration that does not compile or launch: reported, not fatal
        return Row(shape, m, method, config, None, None, None, f"{type(e).__name__}: {str(e)[:60]}")
    note = "ERR>1e-2" if not err <= 1e-2 else ""
    return Row(shape, m, method, config, us, nbytes / us / 1e3, err, note)


def print_row(r: Row, cublas_us: float | None) -> None:
    if r.us is None:
        print(f"{r.shape:9s} {r.m:2d} {r.label:28s} {'-':>8s} {'-':>7s} {'-':>9s} {'-':>7s} {r.note}", flush=True)
        return
    speed = f"{cublas_us / r.us:7.2f}" if cublas_us else "      -"
    print(f"{r.shape:9s} {r.m:2d} {r.label:28s} {r.us:8.1f} {r.gbps:7.0f} {r.err:9.2e} {speed} {r.note}", flush=True)


def weight_copies(n: int, k: int, device) -> list[torch.Tensor]:
    copies = max(2, math.ceil(L2_DEFEAT_BYTES / (n * k * DTYPE.itemsize)))
    return [(torch.randn(n, k, device=device) * 0.02).to(DTYPE) for _ in range(copies)]


def probe_shape(name, n, k, ms, device, rows: list[Row]) -> None:
    weights = weight_copies(n, k, device)
    w_ref = weights[0].float()
    for m in ms:
        x = torch.randn(m, k, device=device).to(DTYPE)
        ref = x.float() @ w_ref.t()
        nbytes = (n * k + m * k + m * n) * DTYPE.itemsize
        cublas = measure(name, m, "cublas", None, lambda w: F.linear(x, w), weights, ref, nbytes)
        rows.append(cublas)
        print_row(cublas, None)
        default = gemv.gemv_config(m, n, k, DTYPE)
        configs = CONFIGS_M1 if m == 1 else CONFIGS_MN
        for config in [default] + [c for c in configs if c != default]:
            row = measure(name, m, "gemv", config, lambda w, c=config: gemv.linear(x, w, config=c),
                          weights, ref, nbytes)
            row.note = (row.note + " default").strip() if config == default else row.note
            rows.append(row)
            print_row(row, cublas.us)
        if name == "down":
            probe_fused(n, k, m, weights, w_ref, device, rows)
    del weights, w_ref
    torch.cuda.empty_cache()


def probe_fused(n, k, m, weights, w_ref, device, rows: list[Row]) -> None:
    """The down projection fed the gate_up output [m, 2k]: what a decode step runs."""
    x = (torch.randn(m, 2 * k, device=device) * 2).to(DTYPE)
    ref = silu_mul_ref(x).float() @ w_ref.t()
    nbytes = (n * k + m * 2 * k + m * n) * DTYPE.itemsize
    cublas = measure(FUSED, m, "silu+cublas", None, lambda w: F.linear(silu_mul(x), w), weights, ref, nbytes)
    rows.append(cublas)
    print_row(cublas, None)
    default = gemv.gemv_config(m, n, k, DTYPE)
    timed = sorted((r for r in rows if r.shape == "down" and r.m == m and r.method == "gemv" and r.us),
                   key=lambda r: r.us)
    top = FUSED_TOP if m <= gemv.FUSED_SILU_MAX_ROWS else 1
    configs = [default] + [r.config for r in timed[:top] if r.config != default]
    for config in configs:
        unfused = measure(FUSED, m, "silu+gemv", config,
                          lambda w, c=config: gemv.linear(silu_mul(x), w, config=c), weights, ref, nbytes)
        fused = measure(FUSED, m, "fused", config,
                        lambda w, c=config: gemv.silu_mul_linear(x, w, config=c), weights, ref, nbytes)
        if fused.us is not None and unfused.us is not None:
            same = torch.equal(gemv.silu_mul_linear(x, weights[0], config=config),
                               gemv.linear(silu_mul(x), weights[0], config=config))
            fused.note = (fused.note + (" bit-exact" if same else " DIFFERS-from-unfused")).strip()
        for row in (unfused, fused):
            row.note = (row.note + " default").strip() if config == default else row.note
            rows.append(row)
            print_row(row, cublas.us)


def best(rows, shape, m, methods) -> Row | None:
    ok = [r for r in rows if r.shape == shape and r.m == m and r.method in methods and r.us
          and not r.note.startswith("ERR")]
    return min(ok, key=lambda r: r.us) if ok else None


def find(rows, shape, m, method, default=False) -> Row | None:
    for r in rows:
        if r.shape == shape and r.m == m and r.method == method and (not default or "default" in r.note):
            return r
    return None


def summary(rows: list[Row], ms) -> None:
    print("\n== best per shape (GB/s: weights + x + out per µs; roofline: those bytes at 3.0 TB/s) ==")
    print(f"{'shape':9s} {'M':>2s} {'cuBLAS us':>9s} {'GB/s':>5s} | {'best GEMV config':28s} {'us':>7s} {'GB/s':>5s} "
          f"{'rel err':>8s} {'speedup':>8s} | {'default us':>10s} | {'roofline':>8s}")
    for m in ms:
        down = next(s for s in SHAPES if s[0] == "down")
        for name, n, k, _ in SHAPES + [(FUSED,) + down[1:]]:
            if name == FUSED:
                base = find(rows, name, m, "silu+cublas")
                top = best(rows, name, m, ("fused", "silu+gemv"))
                dflt = find(rows, name, m, "fused" if m <= gemv.FUSED_SILU_MAX_ROWS else "silu+gemv", default=True)
                nbytes = (n * k + m * 2 * k + m * n) * DTYPE.itemsize
            else:
                base = find(rows, name, m, "cublas")
                top = best(rows, name, m, ("gemv",))
                dflt = find(rows, name, m, "gemv", default=True)
                nbytes = (n * k + m * k + m * n) * DTYPE.itemsize
            if base is None or base.us is None:
                continue
            line = f"{name:9s} {m:2d} {base.us:9.1f} {base.gbps:5.0f} | "
            if top is not None:
                line += f"{top.label:28s} {top.us:7.1f} {top.gbps:5.0f} {top.err:8.1e} {base.us / top.us:8.2f} | "
            else:
                line += f"{'(none)':28s} {'':7s} {'':5s} {'':8s} {'':8s} | "
            line += f"{dflt.us:10.1f} | " if dflt is not None and dflt.us else f"{'-':>10s} | "
            print(line + f"{nbytes / HBM_ROOFLINE * 1e6:8.1f}")

    print("\n== decode step: 32 x (qkv + o_proj + gate_up + down with its activation) + lm_head, µs ==")
    print(f"{'M':>2s} {'cuBLAS':>8s} {'GEMV best':>9s} {'GEMV default':>12s} {'saved (best)':>12s} {'roofline':>8s}")
    for m in ms:
        total = {"cublas": 0.0, "best": 0.0, "default": 0.0, "roof": 0.0}
        complete = True
        for name, n, k, count in SHAPES:
            if name == "down":
                name = FUSED
                picks = (find(rows, name, m, "silu+cublas"), best(rows, name, m, ("fused", "silu+gemv")),
                         find(rows, name, m, "fused" if m <= gemv.FUSED_SILU_MAX_ROWS else "silu+gemv", default=True))
            else:
                picks = (find(rows, name, m, "cublas"), best(rows, name, m, ("gemv",)),
                         find(rows, name, m, "gemv", default=True))
            if any(p is None or p.us is None for p in picks):
                complete = False
                continue
            for key, p in zip(("cublas", "best", "default"), picks):
                total[key] += count * p.us
            total["roof"] += count * n * k * DTYPE.itemsize / HBM_ROOFLINE * 1e6
        mark = "" if complete else "  (incomplete: a shape failed)"
        print(f"{m:2d} {total['cublas']:8.0f} {total['best']:9.0f} {total['default']:12.0f} "
              f"{total['cublas'] - total['best']:12.0f} {total['roof']:8.0f}{mark}")

    print("\n== best configuration per shape, for gemv_config() ==")
    for m in ms:
        picks = []
        for name, n, k, _ in SHAPES:
            top = best(rows, name, m, ("gemv",))
            if top is not None:
                c = top.config
                picks.append(f"{name}(n={n},k={k}): ({c.block_n}, {c.block_k}, {c.num_stages})")
        fused = best(rows, FUSED, m, ("fused", "silu+gemv"))
        if fused is not None:
            picks.append(f"{FUSED}: {fused.method}")
        print(f"M={m}: " + "; ".join(picks))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", default="1,2,4,8", help="row counts, comma-separated")
    parser.add_argument("--tp", type=int, default=1,
                        help="one rank's shapes under tensor parallelism: qkv, gate_up and the LM head split "
                             "by rows (N / tp), o_proj and down by columns (K / tp)")
    args = parser.parse_args()
    ms = [int(v) for v in args.m.split(",")]
    if args.tp > 1:  # the module's SHAPES as one rank holds them (the summaries read them too)
        SHAPES[:] = [(name, n // args.tp if name in ("qkv", "gate_up", "lm_head") else n,
                      k // args.tp if name in ("o_proj", "down") else k, count) for name, n, k, count in SHAPES]
    if not torch.cuda.is_available():
        print("no GPU: this probe times kernels on one")
        return 1
    device = torch.device("cuda")
    torch.manual_seed(0)
    t0 = time.time()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, calls/graph {CALLS}, replays {REPS}")
    print(f"{'shape':9s} {'M':>2s} {'method / config':28s} {'us':>8s} {'GB/s':>7s} {'rel err':>9s} "
          f"{'speedup':>7s} note")
    rows: list[Row] = []
    for name, n, k, _ in SHAPES:
        probe_shape(name, n, k, ms, device, rows)
    summary(rows, ms)
    print(f"\nprobe time {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
