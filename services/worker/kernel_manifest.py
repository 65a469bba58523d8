"""The Triton kernel variants a worker compiles, recorded once, then compiled ahead in parallel.

A worker's first start on a machine with an empty Triton cache compiles ~47 kernel variants for an
8B model, one after another (~1.3 s each on an H200 host: 68 s of `inferno warm-kernels`, 2026-11-29),
while the host has 16+ cores. The variants depend on the model's shapes, the flags and the GPU, not
on the weights, so a start records each variant's specialization (Triton's own serialization, as its
`JITFunction.preload` reads it) into a manifest; a later start on a machine without the cache (a new
node, container or autoscaled replica) hands the manifest to helper processes that compile every
variant side by side into the cache while the worker imports torch and reads its weights, and the
worker's own compiles become cache loads. Compiling needs no GPU (Triton's wheel ships ptxas), so
the helpers make no CUDA context and take no GPU memory.

`--kernel-manifest PATH` on the worker (a file beside the model on a shared volume, say): replayed at
start when it exists, written (merged) once the worker has settled. `inferno warm-kernels
--kernel-manifest PATH` records one; `python -m services.worker.kernel_manifest PATH --jobs N` replays
one. A variant that cannot be rebuilt is skipped: the worker compiles it itself, as without a manifest.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

FORMAT = "inferno-kernel-manifest-v1"

_lock = threading.Lock()
_recorded: dict[str, dict] = {}  # specialization data → its entry, in the order compiled


def note(fn, compile: dict | None) -> None:
    """One compile (a jit_cache_hook's `fn` and `compile` arguments): recorded once."""
    data = (compile or {}).get("specialization_data")
    module, name = getattr(fn, "module", None), getattr(fn, "name", None)
    if not isinstance(data, str) or not isinstance(module, str) or not isinstance(name, str):
        return
    with _lock:
        _recorded.setdefault(data, {"module": module, "name": name, "data": data})


def recorded() -> list[dict]:
    with _lock:
        return list(_recorded.values())


def install_recorder() -> bool:
    """Record compiles from now on where no other hook is installed (CompileWatch records too, and
    replaces this one once a model is attached). False where Triton has no hooks."""
    try:
        from triton import knobs
        runtime = knobs.runtime
    except (ImportError, AttributeError):
        return False
    if runtime.jit_cache_hook is None:
        def _record(*args, **kwargs) -> bool:
            note(kwargs.get("fn"), kwargs.get("compile"))
            return False  # compile as usual
        runtime.jit_cache_hook = _record
    return True


def current_target() -> dict:
    from triton.runtime import driver
    target = driver.active.get_current_target()
    return {"backend": target.backend, "arch": target.arch, "warp_size": target.warp_size}


def read(path: str | Path) -> dict | None:
    """The manifest at path, or None where there is none (or it is not one of ours)."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and doc.get("format") == FORMAT else None


def write(path: str | Path, entries: list[dict], target: dict) -> int:
    """Merge entries into the manifest at path (one per triton version and target; another's is
    replaced); returns how many entries it holds. Written whole, then renamed into place."""
    import triton
    doc = read(path)
    if doc is None or doc.get("triton") != triton.__version__ or doc.get("target") != target:
        doc = {"format": FORMAT, "triton": triton.__version__, "target": target, "kernels": []}
    known = {e["data"] for e in doc["kernels"]}
    doc["kernels"] += [e for e in entries if e["data"] not in known]
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=0))
    tmp.replace(path)
    return len(doc["kernels"])


def _tuples(value):
    """JSON gave lists where Triton had tuples (never lists in a kernel signature)."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def _rebuild(entry: dict):
    """(the JITFunction, signature, constexprs, attrs, options) of one entry, as preload decodes them."""
    import importlib

    import triton.language as tl

    fn = importlib.import_module(entry["module"])
    for part in entry["name"].split("."):
        fn = getattr(fn, part)
    while not hasattr(fn, "params") and hasattr(fn, "fn"):  # an autotuner or heuristics wraps the JITFunction
        fn = fn.fn
    data = json.loads(entry["data"])

    def constant(value):
        if isinstance(value, str) and tl.dtype.is_dtype(value):
            return tl.dtype(value)
        if isinstance(value, dict) and "constexpr" in value:
            return tl.constexpr(_tuples(value["constexpr"]))
        if isinstance(value, dict):
            raise ValueError(f"a constant Triton cannot rebuild here: {value}")
        return _tuples(value)

    constexprs = {tuple(k): constant(v) for k, v in zip(data["constant_keys"], data["constant_vals"])}
    attrs = dict(zip(map(tuple, data["attrs_keys"]), data["attrs_vals"]))
    signature = {k: _tuples(v) for k, v in data["signature"].items()}
    options = {k: _tuples(v) for k, v in data["options"].items()}
    return fn, signature, constexprs, attrs, options


def compile_entries(entries: list[dict], target: dict) -> tuple[int, list[str]]:
    """Compile each entry into Triton's cache (a helper process's share): (compiled, failures)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    gpu = GPUTarget(target["backend"], target["arch"], target["warp_size"])
    backend = make_backend(gpu)
    done, failed = 0, []
    for entry in entries:
        try:
            fn, signature, constexprs, attrs, options = _rebuild(entry)
            # As JITFunction._do_compile: the options parsed by the backend, then compiled again from
            # their dict, so the cache key is the one the worker's own launch computes.
            parsed = backend.parse_options(options)
            triton.compile(ASTSource(fn, signature, constexprs, attrs), target=gpu, options=parsed.__dict__)
            done += 1
        except Exception as e:  # the worker compiles this one itself
            failed.append(f"{entry.get('module')}.{entry.get('name')}: {type(e).__name__}: {e}")
    return done, failed


def precompile(path: str | Path, jobs: int) -> dict:
    """Every variant of the manifest at path compiled into the cache, over `jobs` processes."""
    import triton
    t0 = time.perf_counter()
    doc = read(path)
    if doc is None:
        return {"compiled": 0, "failed": [], "seconds": 0.0, "skipped": "no manifest"}
    if doc.get("triton") != triton.__version__:
        return {"compiled": 0, "failed": [], "seconds": 0.0,
                "skipped": f"recorded with triton {doc.get('triton')}, this is {triton.__version__}"}
    entries = doc["kernels"]
    jobs = max(1, min(jobs, len(entries)))
    # Round robin: a kernel's variants (often the slow ones) spread over the processes.
    shares = [entries[i::jobs] for i in range(jobs)]
    done, failed = 0, []
    if jobs == 1:
        done, failed = compile_entries(entries, doc["target"])
    else:
        with ProcessPoolExecutor(jobs, mp_context=get_context("spawn")) as pool:
            for d, f in pool.map(compile_entries, shares, [doc["target"]] * jobs):
                done, failed = done + d, failed + f
    return {"compiled": done, "failed": failed, "seconds": round(time.perf_counter() - t0, 2), "jobs": jobs}


def default_jobs() -> int:
    """Most cores, some left to the worker's own start (imports, the weights' read)."""
    return max(1, min(16, (os.cpu_count() or 2) - 2))


def start_precompile(path: str | Path, jobs: int | None = None, report=None) -> subprocess.Popen | None:
    """The replay in a process of its own, started now; the caller never waits for it. A thread
    reaps it and hands its result line to `report` (None: no manifest at path)."""
    if read(path) is None:
        return None
    cmd = [sys.executable, "-m", "services.worker.kernel_manifest", str(path), "--jobs", str(jobs or default_jobs())]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)

    def reap() -> None:
        out, _ = proc.communicate()
        if report is not None:
            try:
                report(json.loads(out.strip().splitlines()[-1]))
            except (ValueError, IndexError):
                report({"exit": proc.returncode})
    threading.Thread(target=reap, name="kernel-manifest", daemon=True).start()
    return proc


def replay_at_start(path: str, device: str) -> subprocess.Popen | None:
    """A GPU process's start: the manifest's variants compiled beside it, if there is one."""
    if not path or not device.startswith("cuda"):
        return None
    import structlog
    log = structlog.get_logger("worker.kernels")
    proc = start_precompile(path, report=lambda result: log.info("kernel manifest compiled", manifest=path, **result))
    if proc is not None:
        log.info("kernel manifest replayed beside the start", manifest=path, jobs=default_jobs(), pid=proc.pid)
    return proc


def save(path: str) -> int | None:
    """This process's recorded variants merged into the manifest at path; None where nothing was
    recorded or the file cannot be written (a read-only volume: the next start compiles as before)."""
    entries = recorded()
    if not path or not entries:
        return None
    try:
        return write(path, entries, current_target())
    except OSError as e:
        import structlog
        structlog.get_logger("worker.kernels").warning("kernel manifest not written", manifest=path, error=str(e))
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Compile a kernel manifest's variants into Triton's cache.")
    ap.add_argument("manifest")
    ap.add_argument("--jobs", type=int, default=default_jobs())
    args = ap.parse_args(argv)
    result = precompile(args.manifest, args.jobs)
    print(json.dumps({**result, "failed": result["failed"][:5], "failed_count": len(result["failed"])}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
