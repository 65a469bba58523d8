"""Why a decode step that carries a new prompt's prefill is slow (W3's ITL p99): GPU time of a
decode-only step (graph and eager) against a mixed step (decodes + one prompt) and a prefill-only
step, and the mixed step's kernels by GPU time. Usage: python3 bench/mixed_step_probe.py MODEL [DECODES [PROMPT]]"""

from __future__ import annotations

import json
import sys
import time

import torch

from services.worker.engine.engine import LLMEngine
from services.worker.engine.engine_config import EngineConfig
from shared.sampling_params import SamplingParams


def step_ms(engine, n=1) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        engine.step()
    torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - t) / n


def main() -> int:
    model = sys.argv[1]
    decodes = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    prompt_len = int(sys.argv[3]) if len(sys.argv) > 3 else 220
    engine = LLMEngine(EngineConfig(model_dir=model, device="cuda", max_num_seqs=decodes + 8,
                                    max_num_batched_tokens=8192, overlap=False))
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=4000, ignore_eos=True, temperature=0.0)
    for i in range(decodes):
        engine.add_request(f"d{i}", torch.randint(0, vocab, (400,), generator=g).tolist(), params)
    while any(r.num_output_tokens == 0 for r in engine.batcher.running_requests()) or engine.batcher.num_waiting:
        engine.step()
    out = {"decodes": decodes, "prompt_len": prompt_len}
    step_ms(engine, 5)
    out["decode_graph_ms"] = step_ms(engine, 20)
    runner = engine.runner
    graphs, mixed_graphs = runner.graphs, runner.mixed_graphs
    runner.graphs = runner.mixed_graphs = None
    step_ms(engine, 3)
    out["decode_eager_ms"] = step_ms(engine, 10)
    for name, use_mixed in (("mixed_eager_ms", None), ("mixed_graph_ms", mixed_graphs)):
        runner.graphs, runner.mixed_graphs = graphs, use_mixed
        times = []
        for i in range(6):
            engine.add_request(f"p{name}{i}", torch.randint(0, vocab, (prompt_len,), generator=g).tolist(),
                               SamplingParams(max_tokens=1, temperature=0.0))
            times.append(step_ms(engine))
        out[name] = sorted(times)[len(times) // 2]
    # The same prompt alone (no decodes): a second engine would double the memory, so abort the decodes.
    for i in range(decodes):
        engine.abort(f"d{i}")
    alone = []
    for i in range(4):
        engine.add_request(f"q{i}", torch.randint(0, vocab, (prompt_len,), generator=g).tolist(),
                           SamplingParams(max_tokens=1, temperature=0.0))
        alone.append(step_ms(engine))
    out["prefill_only_graph_ms"] = sorted(alone)[len(alone) // 2]
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}), flush=True)

    # Kernels of one mixed step, by GPU time.
    for i in range(decodes):
        engine.add_request(f"e{i}", torch.randint(0, vocab, (400,), generator=g).tolist(), params)
    while any(r.num_output_tokens == 0 for r in engine.batcher.running_requests()) or engine.batcher.num_waiting:
        engine.step()
    runner.mixed_graphs = None  # the kernels one by one
    engine.add_request("prof", torch.randint(0, vocab, (prompt_len,), generator=g).tolist(),
                       SamplingParams(max_tokens=1, temperature=0.0))
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.step()
        torch.cuda.synchronize()
    try:
        table = prof.key_averages().table(sort_by="device_time_total", row_limit=18, max_name_column_width=60)
    except (AttributeError, KeyError):
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
