"""The real demo model on the GPU: load a GGUF with the serving defaults (Triton kernels, CUDA
graphs, bf16), answer three chat prompts greedily, and print one JSON line (texts, load time)."""

from __future__ import annotations

import json
import sys
import time

import torch

from services.worker.engine.engine import LLMEngine
from services.worker.engine.engine_config import EngineConfig
from shared.sampling_params import SamplingParams
from shared.tokenizer import Tokenizer

QUESTIONS = ["What is the capital of France?", "What color is grass? Answer with one word.",
             "Write a haiku about GPUs."]


def main() -> int:
    path = sys.argv[1]
    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig(model_dir=path, device="cuda", max_num_seqs=256, max_num_batched_tokens=8192))
    torch.cuda.synchronize()
    ready = time.perf_counter() - t0
    tok = Tokenizer.from_path(path)
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=48), tok.eos_token_ids)
    print(json.dumps({"engine_ready_s": round(ready, 3), "load_weights_s": round(engine.load_seconds, 3),
                      "dtype": str(engine.dtype), "kernels": engine.ops.name,
                      "answers": [tok.decode(o) for o in outs]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
