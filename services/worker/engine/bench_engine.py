"""`inferno bench-engine`: offline prefill and decode tokens/s of the engine on one model."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from services.worker.engine.engine import LLMEngine
from services.worker.engine.engine_config import EngineConfig
from services.worker.engine.torch_profile import FOLLOWERS_ENV, TRACE_ENV, start_profile, write_profile
from shared.sampling_params import SamplingParams


def run(engine: LLMEngine, batch_size: int, prompt_len: int, decode_tokens: int, seed: int = 0,
        profile: str = "") -> dict:
    gen = torch.Generator().manual_seed(seed)
    vocab = engine.model_config.vocab_size
    prompts = [torch.randint(10, vocab, (prompt_len,), generator=gen).tolist() for _ in range(batch_size)]
    params = SamplingParams(temperature=0.0, max_tokens=decode_tokens + 1, ignore_eos=True)
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)

    # Warm-up (kernel compilation, allocator) on a throwaway request, then a clean prefix cache.
    engine.generate([prompts[0][:16]], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    engine.block_manager.reset_prefix_cache()

    requests = [engine.add_request(f"bench-{i}", p, params) for i, p in enumerate(prompts)]
    sync()
    t0 = time.perf_counter()
    # Prefill: steps until every request has its first token.
    while any(r.num_output_tokens == 0 for r in engine.batcher.running_requests() + engine.batcher.waiting_requests()):
        engine.step()
    sync()
    t1 = time.perf_counter()
    decode_steps = 0
    routed_before = _routed(engine)
    profiler = start_profile() if profile else None
    while engine.has_unfinished():
        engine.step()
        decode_steps += 1
    sync()
    t2 = time.perf_counter()
    if profiler is not None:
        write_profile(profiler, profile, decode_steps, t2 - t1)
    prefill_s, decode_s = t1 - t0, t2 - t1
    return {
        "batch_size": batch_size, "prompt_len": prompt_len, "decode_tokens": decode_tokens,
        "prefill_tokens_per_s": batch_size * prompt_len / prefill_s,
        "decode_tokens_per_s": batch_size * decode_tokens / decode_s if decode_s else 0.0,
        "decode_step_ms": 1000 * decode_s / max(1, decode_steps),
        "prefill_s": prefill_s, "decode_s": decode_s,
        "device": str(engine.device), "dtype": str(engine.dtype).removeprefix("torch."),
        "kv_cache_dtype": str(engine.kv_dtype).removeprefix("torch."), "quantization": engine.config.quantization,
        "kernels": engine.ops.name, "model_load_s": engine.load_seconds,
        "overlap": engine.config.overlap,
        # The first request's first tokens: a parallel group's greedy output beside one GPU's, same weights.
        "first_tokens": requests[0].output_token_ids[:32],
        "expert_spread": expert_spread(_routed(engine) - routed_before) if routed_before is not None else None,
    }


def _routed(engine: LLMEngine) -> torch.Tensor | None:
    """Tokens routed to each expert so far, summed over the MoE layers (None: no MoE)."""
    counters = engine.expert_load.counters
    return torch.stack(counters).sum(0).cpu() if counters else None


def expert_spread(tokens: torch.Tensor) -> dict:
    """How evenly the decode steps' tokens fell on the experts: the busiest expert's tokens over
    the mean, and the busiest of R contiguous blocks of experts (expert parallelism's split over R
    GPUs) over the mean block. A step waits for its busiest GPU: random-weight routers are not
    trained to balance, so the EP figure depends on this."""
    t = tokens.double()
    spread = {"max_over_mean": round(float(t.max() / t.mean().clamp(min=1e-9)), 3)}
    for ranks in (2, 4, 8):
        if t.numel() % ranks == 0:
            blocks = t.view(ranks, -1).sum(1)
            spread[f"ep{ranks}_max_over_mean"] = round(float(blocks.max() / blocks.mean().clamp(min=1e-9)), 3)
    return spread


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="inferno bench-engine", description=__doc__)
    ap.add_argument("--model", required=True, help="Hugging Face model directory")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8", "fp8_e4m3"], default="auto")
    ap.add_argument("--quantization", "-q", choices=["fp8"], default=None)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--num-blocks", type=int, default=None)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--no-cuda-graphs", action="store_true")
    ap.add_argument("--overlap", action="store_true", help="plan step N+1 before reading step N's tokens")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    ap.add_argument("--profile", default="", metavar="FILE",
                    help="write torch's profile of the decode steps here (kernels by GPU time, per step)")
    ap.add_argument("--profile-trace", action="store_true",
                    help="with --profile: each rank's timeline too, FILE[.rankN].trace.json.gz")
    ap.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                    help="dummy: random weights drawn on the device (a --config-only directory suffices)")
    ap.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    ap.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    ap.add_argument("--enable-expert-parallel", action="store_true",
                    help="MoE models: whole experts spread over the tensor-parallel GPUs")
    ap.add_argument("--custom-all-reduce", action=argparse.BooleanOptionalAction, default=True,
                    help="small tensor-parallel all-reduces over peer memory (default); --no-custom-all-reduce: NCCL")
    ap.add_argument("--fused-all-reduce-norm", action=argparse.BooleanOptionalAction, default=True,
                    help="the one-shot all-reduce does the residual add and RMSNorm after it in the same kernel "
                         "(default); --no-fused-all-reduce-norm: two kernels")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.profile:  # a parallel group's other ranks profile their whole run beside it (FILE.rankN)
        os.environ[FOLLOWERS_ENV] = args.profile
        if args.profile_trace:
            os.environ[TRACE_ENV] = "1"
    engine = LLMEngine(EngineConfig(
        model_dir=args.model, device=args.device, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization, num_blocks=args.num_blocks,
        max_num_seqs=max(args.batch_size, 1), max_num_batched_tokens=args.max_num_batched_tokens,
        cuda_graphs=not args.no_cuda_graphs, overlap=args.overlap, load_format=args.load_format,
        tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size,
        custom_all_reduce=args.custom_all_reduce, fused_all_reduce_norm=args.fused_all_reduce_norm,
        enable_expert_parallel=args.enable_expert_parallel))
    try:
        result = run(engine, args.batch_size, args.prompt_len, args.decode_tokens, profile=args.profile)
    except BaseException:
        engine.close()
        raise
    result.update(tensor_parallel=args.tensor_parallel_size, pipeline_parallel=args.pipeline_parallel_size,
                  custom_all_reduce=args.custom_all_reduce, fused_all_reduce_norm=args.fused_all_reduce_norm,
                  expert_parallel=args.enable_expert_parallel, kv_gib=engine.memory_report.get("kv_gib"),
                  memory=engine.memory_report)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"model {args.model}  device {result['device']} {result['dtype']}  kernels {result['kernels']}")
        print(f"batch {args.batch_size}  prompt {args.prompt_len}  decode {args.decode_tokens}")
        print(f"prefill  {result['prefill_tokens_per_s']:10.1f} tok/s")
        print(f"decode   {result['decode_tokens_per_s']:10.1f} tok/s  ({result['decode_step_ms']:.2f} ms/step)")
    sys.stdout.flush()
    parallel_on_gpu = engine.group is not None and engine.device.type == "cuda"
    engine.close()
    if parallel_on_gpu:  # NCCL communicators that graphs captured can hang the interpreter's teardown
        sys.stderr.flush()
        os._exit(0)
    return 0
