"""Sizes the KV pool from the GPU memory left after a dry run of the largest step."""

from __future__ import annotations

import math
import time

import structlog
import torch

from services.worker.engine.attention_metadata import AttentionMetadata
from services.worker.engine.kv_cache import CacheLayout, KVCache, kv_bytes_per_block
from services.worker.engine.kv_export import handoff_buffer_blocks
from services.worker.engine.residency import model_bytes
from services.worker.engine.sampler import log_probs
from services.worker.engine.sampler_warmup import draw_exact
from services.worker.kernels.extend_attention import query_tiles
from services.worker.kernels.sampling import workspace_bytes
from shared.sampling_params import MAX_TOP_LOGPROBS

log = structlog.get_logger("worker.memory")

# The decode graphs' pool and allocator slack (the mixed graphs share that pool: mixed_graph_bytes).
# Measured at 8B on the H100 (2026-11-27, the "graphs captured" log): with 512 MiB here, 2.57 GiB free
# and 0.61 cached once every graph was captured, i.e. ~0.54 GiB beyond the utilisation's share and the
# largest eager step's activations; 384 MiB hands 0.125 of it to the KV pool. With 384 MiB and 1,024
# sequences (42 graphs; 2026-11-28): 2.24 GiB free and 0.77 cached, 0.66 GiB beyond the share; 320 MiB
# hands 0.0625 more to the pool.
GRAPH_RESERVE_BYTES = 320 << 20


def one_prompt_metadata(tokens: int, n_blocks: int, device) -> AttentionMetadata:
    """A step of one prompt of `tokens` tokens whose KV fills blocks 0, 1, ... in order."""
    return AttentionMetadata(
        slot_mapping=torch.arange(tokens, device=device),
        block_tables=torch.arange(n_blocks, dtype=torch.int32, device=device)[None],
        seq_lens=torch.tensor([tokens], dtype=torch.int32, device=device),
        query_start_loc=torch.tensor([0, tokens], dtype=torch.int32, device=device),
        max_query_len=tokens, max_seq_len=tokens,
        # The tiled launch, as every eager step has (step_inputs.py): its kernel variant is
        # compiled by the dry run, before ready, not by the first request's step.
        tiles=torch.from_numpy(query_tiles([tokens])).to(device=device, dtype=torch.int32))


@torch.inference_mode()
def dry_run_peak_bytes(engine, seconds: dict | None = None) -> int:
    """Activation bytes of the largest step: max_num_batched_tokens tokens, max_num_seqs logits rows.
    `seconds` receives the time of its parts (the forward; the head, draw and log-probabilities),
    each the first launch of its kernels in the process: a start's KV phase is mostly this."""
    cfg, mc, device = engine.config, engine.model_config, engine.device
    seconds = {} if seconds is None else seconds
    t0 = time.perf_counter()
    tokens = cfg.max_num_batched_tokens
    n_blocks = math.ceil(tokens / cfg.block_size) + 1
    scratch = KVCache(engine.rank_config, n_blocks, cfg.block_size, engine.kv_dtype, device)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    meta = one_prompt_metadata(tokens, n_blocks, device)
    ids = torch.randint(0, mc.vocab_size, (tokens,), device=device)
    # Two layers (the model's forward stops with the caches it is given): activations live within a
    # layer, only the residual stream crosses, so the first two (the first has no residual yet) peak
    # as the whole model does, in 1/16 of the 8B's GPU time (~0.2 s of a start). A parallel group's
    # ranks (shards, stages) run every layer, as before.
    layers = scratch.layers if engine.group is not None else scratch.layers[:2]
    hidden = engine.model(ids, torch.arange(tokens, device=device), layers, meta)
    torch.cuda.synchronize()
    seconds["dry_forward_s"] = time.perf_counter() - t0
    draw_bytes = 0
    if hidden is not None:  # None on a pipeline stage before the last: no logits there
        rows = min(cfg.max_num_seqs, tokens)
        logits = engine.model.compute_logits(hidden[:rows])
        f = torch.ones(rows, device=device)
        # The draw as it is before the sampler's kernels are compiled (sampler_warmup.py), with top-p
        # (its sort) on every row; the kernels' own buffers, counted, not compiled here (16 s of an
        # empty cache's start): they come beside the logits too.
        zeros = torch.zeros(rows, dtype=torch.int64, device=device)
        draw_exact(logits, f, zeros, f * 0.9, f * 0, zeros, zeros)
        draw_bytes = workspace_bytes(rows, logits.shape[1], device)
        log_probs(logits, torch.zeros(rows, dtype=torch.int64, device=device), MAX_TOP_LOGPROBS)  # every row asks
        del logits
    torch.cuda.synchronize()
    seconds["dry_head_s"] = time.perf_counter() - t0 - seconds["dry_forward_s"]
    peak = torch.cuda.max_memory_allocated(device) - base + draw_bytes
    # Every reference to the scratch pool goes before the cache is emptied: `layers` (views of its
    # one buffer) kept the whole of it (1 GiB at 8B) cached, lost to the KV pool (H100, 2026-11-28).
    del scratch, layers, hidden, meta, ids
    torch.cuda.empty_cache()
    return peak


def mixed_graph_bytes(engine) -> int:
    """The graph pool's share for mixed-step graphs: one step's activations at their largest
    bucket (q, k, v, attention out, gate/up, SiLU and a few hidden-sized buffers per token)."""
    if not engine.config.mixed_graphs or not CacheLayout.of(engine.rank_config).graphs_mixed_steps:
        return 0
    from services.worker.engine.mixed_graphs import MAX_GRAPH_TOKENS
    mc = engine.rank_config
    tokens = min(engine.config.max_num_batched_tokens, MAX_GRAPH_TOKENS)
    per_token = 2 * mc.q_size + 2 * mc.kv_size + mc.mlp_activation_width + 4 * mc.hidden_size
    return tokens * per_token * engine.dtype.itemsize


def profile_kv_blocks(engine) -> int:
    device = engine.device
    seconds: dict = {}
    activation_peak = dry_run_peak_bytes(engine, seconds)
    free, total = torch.cuda.mem_get_info(device)
    # CUDA context, weights, other models' memory; not what the allocator holds free (an evicted
    # model's, left cached beside others: model_build.evict_model), which this pool may take.
    in_use = total - free - (torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    # What torch's allocator holds (the weights, the rope table); the rest of in_use is outside it:
    # the CUDA context, cuBLAS workspaces, loaded kernels, and any other process on the GPU.
    reserved = torch.cuda.memory_reserved(device)
    # The sampler's warm-up, when it compiles beside the first steps (sampler_warmup.py), holds its own.
    warm_bytes = engine.sampler.warm_reserve_bytes()
    overheads = activation_peak + GRAPH_RESERVE_BYTES + mixed_graph_bytes(engine) + warm_bytes
    budget = int(total * engine.config.gpu_memory_utilization) - in_use - overheads
    share = engine.config.memory_share
    if share:  # one of several models on the GPU: its own weights and overheads within its share too
        budget = min(budget, int(total * share) - model_bytes(engine.model) - overheads)
    per_block = kv_bytes_per_block(engine.rank_config, engine.config.block_size, engine.kv_dtype)
    handoff = handoff_buffer_blocks(engine.config) * per_block
    per_block += engine.draft_block_bytes  # a drafting model's KV of each page (model_drafter.py)
    blocks = max(0, (budget - handoff) // per_block)
    engine.memory_report = {
        "total_gib": total / 2**30, "in_use_gib": in_use / 2**30, "torch_reserved_gib": reserved / 2**30,
        "outside_torch_gib": (in_use - reserved) / 2**30, "activation_peak_gib": activation_peak / 2**30,
        "handoff_buffer_gib": handoff / 2**30, "sampler_warm_gib": warm_bytes / 2**30,
        "kv_gib": blocks * per_block / 2**30, "kv_blocks": blocks, "kv_tokens": blocks * engine.config.block_size,
        **seconds,
    }
    log.info("kv pool sized from memory", **{k: round(v, 2) for k, v in engine.memory_report.items()})
    if blocks < 1:
        raise RuntimeError(f"no GPU memory left for the KV cache ({engine.memory_report})")
    return blocks
