"""Per-kernel GPU time of one sampler call at B rows, per mode (torch.profiler; H100 probe).

    python3 bench/sampling_kernels_probe.py [B] [LABEL] [bf16] [rows|chunks]

rows / chunks: force the second read's way (sampling._collects) whatever B; unset, B picks it.
"""

from __future__ import annotations

import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from bench.gpu_kernels import sampling_inputs  # noqa: E402
from services.worker.kernels import sampling as K  # noqa: E402

MODES = ("topk1", "topk50-topp0.9", "topp0.9", "topp0.9-broad", "topp0.95-minp0.05", "mixed")


def main() -> None:
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    label = sys.argv[2] if len(sys.argv) > 2 else "?"
    dtype = torch.bfloat16 if sys.argv[3:4] == ["bf16"] else torch.float32
    if sys.argv[4:5] in (["rows"], ["chunks"]):
        chunks = sys.argv[4] == "chunks"
        K._collects = lambda n_rows, device: chunks
    dev = torch.device("cuda")
    torch.manual_seed(0)
    for mode in MODES:
        a = sampling_inputs(rows, mode, dev, dtype)
        for _ in range(3):
            K.sample(*a)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                K.sample(*a)
            torch.cuda.synchronize()
        us = defaultdict(float)
        for e in prof.key_averages():
            if "kernel" in e.key and e.device_type.name == "CUDA":
                us[e.key] += e.device_time_total / 10
        print(label, mode, " | ".join(f"{k} {v:.1f}" for k, v in sorted(us.items(), key=lambda kv: -kv[1])))


if __name__ == "__main__":
    main()
