"""`inferno warm-kernels`: every kernel a worker compiles at start, compiled ahead into Triton's cache.

A worker's first start on a fresh machine or container compiles its Triton kernels (tens of seconds
for an 8B model on an H200), every later start finds them in the cache (TRITON_CACHE_DIR, else
~/.triton/cache). This runs the worker's own start-up path, with the worker's flags and random weights
drawn on the device (no weights are read), to its end: the KV sizing's dry run, the sampler's
variants and every CUDA graph (the ones a worker compiles and captures after it is ready too), then exits. The
same flags compile the same kernels, so run it with the flags the workers will have (device, dtype,
--max-num-seqs, --max-num-batched-tokens, --kv-cache-dtype, --quantization, ...), into the cache
directory the workers mount. With --kernel-manifest PATH it also records the variants into PATH (and
replays PATH's first, if it exists): a worker given that PATH on a machine without the cache compiles
them side by side (services/worker/kernel_manifest.py).
"""

from __future__ import annotations

import sys
import time


def main(argv: list[str] | None = None) -> int:
    from services.worker.main import overlap_default, parse_args, service_config
    from services.worker.model_build import ModelSpec, build_model, check_model, release_model

    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    if not args.model_dir:
        print("inferno warm-kernels: --model-dir is required (the model whose shapes to compile for)", file=sys.stderr)
        return 2
    args.load_format = "dummy"  # the kernels depend on the shapes, not the values
    cfg, _ = service_config(args)
    from services.worker import kernel_manifest
    helpers = kernel_manifest.replay_at_start(cfg.kernel_manifest, cfg.device)  # a manifest's variants, side by side
    if cfg.kernel_manifest and cfg.device.startswith("cuda"):
        kernel_manifest.install_recorder()
    cache = kernel_manifest.triton_cache_dir()
    before = sum(1 for _ in cache.rglob("*")) if cache.is_dir() else 0
    t0 = time.perf_counter()
    checked = check_model(ModelSpec.of(cfg, cfg.model_dir, cfg.model_name), cfg)
    built = build_model(checked, cfg, cuda_graphs=not args.no_cuda_graphs,
                        overlap=overlap_default(args.overlap, cfg.device))
    if built.graphs is not None:  # the graphs a worker captures on its step thread once it serves
        while built.graphs.capture_next():
            pass
    sampler = getattr(built.engine, "sampler", None)
    if sampler is not None:  # the kernels a worker's sampler compiles on a thread once it serves
        sampler.wait_warm()
    seconds = time.perf_counter() - t0
    release_model(built, cfg)
    if helpers is not None:
        helpers.proc.wait()
    if cfg.kernel_manifest and cfg.device.startswith("cuda"):
        held = kernel_manifest.save(cfg.kernel_manifest)
        print(f"inferno warm-kernels: {len(kernel_manifest.recorded())} kernel variants compiled or loaded, "
              f"manifest {cfg.kernel_manifest}: {held} in all", flush=True)
    after = sum(1 for _ in cache.rglob("*")) if cache.is_dir() else 0
    print(f"inferno warm-kernels: {checked.spec.model_name} on {cfg.device} in {seconds:.1f} s; Triton's cache "
          f"{cache}: {after - before} new files, {after} in all", flush=True)
    return 0
