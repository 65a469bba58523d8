"""CPU cost of an eager prompt step (W2's 8,192-token steps run outside the graphs).

The step thread's CPU time (time.thread_time) to launch one forward of TOKENS tokens through every
layer, alone and behind another one in flight, its wall time to return, and its GPU time (to the
synchronize), medians of REPEATS; the activation peak the engine's KV sizing measured.
Then the CPU time of one launch of each op the eager forward calls, at TOKENS tokens and at 16
(where the GPU's work is too small to hold anything up).

(Measured with it on 2026-11-28: the MLP in 2,048- or 4,096-token pieces lowers the peak from 1.06
to 0.68 / 0.77 GiB, but its extra launches fill the launch queue behind a step in flight, where
the host then waits: 22.5 ms of CPU per step became 75 / 202 ms. Not kept.)

Usage: python3 bench/eager_cpu_probe.py MODEL [TOKENS] [--profile]
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time

import torch

from services.worker.engine.attention_metadata import AttentionMetadata
from services.worker.engine.engine import LLMEngine
from services.worker.engine.engine_config import EngineConfig
from services.worker.engine.gpu_memory import one_prompt_metadata

REPEATS = 7


def prompt_meta(engine, tokens: int) -> AttentionMetadata:
    return one_prompt_metadata(tokens, math.ceil(tokens / engine.config.block_size), engine.device)


@torch.inference_mode()
def forward_costs(engine, tokens: int) -> dict:
    device = engine.device
    meta = prompt_meta(engine, tokens)
    ids = torch.randint(0, engine.model_config.vocab_size, (tokens,), device=device)
    pos = torch.arange(tokens, device=device)
    cpu, wall, gpu, queued = [], [], [], []
    for i in range(REPEATS + 1):
        torch.cuda.synchronize()
        t0, c0 = time.perf_counter(), time.thread_time()
        engine.model(ids, pos, engine.kv_cache.layers, meta)
        c1, t1 = time.thread_time(), time.perf_counter()
        # A second forward launched behind the first, as an overlapped step is behind the one in
        # flight: its launches queue up while the GPU works, and may wait for room in the queue.
        engine.model(ids, pos, engine.kv_cache.layers, meta)
        c2 = time.thread_time()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        if i:  # the first pays for first launches
            cpu.append(c1 - c0)
            queued.append(c2 - c1)
            wall.append(t1 - t0)
            gpu.append((t2 - t0) / 2)
    layers = engine.model_config.num_hidden_layers
    return {"cpu_ms": 1e3 * statistics.median(cpu), "cpu_us_per_layer": 1e6 * statistics.median(cpu) / layers,
            "cpu_ms_behind_a_step": 1e3 * statistics.median(queued),
            "return_ms": 1e3 * statistics.median(wall), "gpu_ms": 1e3 * statistics.median(gpu)}


@torch.inference_mode()
def op_costs(engine, tokens: int, n: int = 50) -> dict:
    """CPU µs of one launch of each op of the eager forward (queued behind each other on the GPU)."""
    layer = engine.model.layers[0]
    ops, mc, device = engine.ops, engine.model_config, engine.device
    dtype = engine.dtype
    x = torch.randn(tokens, mc.hidden_size, device=device, dtype=dtype)
    res = torch.randn_like(x)
    attn = layer.self_attn
    qkv = attn.qkv_proj(x)
    q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    q = q.reshape(tokens, attn.num_heads, attn.head_dim)
    k = k.reshape(tokens, attn.num_kv_heads, attn.head_dim)
    v = v.reshape(tokens, attn.num_kv_heads, attn.head_dim)
    k_cache, v_cache = engine.kv_cache.layers[0]
    meta = prompt_meta(engine, tokens)
    pos = torch.arange(tokens, device=device)
    gate_up = layer.mlp.gate_up_proj(x[:min(tokens, 2048)])
    cases = {
        "add_rmsnorm": lambda: ops.add_rmsnorm(x, res, layer.input_layernorm, 1e-5),
        "qkv_proj (cuBLAS)": lambda: attn.qkv_proj(x),
        "rope_kv_write": lambda: ops.rope_kv_write(q, k, v, pos, engine.model.cos_sin, k_cache, v_cache,
                                                   meta.slot_mapping),
        "attention (extend)": lambda: ops.attention(q, k_cache, v_cache, meta, attn.scale),
        "silu_mul (<= 2048 rows)": lambda: ops.silu_mul(gate_up),
        "down_proj (<= 2048 rows)": lambda: layer.mlp.down_proj(gate_up),
    }
    out = {}
    for name, fn in cases.items():
        fn()
        torch.cuda.synchronize()
        c0 = time.thread_time()
        for _ in range(n):
            fn()
        out[name] = 1e6 * (time.thread_time() - c0) / n
        torch.cuda.synchronize()
    return out


def main() -> int:
    model = sys.argv[1]
    tokens = int(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2].isdigit() else 8192
    engine = LLMEngine(EngineConfig(model_dir=model, device="cuda", max_num_batched_tokens=tokens, max_num_seqs=1024,
                                    cuda_graphs=False, mixed_graphs=False))
    row = {"activation_peak_gib": round(engine.memory_report["activation_peak_gib"], 3)}  # its sizing's dry run
    row.update({k: round(v, 2) for k, v in forward_costs(engine, tokens).items()})
    print(json.dumps(row), flush=True)
    for n in (tokens, 16):
        print(json.dumps({"tokens": n, "op_cpu_us": {k: round(v, 1) for k, v in op_costs(engine, n).items()}}),
              flush=True)
    if "--profile" in sys.argv:  # where a forward's launch CPU goes, by function (cProfile's own time)
        import cProfile
        import pstats
        prof = cProfile.Profile()
        prof.enable()
        forward_costs(engine, tokens)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    print("memory report:", json.dumps({k: round(v, 3) if isinstance(v, float) else v
                                        for k, v in engine.memory_report.items()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
