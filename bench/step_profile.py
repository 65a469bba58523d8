"""Where a step's wall time goes on the GPU: host phases timed around the engine's parts, and a
cProfile of the Python side. Usage: python bench/step_profile.py MODEL_DIR [BATCH [TEMP [mixed]]]
("mixed": a new 220-token prompt joins every step, so every step is a mixed eager one)."""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time
from collections import defaultdict

import torch

from services.worker.engine.engine import LLMEngine
from services.worker.engine.engine_config import EngineConfig
from shared.sampling_params import SamplingParams


def timed(obj, name, totals):
    fn = getattr(obj, name)

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - t
    setattr(obj, name, wrapper)


def main() -> int:
    model_dir, batch = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 256
    temperature = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
    mixed = len(sys.argv) > 4 and sys.argv[4] == "mixed"
    engine = LLMEngine(EngineConfig(model_dir=model_dir, device="cuda", max_num_seqs=batch + (64 if mixed else 0),
                                    max_num_batched_tokens=8192))
    g = torch.Generator().manual_seed(0)
    for i in range(batch):
        engine.add_request(f"r{i}", torch.randint(10, 120000, (220,), generator=g).tolist(),
                           SamplingParams(temperature=temperature, top_p=0.95, max_tokens=400, ignore_eos=True))
    while any(r.num_output_tokens == 0 for r in engine.batcher.running_requests() + engine.batcher.waiting_requests()):
        engine.step()
    for _ in range(10):
        engine.step()
    totals: dict[str, float] = defaultdict(float)
    timed(engine.batcher, "schedule", totals)
    timed(engine.batcher, "update_from_output", totals)
    timed(engine.runner, "execute", totals)
    timed(engine, "_finish", totals)
    timed(engine.sampler, "_sample", totals)
    n = 50
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for i in range(n):
        if mixed:
            engine.add_request(f"m{i}", torch.randint(10, 120000, (220,), generator=g).tolist(),
                               SamplingParams(temperature=temperature, max_tokens=4, ignore_eos=True))
        engine.step()
    prof.disable()
    wall = time.perf_counter() - t0
    print(f"batch {batch}{' mixed' if mixed else ''}: {1000 * wall / n:.2f} ms/step, {batch * n / wall:.0f} tok/s")
    for name, total in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"  {name:<20} {1000 * total / n:8.3f} ms/step")
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
    print("\n".join(out.getvalue().splitlines()[6:32]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
