"""Engine settings: which model, where it runs, how large the KV pool and the batches are."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model_dir: str
    device: str = "cpu"
    dtype: str | None = None  # None: config.json's torch_dtype (float32 on the CPU)
    # "auto": the KV cache in the model's dtype; "fp8" (= "fp8_e4m3"): half the bytes per token,
    # so twice the tokens in the pool and half the attention reads (vLLM's --kv-cache-dtype fp8).
    kv_cache_dtype: str = "auto"
    # "fp8": the layers' projections in e4m3 with per-channel scales, activations quantized per
    # token (vLLM's --quantization fp8 for a 16-bit checkpoint); None: as loaded.
    quantization: str | None = None
    kernels: str | None = None  # "torch" | "triton"; None: triton on CUDA, torch elsewhere
    block_size: int = 16
    num_blocks: int | None = None  # CPU: the pool size; GPU: None sizes the pool from memory
    gpu_memory_utilization: float = 0.98
    # One of several models on the GPU (services/worker/model_host.py): the device's fraction this
    # model may take, its weights, activations, graphs and KV pool together; 0: the whole device's.
    memory_share: float = 0.0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    long_prefill_token_threshold: int = 0
    chunked_prefill_size: int = 0  # most prompt tokens a step (SchedulerConfig); 0: the step budget
    enable_prefix_caching: bool = True
    cuda_graphs: bool = True
    # Plan and launch step N+1 before reading step N's tokens, so the host work hides behind
    # the GPU's. Off by default until it has been measured on the GPU (it is CPU-tested).
    overlap: bool = False
    # Jump-forward: at most this many tokens a structured output's grammar forces are checked in one
    # forward against the model's own draws (0: off). Such requests do not overlap their steps.
    jump_forward: int = 0
    # Speculative decoding (speculative.SpeculativeConfig: n-gram prompt lookup), or None.
    speculative: Any = None
    max_graph_len: int = 4096  # decode steps with longer contexts run eagerly
    mixed_graphs: bool = True  # steps with prefill chunks (up to 2,048 tokens) replay graphs too
    # The sampler's kernel variants compiled on a thread once the engine is made, draws exact with
    # sample_ref meanwhile (the worker's start: sampler_warmup.py); False: compiled before it returns.
    warm_sampler_later: bool = False
    load_threads: int = 8
    seed: int = 0
    cache_key: str = ""  # the model's identity in block hashes (the served name); "" = model_dir
    load_format: str = "auto"  # "dummy": random weights drawn on the device, no files read
    tensor_parallel_size: int = 1  # processes (GPUs) each layer is split over
    pipeline_parallel_size: int = 1  # stages the layers are split into, one per process group
    enable_expert_parallel: bool = False  # MoE: whole experts spread over the tensor-parallel ranks
    custom_all_reduce: bool = True  # small tensor-parallel all-reduces over peer memory (GPUs), else NCCL
    # The one-shot all-reduce does the residual add and RMSNorm after it too (one kernel for two):
    # W1 +3.5 % with 8B TP=2, +1.7 % with 70B TP=4 (four H100s, 2026-11-27, bench/fused_norm_ab.sh at 9243543).
    fused_all_reduce_norm: bool = True
    # KV tokens of GPU memory kept out of the pool for hand-off buffers (a prefill worker's pages
    # on their way out, a decode worker's on their way in); 0: none (mixed workers).
    handoff_buffer_tokens: int = 0

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError("block_size must be a power of two")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError("num_blocks must be positive")
        if not 0.05 <= self.gpu_memory_utilization <= 0.99:
            raise ValueError("gpu_memory_utilization must be in [0.05, 0.99]")
        if not 0.0 <= self.memory_share < 1.0:
            raise ValueError("memory_share must be in [0, 1)")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.kernels not in (None, "torch", "triton"):
            raise ValueError("kernels must be torch or triton")
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1:
            raise ValueError("tensor_parallel_size and pipeline_parallel_size must be at least 1")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"quantization must be fp8 or none, got {self.quantization!r}")
        if self.handoff_buffer_tokens < 0:
            raise ValueError("handoff_buffer_tokens must not be negative")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError("load_format must be auto or dummy")

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def kernel_backend(self) -> str:
        return self.kernels or ("triton" if self.is_cuda else "torch")

    @property
    def drafts(self) -> bool:
        """Some steps check drafts of a few tokens (mixed_graphs.DRAFT_BUCKETS)."""
        return self.jump_forward > 0 or self.speculative is not None
