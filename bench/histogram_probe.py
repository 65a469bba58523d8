"""What an exact per-bin count of every token would cost the sampler's pass 1 (H100 probe).

    python3 bench/histogram_probe.py

Pass 1 reads each row in chunks (one program each) and keeps per-lane maxima and sums of exp. Top-p's
band would be a sure bound if pass 1 also counted every token on a grid of l (bins 1/8 wide below a
chunk's first tile's max plus headroom), not two samples a lane. This times a stand-in of pass 1 at
B = 256, V = 128,256 (3 chunks a row, as the sampler launches it on an H100) without the count, and
with a tl.histogram of every tile into 128 or 256 bins, as CUDA-graph µs with a cold L2.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from bench.gpu_kernels import graph_us  # noqa: E402


@triton.jit
def _pass1(x_ptr, stride, out_ptr, hist_ptr, vocab, chunk, BLOCK: tl.constexpr, BINS: tl.constexpr,
           COUNT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    start = split * chunk
    end = tl.minimum(start + chunk, vocab)
    base = x_ptr + row * stride
    lane_max = tl.full([BLOCK], float("-inf"), tl.float32)
    lane_z = tl.zeros([BLOCK], tl.float32)
    top = tl.floor(tl.max(tl.load(base + start + cols, mask=start + cols < end, other=float("-inf")), axis=0) * 8.0)
    top = top + 128.0  # 16 units of headroom above the first tile's max
    hist = tl.zeros([BINS], tl.int32)
    for v0 in range(start, end, BLOCK):
        idx = v0 + cols
        l = tl.load(base + idx, mask=idx < end, other=float("-inf")) * 1.25
        new_max = tl.maximum(lane_max, l)
        ref = tl.where(new_max > float("-inf"), new_max, 0.0)
        lane_z = lane_z * tl.exp(lane_max - ref) + tl.exp(l - ref)
        lane_max = new_max
        if COUNT:
            j = top - tl.floor(l * 8.0)
            b = tl.where(j < BINS, j, BINS - 1).to(tl.int32)
            hist += tl.histogram(b, BINS, mask=(idx < end) & (j >= 0))
    m = tl.max(lane_max, axis=0)
    tl.store(out_ptr + row * 8 + split, m + tl.sum(lane_z * tl.exp(lane_max - m), axis=0))
    if COUNT:
        tl.store(hist_ptr + (row * 8 + split) * BINS + tl.arange(0, BINS), hist)


def main() -> None:
    dev = torch.device("cuda")
    B, V, S = 256, 128_256, 3
    x = torch.randn(B, V, device=dev) * 2.0
    x[:, torch.randint(0, V, (64,), device=dev)] += 6.0
    chunk = triton.cdiv(triton.cdiv(V, S), 2048) * 2048
    out = torch.empty(B * 8, device=dev)
    hist = torch.empty(B * 8 * 256, dtype=torch.int32, device=dev)
    for bins, count in ((256, False), (128, True), (256, True)):
        def run():
            _pass1[(B, S)](x, x.stride(0), out, hist, V, chunk, BLOCK=2048, BINS=bins, COUNT=count, num_warps=8)
        run()
        if count:  # the counts cover every token of the row (none above the headroom here)
            h = hist[:B * 8 * bins].view(B, 8, bins)[:, :S].sum((1, 2))
            covered = int(h.min())
        else:
            covered = 0
        print(f"count={count!s:5} bins={bins}: {graph_us(run):.1f} us; tokens counted per row (min) {covered}")


if __name__ == "__main__":
    main()
