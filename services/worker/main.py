"""Worker entry point: flags → config → logging → NATS → the model (--model-dir, or later over the
admin subjects) → serve → drain on SIGTERM.

Before anything heavy is imported, threads start reading --model-dir's weight files into the page
cache (prefetch.py) and making the CUDA context and the loader's pinned staging through the driver
(cuda_early.py); torch, cuBLAS and the kernels warm up in a thread while NATS connects."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time

import structlog

from services.worker.kernel_manifest import manifest_path
from shared import hop_trace
from shared.config import (CONFIG_ERROR_EXIT, NatsConfig, WorkerServiceConfig, add_nats_tls_flags, env_default,
                           nats_tls_settings, parse_bool)
from shared.logging import setup_logging
from shared.nats_client import connect_nats


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="inferno worker", description="Run one Inferno worker (one GPU or the CPU).")
    ap.add_argument("--nats-url", default=env_default("INFERNO_NATS_URL", "nats://127.0.0.1:4222"))
    add_nats_tls_flags(ap)
    ap.add_argument("--subject-prefix", default=env_default("INFERNO_SUBJECT_PREFIX", "inferno"))
    ap.add_argument("--worker-id", default=env_default("INFERNO_WORKER_ID", None))
    ap.add_argument("--role", choices=["mixed", "prefill", "decode"], default=env_default("INFERNO_ROLE", "mixed"))
    ap.add_argument("--model-dir", action="append", default=None,
                    help="the model to serve from the start (env INFERNO_MODEL_DIR); repeated, several models on "
                         "this GPU, each in a share of it (--memory-share); without it the worker waits for one "
                         "over its admin subject (inferno load-model)")
    ap.add_argument("--model-name", action="append", default=None,
                    help="the id the model is served as (default: the directory's name); repeated, the names of "
                         "the --model-dir models in their order")
    ap.add_argument("--memory-share", action="append", type=float, default=None,
                    help="several models: the GPU's fraction each may hold on it, weights and KV pool together, "
                         "in the --model-dir order (default: --gpu-memory-utilization split equally); models "
                         "that do not fit wait in standby and are loaded at their first request, evicting "
                         "the least recently used idle ones")
    ap.add_argument("--host-memory-gb", type=float, default=env_default("INFERNO_HOST_MEMORY_GB", 0.0, float),
                    help="pinned host memory for the weights of evicted models, which then come back without "
                         "reading the disk (default 0: read again)")
    ap.add_argument("--model-idle-timeout", type=float, default=env_default("INFERNO_MODEL_IDLE_TIMEOUT", 0.0, float),
                    help="seconds without a request after which a model leaves the GPU (scale to zero; its next "
                         "request brings it back); default 0: never")
    ap.add_argument("--device", default=env_default("INFERNO_DEVICE", "cpu"))
    ap.add_argument("--dtype", default=env_default("INFERNO_DTYPE", "auto"))
    ap.add_argument("--quantization", "-q", choices=["fp8"], default=env_default("INFERNO_QUANTIZATION", None),
                    help="fp8: the layers' projections in e4m3 with per-channel scales, activations per token "
                         "(half the weight bytes, fp8 tensor cores; env INFERNO_QUANTIZATION)")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8", "fp8_e4m3"],
                    default=env_default("INFERNO_KV_CACHE_DTYPE", "auto"),
                    help="auto: the model's dtype; fp8 (e4m3, unscaled): twice the tokens in the pool, half the "
                         "attention reads, at fp8 precision for K and V (env INFERNO_KV_CACHE_DTYPE)")
    ap.add_argument("--num-blocks", type=int, default=env_default("INFERNO_NUM_BLOCKS", None, int))
    ap.add_argument("--gpu-memory-utilization", type=float, default=env_default("INFERNO_GPU_MEMORY_UTILIZATION", 0.98))
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=env_default("INFERNO_MAX_NUM_SEQS", None, int),
                    help="most requests running at once (default: 1024 with a GPU, as vLLM's on 80 GB parts: "
                         "the batch the KV pool holds; 256 on the CPU)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=env_default("INFERNO_MAX_NUM_BATCHED_TOKENS", 8192))
    ap.add_argument("--chunked-prefill-size", type=int,
                    default=env_default("INFERNO_CHUNKED_PREFILL_SIZE", None, int),
                    help="most prompt tokens in one step, all requests together (SGLang's flag); default: "
                         "512 for the decode role, so its own prefills keep its steps short, else "
                         "--max-num-batched-tokens")
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--no-cuda-graphs", action="store_true")
    ap.add_argument("--overlap", action=argparse.BooleanOptionalAction,
                    default=env_default("INFERNO_OVERLAP", None, parse_bool),
                    help="plan and launch step N+1 before reading step N's tokens (default: on with a GPU, "
                         "where it measures better, off on the CPU)")
    ap.add_argument("--kv-transfer-host", default=env_default("INFERNO_KV_TRANSFER_HOST", "127.0.0.1"),
                    help="decode role: the address prefill workers reach this worker's UCXX listener at")
    ap.add_argument("--handoff-timeout", type=float, default=10.0,
                    help="seconds a prefill → decode hand-off may take; past it the decode worker computes the "
                         "request's KV itself (a recompute), and the request fails only if it cannot")
    ap.add_argument("--grammar-compile-timeout", type=float,
                    default=float(env_default("INFERNO_GRAMMAR_COMPILE_TIMEOUT", "10")),
                    help="seconds a structured output's grammar may take to compile; past it the request fails "
                         "with a 400 and the worker serves on (default 10)")
    ap.add_argument("--jump-forward", type=int, default=int(env_default("INFERNO_JUMP_FORWARD", "0")), metavar="N",
                    help="structured outputs: check up to N tokens the grammar forces (a fixed key, a closing "
                         "brace) in one forward against the model's own draws, the answer unchanged; such "
                         "requests do not overlap their steps (default 0: off)")
    ap.add_argument("--speculative-config", default=env_default("INFERNO_SPECULATIVE_CONFIG", ""), metavar="JSON",
                    help='speculative decoding, vLLM\'s keys: {"method": "ngram", "num_speculative_tokens": 4, '
                         '"prompt_lookup_min": 2, "prompt_lookup_max": 4, "disable_by_batch_size": 32}, or method '
                         '"draft_model" / "eagle3" with "model": a directory; lossless '
                         '(the answers are those without it); default: off')
    ap.add_argument("--handoff-push", action=argparse.BooleanOptionalAction,
                    default=env_default("INFERNO_HANDOFF_PUSH", True, parse_bool),
                    help="decode role on a GPU: prefill workers of this host write the prompt's KV into this "
                         "worker's receive slots over CUDA IPC; --no-handoff-push: this worker copies it out "
                         "of theirs")
    ap.add_argument("--handoff-ipc", action=argparse.BooleanOptionalAction,
                    default=env_default("INFERNO_HANDOFF_IPC", True, parse_bool),
                    help="prefill/decode roles on GPUs of one host: pages move over CUDA IPC; --no-handoff-ipc: "
                         "as bytes over UCXX, as between hosts (UCX_TLS picks the transport)")
    ap.add_argument("--handoff-staging", choices=["auto", "host", "off"],
                    default=env_default("INFERNO_HANDOFF_STAGING", "auto"),
                    help="hand-off pages through host memory where UCX would move GPU memory over TCP: "
                         "auto (when UCX_TLS has no CUDA IPC or RDMA transport, or the peer is on another host "
                         "without RDMA), host (always), off")
    ap.add_argument("--kernel-manifest", default=env_default("INFERNO_KERNEL_MANIFEST", "auto"), metavar="PATH",
                    help="GPU: the Triton kernel variants this worker compiles, recorded into PATH once it settles; "
                         "when PATH exists at start, helper processes compile them all side by side while the "
                         "worker loads (a fresh machine's start with an empty Triton cache); auto (the default): "
                         ".inferno-kernels.json beside the model, where every replica finds it; off: none")
    ap.add_argument("--kvstore", choices=["auto", "on", "off"], default=env_default("INFERNO_KVSTORE", "auto"),
                    help="auto: a GPU worker fetches prefixes from the cluster KV store when one answers and "
                         "that beats recomputing, a CPU worker does not use it; on: fetch too, and write every "
                         "prompt block to it")
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
    ap.add_argument("--enable-expert-parallel", action="store_true",
                    default=env_default("INFERNO_ENABLE_EXPERT_PARALLEL", False, parse_bool),
                    help="mixture-of-experts models: spread whole experts over the tensor-parallel GPUs "
                         "(each token's experts computed where they live, summed by the all-reduce) "
                         "instead of splitting every expert over all of them")
    ap.add_argument("--custom-all-reduce", action=argparse.BooleanOptionalAction,
                    default=env_default("INFERNO_CUSTOM_ALL_REDUCE", True, parse_bool),
                    help="tensor parallelism on GPUs: small all-reduces in one kernel over the peers' memory "
                         "(CUDA IPC), larger ones through NCCL; --no-custom-all-reduce: NCCL for all")
    ap.add_argument("--fused-all-reduce-norm", action=argparse.BooleanOptionalAction,
                    default=env_default("INFERNO_FUSED_ALL_REDUCE_NORM", True, parse_bool),
                    help="tensor parallelism with the one-shot all-reduce: the residual add and RMSNorm after "
                         "each all-reduce in the same kernel (default; --no-fused-all-reduce-norm: two kernels)")
    ap.add_argument("--heartbeat-interval", type=float, default=1.0)
    ap.add_argument("--drain-timeout", type=float, default=30.0)
    ap.add_argument("--gateway-ttl", type=float, default=15.0,
                    help="seconds without a gateway's heartbeat after which its requests here are ended")
    ap.add_argument("--emit-only", action="store_true", help="model-free token emitter: serving-overhead benchmark only")
    ap.add_argument("--emit-step-seconds", type=float, default=0.0,
                    help="with --emit-only: seconds per step, e.g. 0.015 for a GPU's batch-256 decode (one token "
                         "per request per step, as there); 0 emits as fast as it can")
    ap.add_argument("--gil-switch-interval-ms", type=float,
                    default=env_default("INFERNO_GIL_SWITCH_INTERVAL_MS", None, float),
                    help="how long the step thread may run Python before the event loop (hand-offs, tokens "
                         "out) gets the interpreter (sys.setswitchinterval; Python's default is 5 ms)")
    ap.add_argument("--log-format", choices=["console", "json"], default=env_default("INFERNO_LOG_FORMAT", "console"))
    ap.add_argument("--log-level", default="INFO")
    return ap.parse_args(argv)


async def serve(cfg: WorkerServiceConfig, nats_cfg: NatsConfig, cuda_graphs: bool, overlap: bool = False,
                started: float | None = None, prefetch=None, early=None, more_models=()) -> int:
    """Connect, answer heartbeats and the admin subjects, load --model-dir if given, serve until
    SIGTERM, drain. `started`: the process's start (wall clock), where a start-up load's breakdown
    counts from. `early`: the device context and staging made while torch imported (cuda_early.py).
    `more_models`: (dir, name, share) of the models beside the first (services/worker/model_host.py)."""
    from services.worker.gateway_watch import GatewayWatch
    from services.worker.model_build import ModelSpec, warm_device
    from services.worker.model_host import ModelHost

    log = structlog.get_logger("worker")
    # torch, the device and the kernels warm up in a thread while NATS connects.
    warm = asyncio.ensure_future(asyncio.to_thread(warm_device, cfg, early))
    gateways = GatewayWatch(cfg.gateway_ttl)
    conn = await connect_nats(nats_cfg, name=cfg.worker_id, on_state=gateways.on_bus_state)
    await gateways.attach(conn, nats_cfg.subject_prefix)
    host = ModelHost(cfg, conn, nats_cfg.subject_prefix, cuda_graphs, overlap, warm, gateways)
    manager = (await host.start()).manager
    later = [await host.register(ModelSpec.of(cfg, d, n), share) for d, n, share in more_models]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    code = 0
    if cfg.model_dir:
        spec = ModelSpec.of(cfg, cfg.model_dir, cfg.model_name)
        load = asyncio.ensure_future(manager.load(spec, started or time.time(), at_start=True, prefetch=prefetch))
        await asyncio.wait([load, asyncio.ensure_future(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
        if load.done() and not load.result().ok:
            reply = load.result()
            log.error("cannot serve the model", model_dir=cfg.model_dir, error=reply.error)
            stop.set()
            # A model its flags cannot serve (ModelCheckError): starting again would fail again.
            code = CONFIG_ERROR_EXIT if reply.code == "bad_request" else 1
    for slot in later if not stop.is_set() else ():
        await host.load_at_start(slot)
    await stop.wait()
    log.info("draining", timeout=cfg.drain_timeout)
    await host.drain(cfg.drain_timeout)
    await host.close()
    await conn.drain()
    return code


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging("worker", json=args.log_format == "json", level=args.log_level)
    hop_trace.enable("worker")
    try:
        cfg, more_models = service_config(args)
        nats_cfg = NatsConfig(url=args.nats_url, subject_prefix=args.subject_prefix, **nats_tls_settings(args))
        if args.gil_switch_interval_ms is not None and not args.gil_switch_interval_ms > 0:
            raise ValueError("--gil-switch-interval-ms must be above 0")
        if cfg.model_dir and cfg.tensor_parallel_size * cfg.pipeline_parallel_size > 1:
            from services.worker.engine.model_config import ModelConfig
            from services.worker.model_build import check_parallel
            # From the model's config alone, before NATS, torch or any rank: a shape that does not split.
            check_parallel(ModelConfig.from_path(cfg.model_dir), cfg)
    except ValueError as e:  # the config's own checks, the model's config and ModelCheckError alike
        structlog.get_logger("worker").error("bad_config", error=str(e))
        return CONFIG_ERROR_EXIT
    if more_models or cfg.memory_share:
        # Several models on one GPU: an evicted model's freed memory is cut up at once by the others'
        # activations, and a whole segment stays reserved for a few live blocks: the 8B's way back could
        # not allocate its pool with 31 GiB reserved and free (H200). Expandable segments unmap the free
        # pages instead. Set before torch is imported (its allocator reads it once).
        # Pinned host memory (the --host-memory-gb arena at start, an eviction's copy past it) is
        # pinned by threads (malloc, then cudaHostRegister), not cudaHostAlloc's ~1.1 GB/s: the
        # driver's lock, held while it pins, stalls the other models' launches (a 1B's ITL p99 526 ms
        # against 2.0 quiet while an 8B went to the host, 17.5 with threads; engine/pinned_arena.py).
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True,"
                              "pinned_use_cuda_host_register:True,pinned_num_register_threads:8")
    from services.worker.kernel_manifest import replay_at_start
    replay_at_start(cfg.kernel_manifest, cfg.device)  # kernels compile beside the imports and the weights' read
    prefetch = None
    if cfg.model_dir and args.load_format == "auto" and not args.emit_only:
        from services.worker.prefetch import start_prefetch
        prefetch = start_prefetch(cfg.model_dir)  # the drive reads while torch is imported
    early = None
    if (args.tensor_parallel_size * args.pipeline_parallel_size == 1 and not args.emit_only
            and os.environ.get("INFERNO_EARLY_DEVICE", "1") != "0"):
        from services.worker.cuda_early import STAGING_BYTES, start_early_device
        from services.worker.model_build import staging_count
        # The driver makes the context and the loader's pinned buffers while torch is imported.
        early = start_early_device(args.device, staging_count(), STAGING_BYTES)
    if args.gil_switch_interval_ms is not None:
        sys.setswitchinterval(args.gil_switch_interval_ms / 1000)
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    code = asyncio.run(serve(cfg, nats_cfg, cuda_graphs=not args.no_cuda_graphs,
                             overlap=overlap_default(args.overlap, cfg.device), started=process_started_at(),
                             prefetch=prefetch, early=early, more_models=more_models))
    if cfg.tensor_parallel_size * cfg.pipeline_parallel_size > 1 and cfg.device.startswith("cuda"):
        # The group has stopped; NCCL communicators that graphs captured can hang the interpreter's
        # teardown, so the process ends here, as its other ranks do.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def model_list(args) -> list[tuple[str, str, float]]:
    """(dir, name, share) of each --model-dir, in order (ValueError when the flags do not line up)."""
    dirs = args.model_dir or [d for d in [env_default("INFERNO_MODEL_DIR", "")] if d]
    names = args.model_name or [n for n in [env_default("INFERNO_MODEL_NAME", "")] if n]
    shares = args.memory_share or []
    if len(names) > max(len(dirs), 1) or len(shares) > max(len(dirs), 1):
        raise ValueError("--model-name and --memory-share name the --model-dir models in order: "
                         "no more of them than models")
    if len(dirs) > 1 and (args.role != "mixed" or args.tensor_parallel_size * args.pipeline_parallel_size > 1):
        raise ValueError("several models on one worker need role mixed on one GPU (no tensor or pipeline "
                         "parallelism, no prefill/decode roles) for now")
    if any(not 0.0 < s < 1.0 for s in shares):
        raise ValueError("--memory-share must be in (0, 1)")
    default = args.gpu_memory_utilization / len(dirs) if len(dirs) > 1 else 0.0
    out = []
    for i, d in enumerate(dirs or [""]):
        out.append((d, names[i] if i < len(names) else "", shares[i] if i < len(shares) else default))
    return out


def service_config(args) -> tuple[WorkerServiceConfig, list[tuple[str, str, float]]]:
    """The flags as the worker's config and the models beside its first (ValueError when they cannot
    work together)."""
    (first_dir, first_name, first_share), *more = model_list(args)
    kwargs = dict(role=args.role, model_dir=first_dir, model_name=first_name, memory_share=first_share,
                  host_memory_gb=args.host_memory_gb, model_idle_timeout=args.model_idle_timeout, device=args.device,
                  dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization,
                  num_blocks=args.num_blocks, gpu_memory_utilization=args.gpu_memory_utilization,
                  block_size=args.block_size, max_num_seqs=max_num_seqs_default(args.max_num_seqs, args.device),
                  max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                  chunked_prefill_size=args.chunked_prefill_size,
                  heartbeat_interval=args.heartbeat_interval, drain_timeout=args.drain_timeout,
                  gateway_ttl=args.gateway_ttl,
                  emit_only=args.emit_only, emit_step_seconds=args.emit_step_seconds,
                  transfer_host=args.kv_transfer_host, handoff_timeout=args.handoff_timeout,
                  grammar_compile_timeout=args.grammar_compile_timeout, jump_forward=args.jump_forward,
                  speculative_config=args.speculative_config, handoff_push=args.handoff_push,
                  handoff_ipc=args.handoff_ipc, handoff_staging=args.handoff_staging, kvstore=args.kvstore,
                  kernel_manifest=manifest_path(args.kernel_manifest, first_dir, args.device),
                  load_format=args.load_format, tensor_parallel_size=args.tensor_parallel_size,
                  pipeline_parallel_size=args.pipeline_parallel_size, custom_all_reduce=args.custom_all_reduce,
                  fused_all_reduce_norm=args.fused_all_reduce_norm, enable_expert_parallel=args.enable_expert_parallel)
    if args.worker_id:
        kwargs["worker_id"] = args.worker_id
    if args.speculative_config:
        from services.worker.engine.speculative import SpeculativeConfig
        SpeculativeConfig.from_json(args.speculative_config)  # ValueError naming what is wrong, before any load
    return WorkerServiceConfig(**kwargs), more


def process_started_at() -> float | None:
    """When the kernel started this process (wall clock, 10 ms resolution), so a start-up load's
    breakdown counts the interpreter and the imports too; None where /proc cannot tell."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime, in clock ticks after boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def max_num_seqs_default(flag, device: str) -> int:
    """--max-num-seqs wins; else 1024 on a GPU (H100, 2026-11-23: W2 28.3k tok/s with 1024 running
    and 16k-token steps against 20.1k at 256: decode steps are memory-bound, so a larger batch costs
    little more per step), 256 on the CPU."""
    return flag if flag is not None else (1024 if device.startswith("cuda") else 256)


def overlap_default(flag, device: str) -> bool:
    """--overlap / --no-overlap / INFERNO_OVERLAP win; else on for a GPU (H100, 2026-11-22: W1 164.8 vs
    151.7-156.3 tok/s, W2 28.3k vs 20.1k with larger batches), off for the CPU."""
    return device.startswith("cuda") if flag is None else bool(flag)
