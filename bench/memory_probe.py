"""What GPU memory a worker's engine holds when it sizes the KV pool, beyond the weights.

Builds the engine as the worker does (8B, 1,024 sequences, 8,192-token steps) and, just before
the pool is sized (gpu_memory.profile_kv_blocks), prints: the driver's in-use memory, torch's
reserved and allocated bytes, the parameters' and buffers' bytes, and every live allocation that
is not a parameter or buffer (address, size), with the caching allocator's segments by stream.

Usage: python3 bench/memory_probe.py MODEL [MAX_NUM_SEQS] [MAX_NUM_BATCHED_TOKENS]
"""

from __future__ import annotations

import json
import sys
from collections import Counter

import torch

from services.worker.engine import gpu_memory
from services.worker.engine.engine import LLMEngine
from services.worker.engine.engine_config import EngineConfig

GIB = 2**30


def breakdown(engine, label: str) -> dict:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info(engine.device)
    tensors = list(engine.model.parameters()) + list(engine.model.buffers())
    ptrs = {t.untyped_storage().data_ptr() for t in tensors}
    own = sum(t.untyped_storage().nbytes() for t in {t.untyped_storage().data_ptr(): t for t in tensors}.values())
    others, segments, partly_free = [], Counter(), []
    for seg in torch.cuda.memory_snapshot():
        segments[(seg["stream"], seg["segment_type"])] += seg["total_size"]
        addr = seg["address"]
        mine = []
        for block in seg["blocks"]:
            if block["state"] == "active_allocated" and addr not in ptrs:
                others.append((addr, block["size"]))
                mine.append(round(block["size"] / 2**20, 2))
            addr += block["size"]
        if seg["allocated_size"] < seg["total_size"] or mine:  # a segment with free room, or a non-weight block
            partly_free.append({"segment_mib": round(seg["total_size"] / 2**20, 2),
                                "allocated_mib": round(seg["allocated_size"] / 2**20, 2),
                                "blocks": [(b["state"][:6], round(b["size"] / 2**20, 2)) for b in seg["blocks"]][:8]})
    others.sort(key=lambda b: -b[1])
    out = {
        "at": label, "in_use_gib": (total - free) / GIB,
        "reserved_gib": torch.cuda.memory_reserved() / GIB, "allocated_gib": torch.cuda.memory_allocated() / GIB,
        "weights_and_buffers_gib": own / GIB,
        "other_allocated_gib": sum(s for _, s in others) / GIB,
        "largest_other_allocations_mib": [round(s / 2**20, 2) for _, s in others[:15]],
        "n_other_allocations": len(others),
        "segments_gib_by_stream": {f"{k[0]}/{k[1]}": round(v / GIB, 3) for k, v in segments.items()},
        "segments_with_free_room_or_other_blocks": partly_free[:12],
    }
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}), flush=True)
    return out


def main() -> int:
    model = sys.argv[1]
    seqs = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
    tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 8192
    sizing = gpu_memory.profile_kv_blocks

    def probed(engine):
        breakdown(engine, "before the dry run")
        blocks = sizing(engine)
        breakdown(engine, "after the dry run")
        return blocks

    gpu_memory.profile_kv_blocks = probed
    engine = LLMEngine(EngineConfig(model_dir=model, device="cuda", max_num_seqs=seqs, max_num_batched_tokens=tokens,
                                    overlap=True))
    breakdown(engine, "engine built (graphs captured)")
    print("memory report:", json.dumps({k: round(v, 3) if isinstance(v, float) else v
                                        for k, v in engine.memory_report.items()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
