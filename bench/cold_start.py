"""W5: process start → engine ready → first token, for a model directory on the GPU.

Run as a fresh process with START_NS set by the shell just before (`START_NS=$(date +%s%N)`), so
interpreter start and imports count too.
"""

from __future__ import annotations

import json
import os
import sys
import time

t_proc = int(os.environ.get("START_NS", time.time_ns())) / 1e9

import torch  # noqa: E402

from services.worker.engine.engine import LLMEngine  # noqa: E402
from services.worker.engine.engine_config import EngineConfig  # noqa: E402
from shared.sampling_params import SamplingParams  # noqa: E402


def main() -> int:
    model_dir = sys.argv[1]
    max_num_seqs = int(sys.argv[2]) if len(sys.argv) > 2 else 256
    t_import = time.time()
    engine = LLMEngine(EngineConfig(model_dir=model_dir, device="cuda", max_num_seqs=max_num_seqs,
                                    max_num_batched_tokens=8192))
    torch.cuda.synchronize()
    t_ready = time.time()
    engine.generate([list(range(100, 228))], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    t_first = time.time()
    print(json.dumps({
        "imports_s": t_import - t_proc, "load_weights_s": engine.load_seconds,
        "graph_capture_s": engine.graph_capture_seconds, "start_to_ready_s": t_ready - t_proc,
        "start_to_first_token_s": t_first - t_proc, "memory": engine.memory_report,
        "max_num_seqs": max_num_seqs,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
