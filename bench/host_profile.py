"""The engine's host work per decode token, with the model's forward taken out: scheduling,
inputs, sampling glue, bookkeeping, outputs. Runs on the CPU with the tiny model, so it measures
the Python that every GPU step also pays. Decode steps go through the CUDA-graph runner's static
inputs (its CPU stand-in replays the forward), as on the GPU.
Usage: python bench/host_profile.py [BATCH] [--profile] [--overlap] [--freeze]"""

from __future__ import annotations

import cProfile
import gc
import io
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

from services.worker.engine.cuda_graphs import CudaGraphRunner
from services.worker.engine.engine import LLMEngine
from services.worker.engine.engine_config import EngineConfig
from inferno.tools.make_model import write_model
from shared.sampling_params import SamplingParams


def main() -> int:
    batch = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 256
    model_dir = Path(tempfile.gettempdir()) / "inferno-host-profile-tiny"
    if not (model_dir / "config.json").exists():
        write_model(model_dir, preset="tiny", seed=0, dtype="float32")
    engine = LLMEngine(EngineConfig(model_dir=str(model_dir), num_blocks=batch * 40, max_num_seqs=batch,
                                    max_num_batched_tokens=8192, overlap="--overlap" in sys.argv))
    graphs = CudaGraphRunner(engine.model, engine.kv_cache, batch, 1024, engine.device)
    graphs.capture()
    engine.runner.graphs = graphs
    g = torch.Generator().manual_seed(0)
    for i in range(batch):
        engine.add_request(f"r{i}", torch.randint(10, 400, (220,), generator=g).tolist(),
                           SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True))
    while any(r.num_output_tokens == 0 for r in engine.batcher.running_requests() + engine.batcher.waiting_requests()):
        engine.step()
    for _ in range(5):
        engine.step()

    forward_s = 0.0
    forward = engine.model.forward

    def timed_forward(*args, **kwargs):
        nonlocal forward_s
        t = time.perf_counter()
        try:
            return forward(*args, **kwargs)
        finally:
            forward_s += time.perf_counter() - t
    engine.model.forward = timed_forward
    gc_s = 0.0
    gc_started = 0.0

    def on_gc(phase, info):  # the collector's pauses inside the timed steps
        nonlocal gc_s, gc_started
        if phase == "start":
            gc_started = time.perf_counter()
        else:
            gc_s += time.perf_counter() - gc_started
    if "--freeze" in sys.argv:  # what a long-running worker can do once it has started
        gc.collect()
        gc.freeze()
    gc.callbacks.append(on_gc)
    prof = cProfile.Profile() if "--profile" in sys.argv else None
    n = 40
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    for _ in range(n):
        engine.step()
    if prof:
        prof.disable()
    wall = time.perf_counter() - t0
    gc.callbacks.remove(on_gc)
    host = wall - forward_s
    print(f"batch {batch}: step {1000 * wall / n:.2f} ms, forward {1000 * forward_s / n:.2f} ms, "
          f"host {1000 * host / n:.2f} ms = {1e6 * host / n / batch:.1f} µs per token "
          f"(of which garbage collection {1000 * gc_s / n:.2f} ms)")
    if prof:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
        print(out.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
