"""One GPU's memory as the worker will size it: what profile_kv_blocks subtracts, and the KV pool left."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from services.worker.engine.engine_config import EngineConfig
from services.worker.engine.gpu_memory import GRAPH_RESERVE_BYTES, mixed_graph_bytes
from services.worker.engine.kv_cache import kv_bytes_per_block, kv_cache_dtype
from services.worker.engine.kv_export import handoff_buffer_blocks
from services.worker.engine.model_config import ModelConfig
from services.worker.engine.parallel.layout import ParallelLayout
from services.worker.plan.activation import activation_peak_bytes
from services.worker.plan.weights import rank_weights, rope_bytes

# The worker's in_use beyond the model's tensors: the CUDA context, cuBLAS's workspaces (32 MiB, in torch's
# allocator), loaded kernels. H200 (nvidia-h200, 2026-11-29, the worker's "kv pool sized from memory" with
# random weights; 8B, Qwen3-30B-A3B and Mixtral alike): outside_torch_gib 0.6707 and torch_reserved_gib
# 0.033 above the tensors. H100, 8B (bench/results/s11_w5a_dropped_h100.json, an older commit): 0.74
# outside torch; RESULTS.md: 0.74-0.80 over several starts.
CONTEXT_BYTES = int(0.70 * 2**30)
# A rank of a parallel group adds NCCL's communicators (their buffers lie outside torch) and the one-shot
# all-reduce's buffer (custom_all_reduce.py: 8 MiB for two ranks). Fitted to bench-engine's kv_gib on H100s
# (its max_num_seqs 1; fused_norm_w1_h100x4_267eaf0.json): 70B TP=2 8.14, TP=4 41.44, 8B TP=2 66.65 GiB per
# GPU, where the plan gives 8.16, 41.52, 67.26 (+0.3, +0.2, +0.9 %); at older commits 70B PP=2 on H100s 5.0
# (plan 5.21), TP=2 on H200s 67.7 (plan 67.57).
GROUP_BYTES = int(0.90 * 2**30)


@dataclass(frozen=True, slots=True)
class EngineShape:
    """What gpu_memory's helpers read of an engine (config, rank_config, dtype), without one."""

    config: EngineConfig
    rank_config: ModelConfig
    dtype: torch.dtype


@dataclass(frozen=True, slots=True)
class RankMemory:
    """Bytes of one rank's GPU. `budget` is what profile_kv_blocks has left for the pool and the hand-off
    buffer; kv_blocks what the rank would allocate (the group takes the least over its ranks)."""

    rank: int
    stage: int
    layers: tuple[int, int]  # [first, last + 1) of the whole model's
    total: int
    usable: int  # total × gpu_memory_utilization
    weights: int
    load_peak: int  # what the load holds at once: the weights, or with fp8 the 16-bit ones and their copies
    # In use beyond the tensors: the CUDA context and what lies outside torch, NCCL's in a group, the
    # allocator's slack after fp8 quantization.
    context: int
    activation_peak: int
    graph_reserve: int  # GRAPH_RESERVE_BYTES + mixed_graph_bytes
    handoff: int
    kv_block_bytes: int
    kv_blocks: int
    block_size: int
    loads: bool  # the load's peak fits beside the context

    @property
    def budget(self) -> int:
        return self.usable - self.weights - self.context - self.activation_peak - self.graph_reserve

    @property
    def kv_tokens(self) -> int:
        return self.kv_blocks * self.block_size

    @property
    def kv_bytes(self) -> int:
        return self.kv_blocks * self.kv_block_bytes

    @property
    def fits(self) -> bool:
        return self.kv_blocks >= 1  # profile_kv_blocks raises below one block

    def shortfall(self) -> str:
        """Why the rank cannot serve ('' when it can)."""
        if self.fits:
            return ""
        if not self.loads and self.load_peak > self.weights:
            return (f"rank {self.rank} cannot load: fp8 quantizes the loaded 16-bit weights, "
                    f"{gib(self.load_peak)} GiB with the quantization's copies, on a {gib(self.total)} GiB GPU")
        if not self.loads:
            return f"rank {self.rank} cannot load {gib(self.weights)} GiB of weights on a {gib(self.total)} GiB GPU"
        need = self.weights + self.context + self.activation_peak + self.graph_reserve + self.handoff
        return (f"rank {self.rank} needs {gib(need + self.kv_block_bytes)} GiB for weights "
                f"{gib(self.weights)}, context {gib(self.context)}, activations {gib(self.activation_peak)}, "
                f"graphs {gib(self.graph_reserve)}, hand-off {gib(self.handoff)} and one KV block; "
                f"{gib(self.usable)} GiB usable ({gib(self.total)} GiB × gpu_memory_utilization)")

    def as_dict(self) -> dict:
        return {**asdict(self), "layers": list(self.layers), "budget": self.budget, "kv_tokens": self.kv_tokens,
                "kv_bytes": self.kv_bytes, "fits": self.fits}


def gib(n: int) -> str:
    return f"{n / 2**30:.2f}"


def rank_memory(model_config: ModelConfig, layout: ParallelLayout, config: EngineConfig, total: int) -> RankMemory:
    """profile_kv_blocks's figures for `layout`'s rank (layout.rank) on a GPU of `total` bytes."""
    dtype = serving_dtype(config, model_config)
    rank_config = layout.local_config(model_config)
    shape = EngineShape(config, rank_config, dtype)
    held = rank_weights(rank_config, dtype, config.quantization == "fp8")
    longest = model_config.max_model_len
    rope = rope_bytes(model_config, min(longest, (config.max_model_len or longest) + 64))  # as loader.load_model
    context = CONTEXT_BYTES + (GROUP_BYTES if layout.world_size > 1 else 0)
    loads = held.load_peak + rope + context <= total
    context += held.fp8_slack
    activation = activation_peak_bytes(model_config, layout, config, dtype)
    usable = int(total * config.gpu_memory_utilization)
    budget = usable - held.tensors - rope - context - activation - GRAPH_RESERVE_BYTES - mixed_graph_bytes(shape)
    per_block = kv_bytes_per_block(rank_config, config.block_size, kv_cache_dtype(config.kv_cache_dtype, dtype))
    handoff = handoff_buffer_blocks(config) * per_block
    return RankMemory(
        rank=layout.rank, stage=layout.stage, layers=layout.layer_range(model_config.num_hidden_layers),
        total=total, usable=usable, weights=held.tensors + rope, load_peak=held.load_peak + rope, context=context,
        activation_peak=activation, graph_reserve=GRAPH_RESERVE_BYTES + mixed_graph_bytes(shape), handoff=handoff,
        kv_block_bytes=per_block, kv_blocks=max(0, (budget - handoff) // per_block) if loads else 0,
        block_size=config.block_size, loads=loads)


def serving_dtype(config: EngineConfig, model_config: ModelConfig) -> torch.dtype:
    """The engine's rule on a GPU (LLMEngine): the flag, else config.json's torch_dtype."""
    return getattr(torch, config.dtype or model_config.torch_dtype, torch.bfloat16)
