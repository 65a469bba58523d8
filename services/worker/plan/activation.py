"""The dry run's activation peak (gpu_memory.dry_run_peak_bytes), estimated from the widths of a step."""

from __future__ import annotations

import torch

from services.worker.engine.engine_config import EngineConfig
from services.worker.engine.model_config import ModelConfig
from services.worker.engine.parallel.layout import ParallelLayout
from services.worker.engine.sampler import LOGPROB_ROWS

# The sampling kernels' per-row scratch: two [rows, block_v] buffers (fp32 and int32) with block_v at
# most 2,048 (kernels/sampling.py, sample and _block_v).
SAMPLER_ROW_BYTES = 2048 * 8

# Measured on an H200 (nvidia-h200, 2026-11-29: the worker's build_model up to its "kv pool sized from
# memory", random weights), activation_peak_gib against these formulas:
#   llama-3.1-8b, 8,192 tokens, 1,024 rows:   1.1252 against forward 1.1250
#   llama-3.1-8b, 16,384 tokens, 512 rows:    2.2504 against forward 2.2500
#   llama-3.1-8b, 2,048 tokens, 256 rows:     0.3229 against head 0.3214
#   qwen3-30b-a3b, 8,192 tokens, 1,024 rows:  0.7561 against head 0.7557
#   mixtral-8x7b, 8,192 tokens, 1,024 rows:   1.0941 against forward 1.0939
#   olmoe-1b-7b, 8,192 tokens, 1,024 rows:    0.6884 against 0.6880
# Over, on the safe side: with --quantization fp8 the MLP's SiLU output is written in e4m3 (8B: 1.0168,
# 0.11 under this); qwen2-57b-a14b 1.4470 against 2.1416, since mlp_activation_width adds its 20,480-wide
# shared expert to the routed experts' rows, which are freed before it runs.

def forward_peak_bytes(rank_config: ModelConfig, tokens: int, dtype: torch.dtype) -> int:
    """A layer's live activations for `tokens` tokens at its widest: q, k, v and the attention's output
    beside them (mixed_graph_bytes's 2 q + 2 kv, gpu_memory.py), the MLP's activation width
    (ModelConfig.mlp_activation_width) and five hidden-sized buffers (the last layer's output and
    residual stream, this one's, the norm's output), six in an MoE layer (fused_moe's sum is a buffer of
    its own)."""
    c = rank_config
    hidden_buffers = 6 if c.moe is not None else 5
    width = 2 * c.q_size + 2 * c.kv_size + c.mlp_activation_width + hidden_buffers * c.hidden_size
    return tokens * width * dtype.itemsize


def head_peak_bytes(model_config: ModelConfig, layout: ParallelLayout, tokens: int, rows: int,
                    dtype: torch.dtype) -> int:
    """The dry run's head: the last hidden states kept ([tokens, hidden]) and the logits of `rows` rows in
    the model's dtype; with tensor parallelism the rank's slice, the gathered columns and their rank-major
    reorder live at once (tensor_parallel.all_gather_columns). Then the log-probabilities, LOGPROB_ROWS
    rows at a time (sampler.log_probs): each chunk's fp32 copy and log_softmax, and the chunk before's
    log_softmax until the new one replaces it; and the sampler's scratch."""
    vocab = model_config.vocab_size
    logits = rows * vocab * dtype.itemsize
    gather = logits * (2 + 1 / layout.tp) if layout.tp > 1 else logits
    chunk = min(rows, LOGPROB_ROWS) * vocab * 4
    log_probs = chunk * (3 if rows > LOGPROB_ROWS else 2)
    draw = logits + max(log_probs, rows * SAMPLER_ROW_BYTES)
    return tokens * model_config.hidden_size * dtype.itemsize + int(max(gather, draw))


def activation_peak_bytes(model_config: ModelConfig, layout: ParallelLayout, config: EngineConfig,
                          dtype: torch.dtype) -> int:
    """The larger of the forward's and the head's peaks; a pipeline stage before the last has no head."""
    tokens = config.max_num_batched_tokens
    forward = forward_peak_bytes(layout.local_config(model_config), tokens, dtype)
    if not layout.is_last_stage:
        return forward
    rows = min(config.max_num_seqs, tokens)
    return max(forward, head_peak_bytes(model_config, layout, tokens, rows, dtype))
