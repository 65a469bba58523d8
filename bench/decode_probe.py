"""Where a batch-1 decode step's time goes (W1): the graph replay's wall time per step against
the sum of its kernels' GPU times (measured eagerly under torch.profiler), by kernel.
The difference is the gaps between kernels. Usage: python3 bench/decode_probe.py MODEL [BATCH]"""

from __future__ import annotations

import json
import sys
import time
from collections import defaultdict

import torch

from services.worker.engine.engine import LLMEngine
from services.worker.engine.engine_config import EngineConfig
from shared.sampling_params import SamplingParams


def main() -> int:
    model = sys.argv[1]
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    engine = LLMEngine(EngineConfig(model_dir=model, device="cuda", max_num_seqs=max(batch, 8), overlap=False))
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    for i in range(batch):
        engine.add_request(f"r{i}", torch.randint(0, vocab, (128,), generator=g).tolist(),
                           SamplingParams(max_tokens=4000, ignore_eos=True, temperature=0.0))
    for _ in range(8):
        engine.step()
    graphs = engine.runner.graphs
    hidden_shape = None
    # The replay alone (no host work): the GPU time of one decode step in its graph.
    b = next(x for x in graphs.buckets if x >= batch)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(50):
        graphs.graphs[b].replay()
    end.record()
    torch.cuda.synchronize()
    replay_ms = start.elapsed_time(end) / 50
    t = time.perf_counter()
    for _ in range(50):
        engine.step()
    torch.cuda.synchronize()
    step_ms = 1000 * (time.perf_counter() - t) / 50
    # Kernels of the same step run eagerly, under the profiler.
    engine.runner.graphs = engine.runner.mixed_graphs = None
    from torch.profiler import ProfilerActivity, profile
    for _ in range(3):
        engine.step()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            engine.step()
        torch.cuda.synchronize()
    kernels = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            name = e.name[:48]
            kernels[name][0] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            kernels[name][1] += 1
    total_us = sum(v[0] for v in kernels.values()) / 5
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    print(json.dumps({"batch": batch, "graph_replay_ms": round(replay_ms, 3), "engine_step_ms": round(step_ms, 3),
                      "kernel_sum_ms": round(total_us / 1000, 3), "kernels_per_step": sum(v[1] for v in kernels.values()) // 5,
                      "weight_gb": round(weights / 1e9, 2), "hidden": hidden_shape}))
    for name, (us, n) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:16]:
        print(f"{us / 5:9.1f} us/step  {n // 5:4d} launches  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
