"""Where the sampler's time goes at B = 64 and 256 (H100 probe).

    python3 bench/sampling_probe.py

For each mode, with the kernel as it is and stopped after its first scan: rows differing from
sample_ref, rows by full reads, CUDA-graph µs with a cold L2, the time of each of the two launches
(torch.profiler), and each row's time in the second (globaltimer): a few long rows set the launch's.
"topk1" keeps one token: its second launch is the read loop alone. Rows read more than twice are
saved to $OUT for a replay under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from bench.gpu_kernels import graph_us, sampling_inputs  # noqa: E402
from services.worker.kernels import sampling as K  # noqa: E402

MODES = ("plain", "topk1", "topk50-topp0.9", "topp0.9", "topp0.9-wide", "topp0.9-broad", "topp0.95-minp0.05",
         "mixed")
VARIANTS = {"base": False, "scan-only": True}  # scan-only: filtered rows stop after their first scan


def kernel_us(fn, calls: int = 20) -> dict[str, float]:
    """Mean GPU µs per call of each kernel fn launches."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for ev in prof.key_averages():
        if ev.device_type.name == "CUDA" and "kernel" in ev.key:
            out[ev.key] = ev.device_time_total / calls
    return out


def main() -> None:
    torch.manual_seed(0)
    inputs = {(b, mode): sampling_inputs(b, mode, "cuda") for b in (64, 256) for mode in MODES}
    refs = {key: K.sample_ref(*args) for key, args in inputs.items()}
    print(f"{'variant':14s} {'B':>4s} {'mode':18s} {'diff':>4s} {'graph us':>9s} {'pass1':>7s} {'pass2':>7s}  reads",
          flush=True)
    out_dir = os.environ.get("OUT", ".")
    for name, scan_only in VARIANTS.items():
        K._SCAN_ONLY = scan_only
        for (b, mode), args in inputs.items():
            reads = torch.zeros(b, dtype=torch.int32, device="cuda")
            got = K.sample(*args, reads=reads)
            diff = int((got != refs[(b, mode)]).sum())
            hist = {int(n): int(c) for n, c in zip(*torch.unique(reads, return_counts=True))}
            fn = lambda a=args: K.sample(*a)  # noqa: E731
            us = graph_us(fn)
            ks = kernel_us(fn)
            p1 = sum(v for k, v in ks.items() if "_stats_kernel" in k)
            p2 = sum(v for k, v in ks.items() if "_sample_kernel" in k)
            print(f"{name:14s} {b:4d} {mode:18s} {diff:4d} {us:9.1f} {p1:7.1f} {p2:7.1f}  {hist}", flush=True)
            # Each row's program in the second launch: how long it ran (a few long rows set the launch's time).
            times = torch.zeros(b, 3, dtype=torch.int64, device="cuda")
            K.sample(*args, times=times)
            times = times.cpu()
            dur = (times[:, 1] - times[:, 0]).double() / 1e3
            span = (times[:, 1].max() - times[:, 0].min()).item() / 1e3
            q = torch.quantile(dur, torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64)).tolist()
            print(f"{'':14s} {'':4s} rows µs p50 {q[0]:.1f} p90 {q[1]:.1f} p99 {q[2]:.1f} max {dur.max():.1f}; "
                  f"span {span:.1f}; SMs {len(set(times[:, 2].tolist()))}", flush=True)
            if mode == "mixed":
                print(f"{'':20s} by kind (greedy, top-k 40, top-p 0.9, min-p 0.1): "
                      + ", ".join(f"{dur[k::4].median():.1f}/{dur[k::4].max():.1f}" for k in range(4)), flush=True)
            slow = (reads > 2).nonzero().flatten().tolist()
            if slow:
                torch.save(tuple(a[slow].cpu() for a in args), f"{out_dir}/tail_rows_{b}_{mode}.pt")
                print(f"{'':20s} rows read more than twice: {slow}, µs {[round(dur[r].item(), 1) for r in slow]}",
                      flush=True)


if __name__ == "__main__":
    main()
