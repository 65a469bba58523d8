"""What a worker serves, built from a model directory: checked first (a bad directory never costs the
model in place), then the engine — weights, KV pool, CUDA graphs staged around ready — reusing what
the previous model left where it fits, each part timed for the load breakdown (W5).

Every function here runs off the event loop (asyncio.to_thread): they import torch, touch the
device and take seconds.
"""

from __future__ import annotations

import gc
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import structlog

from services.worker.engine.cuda_device import bind_thread, holding_device
from shared.config import WorkerServiceConfig

log = structlog.get_logger("worker.build")

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


class ModelCheckError(ValueError):
    """The model named cannot be served here; the message says why (the worker keeps what it had)."""


def default_model_name(model_dir: str) -> str:
    """The served id when none is given: the directory's name (a .gguf file's, less the suffix)."""
    return Path(model_dir).name.removesuffix(".gguf") or "model"


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """One model to serve: where it is, the id it is served as, and its per-model settings."""

    model_dir: str
    model_name: str
    dtype: str = "auto"
    max_model_len: int | None = None
    load_format: str = "auto"

    @classmethod
    def of(cls, cfg: WorkerServiceConfig, model_dir: str, model_name: str = "", dtype: str = "",
           max_model_len: int = 0, load_format: str = "") -> "ModelSpec":
        """Settings left empty (or 0) take the worker's flags."""
        return cls(model_dir, model_name or default_model_name(model_dir), dtype or cfg.dtype,
                   max_model_len or cfg.max_model_len, load_format or cfg.load_format)


@dataclass(frozen=True, slots=True)
class CheckedModel:
    spec: ModelSpec
    model_config: object  # ModelConfig
    eos_token_ids: tuple[int, ...]
    kv_shape: tuple  # (layers, planes, heads, dim, dtype): KV pools of one shape are interchangeable
    weight_bytes: int


def check_model(spec: ModelSpec, cfg: WorkerServiceConfig) -> CheckedModel:
    """Everything that can be wrong with a model before its memory is needed: the path, config.json
    (a supported architecture), the tokenizer, and every weight tensor's presence and shape (the
    safetensors headers). Raises ModelCheckError."""
    path = Path(spec.model_dir)
    if not path.exists():
        raise ModelCheckError(f"{path}: no such model directory or .gguf file")
    try:
        from services.worker.engine.model_config import ModelConfig
        from shared.gguf_file import is_gguf
        from shared.tokenizer import Tokenizer

        model_config = ModelConfig.from_path(path)
        eos = tuple(Tokenizer.from_path(path).eos_token_ids)
        single = cfg.tensor_parallel_size * cfg.pipeline_parallel_size == 1
        if spec.load_format == "auto" and not cfg.emit_only and single and not is_gguf(path):
            from services.worker.engine.loader import plan_load
            plan_load(path, model_config)  # headers only: names, shapes and dtypes of every tensor
    except ModelCheckError:
        raise
    except Exception as e:  # each reader raises its own kind; all mean "not this model"
        raise ModelCheckError(f"{path}: {e}") from e
    check_parallel(model_config, cfg)
    dtype = serving_dtype(spec, model_config, cfg.device)
    kv_dtype = dtype if cfg.kv_cache_dtype == "auto" else "float8_e4m3fn"
    from services.worker.engine.kv_cache import CacheLayout
    layout = CacheLayout.of(model_config)
    shape = (model_config.num_hidden_layers, layout.planes, layout.heads, layout.dim, kv_dtype)
    return CheckedModel(spec, model_config, eos, shape, _weight_bytes(model_config, dtype))


def check_parallel(model_config, cfg: WorkerServiceConfig) -> None:
    """The model splits over the worker's group (its heads, KV heads and MLP over the tensor-parallel
    ranks, its layers over the stages); ModelCheckError saying why not."""
    if cfg.tensor_parallel_size * cfg.pipeline_parallel_size == 1:
        return
    from services.worker.engine.parallel.layout import ParallelConfigError, ParallelLayout

    try:
        ParallelLayout(cfg.tensor_parallel_size, cfg.pipeline_parallel_size,
                       expert_parallel=cfg.enable_expert_parallel).check(model_config)
    except ParallelConfigError as e:
        raise ModelCheckError(str(e)) from None


def serving_dtype(spec: ModelSpec, model_config, device: str) -> str:
    """The engine's rule (LLMEngine): the flag, else config.json's on a GPU and float32 on the CPU."""
    if spec.dtype != "auto":
        return spec.dtype
    return model_config.torch_dtype if device.startswith("cuda") else "float32"


def _weight_bytes(model_config, dtype: str) -> int:
    from services.worker.engine.loader import expected_tensors

    elems = sum(math.prod(p.shape) for p in expected_tensors(model_config).values())
    return elems * DTYPE_BYTES.get(dtype, 2)


@dataclass(slots=True)
class Leftovers:
    """What an unloaded model leaves for the next one: its KV pool (when the next model's KV has
    the same shape and its weights are no larger, so the pool's share of memory is still free for
    it) and its graphs' memory pool."""

    kv_cache: object | None = None
    graphs: object | None = None  # staged_graphs.GraphMemory


@dataclass(slots=True)
class HostCopy:
    """An evicted model kept in (pinned) host memory: its built DecoderLM, ready to move back, and
    the KV blocks its pool had, so the way back sizes nothing (services/worker/model_host.py)."""

    model: object
    num_blocks: int
    nbytes: int
    span: tuple[int, int] | None = None  # its place in the worker's PinnedArena, if it has one
    arena: object | None = None

    def release(self) -> None:
        """Give its pinned memory back (its model is on the GPU again, or the copy is dropped)."""
        if self.span is not None:
            self.arena.give(self.span)
            self.span = None


@dataclass(slots=True)
class BuiltModel:
    checked: CheckedModel
    engine: object
    max_model_len: int
    graphs: object | None = None  # staged_graphs.StagedGraphs: what is left to capture after ready
    timings: dict = field(default_factory=dict)


@dataclass(slots=True)
class WarmDevice:
    """What warm_device leaves every load: when its parts were done (wall clock, for the load
    breakdown; the driver thread's report too), and the loader's pinned staging (None off the GPU)."""

    marks: dict
    staging: object | None = None  # engine.loader.StagingPool, filled
    arena: object | None = None  # engine.pinned_arena.PinnedArena for evicted models (--host-memory-gb)


def warm_device(cfg: WorkerServiceConfig, early=None) -> WarmDevice:
    """Before any model: import torch and the engine (its kernels), create the CUDA context and a
    cuBLAS handle, and fill a pool of pinned staging buffers for the loads, so a load pays none of
    it. `early` (cuda_early.EarlyDevice): the context and buffers the driver made while torch
    imported."""
    import torch

    from services.worker.engine import engine  # noqa: F401  (the model, kernels and Triton with it)
    from services.worker.engine.loader import StagingPool
    from services.worker.kernels import triton_setup

    marks = {"imported_at": time.time()}
    staging = arena = None
    if cfg.device.startswith("cuda") and not cfg.emit_only:
        device = torch.device(cfg.device)
        staging = StagingPool()
        if early is not None:
            staging.adopt(early.buffers())
            marks.update(early.report())
        bind_thread(device)
        torch.empty(1, device=device)
        marks["context_at"] = time.time()
        a = torch.ones(64, 64, device=device, dtype=torch.bfloat16)
        (a @ a).sum().item()
        marks["cublas_at"] = time.time()
        staging.fill(staging_count())
        torch.cuda.synchronize(device)
        if cfg.kernel_manifest:  # every compile from the first on, for the manifest written once settled
            from services.worker.kernel_manifest import install_recorder
            install_recorder()
        triton_setup.start(device)  # beside the load that follows; the engine waits for it after
        if cfg.host_memory_gb > 0:  # before any model serves: pinning later stalls the others' launches
            from services.worker.engine.pinned_arena import PinnedArena
            t = time.perf_counter()
            arena = PinnedArena(int(cfg.host_memory_gb * 1e9))
            log.info("pinned arena", gb=round(arena.nbytes / 1e9, 2), seconds=round(time.perf_counter() - t, 3))
    marks["device_at"] = time.time()
    return WarmDevice(marks, staging, arena)


def staging_count() -> int:
    """The loader's pinned staging buffers: two per loading thread (a disk read into one overlaps
    the DMA out of the other)."""
    from services.worker.engine.engine_config import EngineConfig

    return 2 * EngineConfig(model_dir="").load_threads


@holding_device
def build_model(checked: CheckedModel, cfg: WorkerServiceConfig, cuda_graphs: bool, overlap: bool,
                leftovers: Leftovers | None = None, staging=None, host: HostCopy | None = None) -> BuiltModel:
    """The engine of a checked model. A single-GPU engine captures only the graphs needed before
    ready (staged_graphs.py); the rest are the step thread's to capture. `staging`: the worker's
    pinned buffers for the weights' copies (WarmDevice.staging). `host`: the model's own copy in host
    memory (an eviction kept it), moved back instead of read from disk.

    One of several models on the GPU (a memory share) is built on a stream of its own: on the
    default stream, which every thread of the process shares, each of its launches (a 46 GB pool's
    memset, the graphs' warm-up forwards) would queue the other models' steps behind it."""
    if cfg.memory_share and cfg.device.startswith("cuda") and not cfg.emit_only:
        import torch
        with torch.cuda.stream(torch.cuda.Stream(torch.device(cfg.device))):
            return _build_model(checked, cfg, cuda_graphs, overlap, leftovers, staging, host)
    return _build_model(checked, cfg, cuda_graphs, overlap, leftovers, staging, host)


def _build_model(checked: CheckedModel, cfg: WorkerServiceConfig, cuda_graphs: bool, overlap: bool,
                 leftovers: Leftovers | None, staging, host: HostCopy | None) -> BuiltModel:
    spec, mc = checked.spec, checked.model_config
    leftovers = leftovers or Leftovers()
    if cfg.emit_only:
        from services.worker.emitter import TokenEmitter
        max_len = min(spec.max_model_len or mc.max_model_len, mc.max_model_len)
        return BuiltModel(checked, TokenEmitter(mc.vocab_size, max_len, cfg.emit_step_seconds), max_len)
    import torch

    from services.worker.engine.engine import LLMEngine
    from services.worker.engine.engine_config import EngineConfig
    from services.worker.engine.speculative import SpeculativeConfig
    from services.worker.engine.staged_graphs import StagedGraphs

    bind_thread(cfg.device)  # a pool thread: the sampler's warm-up and the graphs launch Triton kernels
    t0 = time.perf_counter()
    single = cfg.tensor_parallel_size * cfg.pipeline_parallel_size == 1
    staged = cuda_graphs and cfg.device.startswith("cuda") and single
    config = EngineConfig(
        model_dir=spec.model_dir, device=cfg.device, dtype=None if spec.dtype == "auto" else spec.dtype,
        kv_cache_dtype=cfg.kv_cache_dtype, quantization=cfg.quantization,
        block_size=cfg.block_size, num_blocks=cfg.num_blocks,
        gpu_memory_utilization=min(cfg.gpu_memory_utilization, 0.99), memory_share=cfg.memory_share,
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens, max_model_len=spec.max_model_len,
        chunked_prefill_size=chunked_prefill_size(cfg), cuda_graphs=cuda_graphs and not staged, overlap=overlap,
        cache_key=spec.model_name,
        load_format=spec.load_format, tensor_parallel_size=cfg.tensor_parallel_size,
        pipeline_parallel_size=cfg.pipeline_parallel_size, custom_all_reduce=cfg.custom_all_reduce,
        fused_all_reduce_norm=cfg.fused_all_reduce_norm, enable_expert_parallel=cfg.enable_expert_parallel,
        jump_forward=cfg.jump_forward,
        # A prefill worker hands every request on after its first token: nothing to draft there.
        speculative=SpeculativeConfig.from_json(cfg.speculative_config)
        if cfg.speculative_config and cfg.role != "prefill" else None,
        handoff_buffer_tokens=handoff_buffer_tokens(cfg),
        warm_sampler_later=True)  # a first token needs none of the sampler's kernels (sampler_warmup.py)
    kv = leftovers.kv_cache
    if kv is not None:
        kv.pool.zero_()  # as a new pool: padded graph rows read block 0
    model, moved_s = None, 0.0
    if host is not None:
        from services.worker.engine.residency import move_model
        import dataclasses
        t_move = time.perf_counter()
        move_model(host.model, torch.device(cfg.device))
        host.release()
        model, moved_s = host.model, time.perf_counter() - t_move
        config = dataclasses.replace(config, num_blocks=config.num_blocks or host.num_blocks)
    engine = LLMEngine(config, model=model, kv_cache=kv, staging=staging)
    engine.load_seconds += moved_s
    engine_s = time.perf_counter() - t0
    # graphs_s: what is compiled and captured before ready, the sampler's kernel variants included.
    graphs, graphs_s = None, engine.graph_capture_seconds + engine.sampler_warm_seconds
    if staged:
        graphs = StagedGraphs(engine, leftovers.graphs)
        graphs_s += graphs.capture_ready()
        if engine.drafter is not None:  # a drafting model's decode graphs: a few small ones, before ready
            from services.worker.engine.drafting import capture_graphs
            graphs_s += capture_graphs(engine.drafter, config.speculative, config.max_num_seqs,
                                       min(engine.max_model_len, config.max_graph_len))
    elif leftovers.graphs is not None:
        leftovers.graphs.release()
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    weights_gb = sum(p.numel() * p.element_size() for p in engine.model.parameters()) / 1e9
    kv_s = engine_s - engine.load_seconds - engine.graph_capture_seconds - engine.sampler_warm_seconds
    timings = {"weights_s": engine.load_seconds, "weights_gb": weights_gb, "kv_s": kv_s, "kv_reused": kv is not None,
               "graphs_s": graphs_s, "graphs_deferred": len(graphs.backlog) if graphs is not None else 0}
    return BuiltModel(checked, engine, engine.max_model_len, graphs, timings)


def between_steps(built: BuiltModel) -> Callable[[], bool] | None:
    """What the step thread does between two steps once the model serves, one piece a turn, until
    it returns False: the deferred CUDA graphs, a bucket a turn, then the start of the sampler's
    warm-up thread (sampler_warmup.py: after the last capture, which its launches could break)."""
    graphs = built.graphs
    sampler = getattr(built.engine, "sampler", None)
    if (graphs is None or not graphs.backlog) and (sampler is None or sampler.kernels_ready):
        return None

    def turn() -> bool:
        if graphs is not None and graphs.capture_next():
            return True
        if sampler is not None:
            sampler.start_warm_up()
        return False
    return turn


DECODE_PREFILL_CHUNK = 512  # a decode worker's prompt tokens a step, by default


def chunked_prefill_size(cfg: WorkerServiceConfig) -> int:
    """A decode worker prefills a prompt itself when it is short or the prefill workers are backed
    up (the scheduler's queue bound): 512 tokens a step add ~10 ms to its decode steps on an H100
    (8B), where whole 8,192-token steps put its ITL p99 at 1.00 × the mixed workers' (2026-11-27)."""
    if cfg.chunked_prefill_size is not None:
        return cfg.chunked_prefill_size
    return DECODE_PREFILL_CHUNK if cfg.role == "decode" else 0


DECODE_HANDOFF_TOKENS = 16384  # a decode worker's hand-off room at least: the default step budget's two steps


def handoff_buffer_tokens(cfg: WorkerServiceConfig) -> int:
    """GPU memory kept out of a prefill or decode worker's KV pool for the pages of hand-offs in
    flight: two full steps' worth of prompts (a step can end many prompts at once, and their pages
    wait for their sends). Without it the pool took all but 5 MiB of an H100 and 41 of 100 long
    prompts failed to export (2026-11-27). A decode worker's slots take what prefill workers send,
    whatever its own step budget: at least the default's 16,384 tokens (with --max-num-batched-tokens
    512 on the decode worker its slots held 1,024 tokens, so no long prompt was pushed: 0 of 18 of
    2,800+ tokens, 49 of 176 in all; four H100s, 2026-11-27)."""
    if cfg.role == "mixed" or not cfg.device.startswith("cuda"):
        return 0
    tokens = 2 * cfg.max_num_batched_tokens
    return max(tokens, DECODE_HANDOFF_TOKENS) if cfg.role == "decode" else tokens


@holding_device
def evict_model(built: BuiltModel, cfg: WorkerServiceConfig, arena=None) -> HostCopy | None:
    """Free a model's GPU memory, keeping its weights in host memory for the way back (None for the
    model-free emitter, which has none): in `arena` (a PinnedArena) when it has room, else pinned now.
    The model's step thread has stopped."""
    engine = built.engine
    model = getattr(engine, "model", None)
    num_blocks = getattr(getattr(engine, "kv_cache", None), "num_blocks", 0)
    if model is None or engine.group is not None:  # a parallel group's ranks hold their parts elsewhere
        release_model(built, cfg)
        return None
    import torch

    from services.worker.engine.residency import host_tensors, model_bytes, move_model
    on_gpu = engine.device.type == "cuda"
    if on_gpu:
        torch.cuda.synchronize(engine.device)  # its last steps may still read the weights
    del engine  # release_model frees the pool and empties the allocator's cache: no reference may hold it
    span = arena.take(arena.bytes_for(host_tensors(model))) if on_gpu and arena is not None else None
    host_alloc = arena.views(span) if span is not None else None
    nbytes = move_model(model, torch.device("cpu"), host_alloc) if on_gpu else model_bytes(model)
    # Beside other models, emptying the cache (cudaFree: a device-wide sync) would stall their steps;
    # with expandable segments (worker/main.py) the next model's allocations reuse the freed pages, and
    # the allocator empties its cache by itself if an allocation would not fit otherwise.
    release_model(built, cfg, keep_cache="expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
    return HostCopy(model, num_blocks, nbytes, span, arena if span is not None else None)


@holding_device
def release_model(built: BuiltModel, cfg: WorkerServiceConfig, next_model: CheckedModel | None = None,
                  keep_cache: bool = False) -> Leftovers:
    """Free a model's memory, keeping what `next_model` can reuse. The model's step thread has
    stopped; `built` is emptied so no reference keeps its tensors alive. `keep_cache`: leave the freed
    memory in the allocator's cache (the process's next allocations take it)."""
    engine, graphs = built.engine, built.graphs
    built.engine = built.graphs = None
    leftovers = Leftovers()
    if next_model is not None and _kv_fits(engine, built.checked, next_model, cfg):
        leftovers.kv_cache = engine.kv_cache
    if next_model is not None and graphs is not None:
        leftovers.graphs = graphs.graph_memory()
    close = getattr(engine, "close", None)  # the other ranks of a parallel group stop with it
    if close is not None:
        close()
    device = getattr(engine, "device", None)
    if getattr(device, "type", "") == "cuda":
        import torch
        # Its last steps may still run: the next model's weights are copied on other streams.
        torch.cuda.synchronize(device)
    del engine, graphs
    free_memory(device, keep_cache=keep_cache or leftovers.kv_cache is not None)
    return leftovers


def _kv_fits(engine, checked: CheckedModel, next_model: CheckedModel, cfg: WorkerServiceConfig) -> bool:
    kv = getattr(engine, "kv_cache", None)
    if kv is None or not getattr(engine, "holds_whole_kv", False):
        return False
    pool = kv.pool
    shape = (pool.shape[0], pool.shape[1], pool.shape[4], pool.shape[5], str(pool.dtype).removeprefix("torch."))
    # A pool sized from memory left room for its model's weights only.
    return shape == next_model.kv_shape and (cfg.num_blocks is not None
                                             or next_model.weight_bytes <= checked.weight_bytes)


@holding_device
def free_memory(device=None, keep_cache: bool = False) -> None:
    """Collect what nothing references any more (start-up froze it out of the collector's sight:
    shared/gc_tuning.py) and, unless the next model reuses the allocator's cached blocks, hand
    them back to the device, so the next KV pool is sized against the memory truly free."""
    gc.unfreeze()
    gc.collect()
    if getattr(device, "type", "") == "cuda" and not keep_cache:
        import torch
        torch.cuda.empty_cache()
