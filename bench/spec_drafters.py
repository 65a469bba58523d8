"""The model drafters' cost at batch 1 (issue 36): an EAGLE-3 head and a draft model, each drafting k
tokens per step for one greedy request, against a plain decode step of the target.

Random weights draft tokens the target rejects, so tok/s here says nothing of a real pair; what holds
is the cost: ms of drafting per drafted token (the drafter's forwards, timed with the device synced
around each proposal) over a plain decode step (target: <= 4 % for the EAGLE-3 head), and the
checking step beside it. Each method runs in its own engine.

    python bench/spec_drafters.py MODEL_DIR --eagle3 HEAD_DIR --draft-model DRAFT_DIR [--k 4] [--out FILE]
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch

from spec_oracle import decode as oracle_decode  # bench/ is the script's directory

from services.worker.engine.engine import LLMEngine
from services.worker.engine.engine_config import EngineConfig
from services.worker.engine.speculative import SpeculativeConfig


def engine_for(model: str, device: str, spec: SpeculativeConfig | None) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=model, device=device, overlap=spec is None and device.startswith("cuda"),
                                  max_num_seqs=32, max_num_batched_tokens=2048, gpu_memory_utilization=0.5,
                                  speculative=spec))


def decode(engine: LLMEngine, prompt: list[int], tokens: int) -> tuple[int, float, int]:
    """One greedy request alone: tokens after the first, their seconds, the forwards (spec_oracle's)."""
    out, seconds, forwards = oracle_decode(engine, prompt, tokens)
    return len(out) - 1, seconds, forwards


def timed_proposals(engine: LLMEngine) -> list[float]:
    """Wrap the drafter's propose: seconds of each call, the device synced before and after."""
    times: list[float] = []
    propose = engine.drafter.propose
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)

    def timed(items):
        sync()
        t = time.perf_counter()
        out = propose(items)
        sync()
        times.append(time.perf_counter() - t)
        return out
    engine.drafter.propose = timed
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--eagle3")
    ap.add_argument("--draft-model")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--out")
    args = ap.parse_args()
    prompt = [10 + i % 30000 for i in range(200)]
    plain = engine_for(args.model, args.device, None)
    decode(plain, prompt, 32)
    n, seconds, steps = decode(plain, prompt, args.tokens)
    step_ms = 1e3 * seconds / steps
    result = {"plain_tok_s": round(n / seconds, 1), "plain_step_ms": round(step_ms, 3), "k": args.k, "methods": {}}
    print(json.dumps(result), flush=True)
    del plain
    gc.collect()
    torch.cuda.empty_cache() if args.device.startswith("cuda") else None
    for method, path in (("eagle3", args.eagle3), ("draft_model", args.draft_model)):
        if not path:
            continue
        engine = engine_for(args.model, args.device, SpeculativeConfig(
            method=method, model=path, num_speculative_tokens=args.k, disable_by_batch_size=0))
        decode(engine, prompt, 16)
        times = timed_proposals(engine)
        n, seconds, steps = decode(engine, prompt, args.tokens)
        drafted = engine.spec_draft_tokens
        # The first proposal catches the head up on the whole prompt: the steady ones are the rest.
        steady = sorted(times[1:])[:max(1, len(times) - 1)]
        per_token_ms = 1e3 * sum(steady) / len(steady) / args.k
        row = {"tok_s": round(n / seconds, 1), "ms_per_step": round(1e3 * seconds / steps, 3),
               "proposals": len(times), "propose_ms_median": round(1e3 * steady[len(steady) // 2], 3),
               "draft_ms_per_token": round(per_token_ms, 3),
               "per_token_x_plain_step": round(per_token_ms / step_ms, 4),
               "accepted_per_drafted": round(engine.spec_accepted_tokens / max(1, drafted), 3)}
        result["methods"][method] = row
        print(json.dumps({method: row}), flush=True)
        del engine, times
        gc.collect()
        torch.cuda.empty_cache() if args.device.startswith("cuda") else None
    if args.out:
        json.dump(result, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
