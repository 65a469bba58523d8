"""Worker entry point: flags → config → logging → engine → NATS → serve → drain on SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import signal
from pathlib import Path

import structlog

from shared.config import NatsConfig, WorkerServiceConfig, env_default, parse_bool
from shared.gc_tuning import tune_gc
from shared.logging import setup_logging
from shared.nats_client import connect_nats


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="inferno worker", description="Run one Inferno worker (one GPU or the CPU).")
    ap.add_argument("--nats-url", default=env_default("INFERNO_NATS_URL", "nats://127.0.0.1:4222"))
    ap.add_argument("--subject-prefix", default=env_default("INFERNO_SUBJECT_PREFIX", "inferno"))
    ap.add_argument("--worker-id", default=env_default("INFERNO_WORKER_ID", None))
    ap.add_argument("--role", choices=["mixed", "prefill", "decode"], default=env_default("INFERNO_ROLE", "mixed"))
    ap.add_argument("--model-dir", default=env_default("INFERNO_MODEL_DIR", ""))
    ap.add_argument("--model-name", default=env_default("INFERNO_MODEL_NAME", ""))
    ap.add_argument("--device", default=env_default("INFERNO_DEVICE", "cpu"))
    ap.add_argument("--dtype", default=env_default("INFERNO_DTYPE", "auto"))
    ap.add_argument("--num-blocks", type=int, default=env_default("INFERNO_NUM_BLOCKS", None, int))
    ap.add_argument("--gpu-memory-utilization", type=float, default=env_default("INFERNO_GPU_MEMORY_UTILIZATION", 0.98))
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=env_default("INFERNO_MAX_NUM_SEQS", None, int),
                    help="most requests running at once (default: 1024 with a GPU, as vLLM's on 80 GB parts: "
                         "the batch the KV pool holds; 256 on the CPU)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=env_default("INFERNO_MAX_NUM_BATCHED_TOKENS", 8192))
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--no-cuda-graphs", action="store_true")
    ap.add_argument("--overlap", action=argparse.BooleanOptionalAction,
                    default=env_default("INFERNO_OVERLAP", None, parse_bool),
                    help="plan and launch step N+1 before reading step N's tokens (default: on with a GPU, "
                         "where it measures better, off on the CPU)")
    ap.add_argument("--kv-transfer-host", default=env_default("INFERNO_KV_TRANSFER_HOST", "127.0.0.1"),
                    help="decode role: the address prefill workers reach this worker's UCXX listener at")
    ap.add_argument("--handoff-timeout", type=float, default=10.0,
                    help="seconds a prefill → decode hand-off may take before the request fails")
    ap.add_argument("--kvstore", choices=["auto", "on", "off"], default=env_default("INFERNO_KVSTORE", "auto"),
                    help="auto: when a cluster KV store answers, fetch prefixes from it when that beats "
                         "recomputing, and (CPU workers) write prompt blocks to it; on: GPU workers write too")
    ap.add_argument("--load-format", choices=["auto", "dummy"], default=env_default("INFERNO_LOAD_FORMAT", "auto"),
                    help="dummy: random weights drawn on the device, no weight files read (benchmarking "
                         "shapes such as 70B from a directory written by make-model --config-only)")
    ap.add_argument("--tensor-parallel-size", "-tp", type=int,
                    default=env_default("INFERNO_TENSOR_PARALLEL_SIZE", 1, int),
                    help="split each layer over this many GPUs (processes started by this worker; "
                         "NCCL on GPUs, gloo on the CPU); the group is one worker to the scheduler")
    ap.add_argument("--pipeline-parallel-size", "-pp", type=int,
                    default=env_default("INFERNO_PIPELINE_PARALLEL_SIZE", 1, int),
                    help="split the layers into this many stages, each on its own tensor-parallel group")
    ap.add_argument("--heartbeat-interval", type=float, default=1.0)
    ap.add_argument("--drain-timeout", type=float, default=30.0)
    ap.add_argument("--emit-only", action="store_true", help="model-free token emitter: serving-overhead benchmark only")
    ap.add_argument("--emit-step-seconds", type=float, default=0.0,
                    help="with --emit-only: seconds per step, e.g. 0.015 for a GPU's batch-256 decode (one token "
                         "per request per step, as there); 0 emits as fast as it can")
    ap.add_argument("--log-format", choices=["console", "json"], default=env_default("INFERNO_LOG_FORMAT", "console"))
    ap.add_argument("--log-level", default="INFO")
    return ap.parse_args(argv)


def build_engine(cfg: WorkerServiceConfig, cuda_graphs: bool, overlap: bool = False):
    """The real engine, or the model-free emitter; returns (engine, eos ids, max_model_len)."""
    from services.worker.engine.model_config import ModelConfig
    from shared.tokenizer import Tokenizer

    model_cfg = ModelConfig.from_path(cfg.model_dir)
    eos = Tokenizer.from_path(cfg.model_dir).eos_token_ids
    if cfg.emit_only:
        from services.worker.emitter import TokenEmitter
        max_len = min(cfg.max_model_len or model_cfg.max_model_len, model_cfg.max_model_len)
        return TokenEmitter(model_cfg.vocab_size, max_len, cfg.emit_step_seconds), eos, max_len
    from services.worker.engine.engine import LLMEngine
    from services.worker.engine.engine_config import EngineConfig

    engine = LLMEngine(EngineConfig(
        model_dir=cfg.model_dir, device=cfg.device, dtype=None if cfg.dtype == "auto" else cfg.dtype,
        block_size=cfg.block_size, num_blocks=cfg.num_blocks,
        gpu_memory_utilization=min(cfg.gpu_memory_utilization, 0.99), max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens, max_model_len=cfg.max_model_len,
        cuda_graphs=cuda_graphs, overlap=overlap, cache_key=cfg.model_name, load_format=cfg.load_format,
        tensor_parallel_size=cfg.tensor_parallel_size, pipeline_parallel_size=cfg.pipeline_parallel_size))
    return engine, eos, engine.max_model_len


async def serve(cfg: WorkerServiceConfig, nats_cfg: NatsConfig, cuda_graphs: bool,
                overlap: bool = False) -> int:
    from services.worker.service import WorkerService

    log = structlog.get_logger("worker")
    engine, eos, max_len = await asyncio.to_thread(build_engine, cfg, cuda_graphs, overlap)
    tune_gc()  # the engine and its model are built: keep them out of every later collection
    conn = await connect_nats(nats_cfg, name=cfg.worker_id)
    service = WorkerService(cfg, conn, engine, nats_cfg.subject_prefix, eos, max_len, cfg.block_size)
    await service.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("draining", timeout=cfg.drain_timeout)
    await service.drain(cfg.drain_timeout)
    await conn.drain()
    close = getattr(engine, "close", None)  # the other ranks of a parallel group stop with it
    if close is not None:
        await asyncio.to_thread(close)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging("worker", json=args.log_format == "json", level=args.log_level)
    model_name = args.model_name or (Path(args.model_dir).name.removesuffix(".gguf") if args.model_dir else "model")
    kwargs = dict(role=args.role, model_dir=args.model_dir, model_name=model_name, device=args.device,
                  dtype=args.dtype, num_blocks=args.num_blocks, gpu_memory_utilization=args.gpu_memory_utilization,
                  block_size=args.block_size, max_num_seqs=max_num_seqs_default(args.max_num_seqs, args.device),
                  max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                  heartbeat_interval=args.heartbeat_interval, drain_timeout=args.drain_timeout,
                  emit_only=args.emit_only, emit_step_seconds=args.emit_step_seconds,
                  transfer_host=args.kv_transfer_host, handoff_timeout=args.handoff_timeout, kvstore=args.kvstore,
                  load_format=args.load_format, tensor_parallel_size=args.tensor_parallel_size,
                  pipeline_parallel_size=args.pipeline_parallel_size)
    if args.worker_id:
        kwargs["worker_id"] = args.worker_id
    cfg = WorkerServiceConfig(**kwargs)
    nats_cfg = NatsConfig(url=args.nats_url, subject_prefix=args.subject_prefix)
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    return asyncio.run(serve(cfg, nats_cfg, cuda_graphs=not args.no_cuda_graphs,
                             overlap=overlap_default(args.overlap, cfg.device)))


def max_num_seqs_default(flag, device: str) -> int:
    """--max-num-seqs wins; else 1024 on a GPU (H100, 2026-11-23: W2 28.3k tok/s with 1024 running
    and 16k-token steps against 20.1k at 256: decode steps are memory-bound, so a larger batch costs
    little more per step), 256 on the CPU."""
    return flag if flag is not None else (1024 if device.startswith("cuda") else 256)


def overlap_default(flag, device: str) -> bool:
    """--overlap / --no-overlap / INFERNO_OVERLAP win; else on for a GPU (H100, 2026-11-22: W1 164.8 vs
    151.7-156.3 tok/s, W2 28.3k vs 20.1k with larger batches), off for the CPU."""
    return device.startswith("cuda") if flag is None else bool(flag)
