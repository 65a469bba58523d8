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

Triton does not wait for another process's compile: a worker that reaches a variant first compiles it
itself (the helpers alone took 22 s for 47 variants on an H200 host; the worker reached most of them
sooner, 40.5 s to its first token against 47.8 without them; 2026-11-29). So each helper leaves a
marker once a variant is in the cache, and the worker's compile hook waits for the marker of a variant
the helpers hold (Replay.wait_for), then finds it in the cache: the keys are the worker's own
(tests/unit/test_kernel_manifest.py compiles both ways for sm_90 without a GPU).

`--kernel-manifest PATH` on the worker: replayed at start when it exists, written (merged) once the
worker has settled. Its default, `auto`, is a file beside the model (`manifest_path`): the model's
volume is what every new replica shares, while each one's Triton cache starts empty, so only the
first start of a model on a volume compiles its kernels one after another; `off` keeps none. A cache
that holds every variant of the manifest as it stands carries a marker saying so (`cache_marker`), and a
start then leaves the helpers out: 16 processes importing Triton beside the worker's own imports cost
a warm start ~3 s, and 13 s more with the page cache dropped (2026-11-29). `inferno warm-kernels
--kernel-manifest PATH` records one; `python -m services.worker.kernel_manifest PATH --jobs N` replays
one. A variant that cannot be rebuilt is skipped: the worker compiles it itself, as without a manifest.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

FORMAT = "inferno-kernel-manifest-v1"

WAIT_S = 120.0  # the longest a compile waits for the helpers' copy of its variant

_lock = threading.Lock()
_recorded: dict[str, dict] = {}  # specialization data → its entry, in the order compiled
_replay: Replay | None = None  # the helpers compiling beside this process, if any


def note(fn, compile: dict | None) -> None:
    """One compile about to happen (a jit_cache_hook's `fn` and `compile` arguments): recorded once,
    and, when the helpers hold its variant, after they have put it in the cache."""
    data = (compile or {}).get("specialization_data")
    module, name = getattr(fn, "module", None), getattr(fn, "name", None)
    if not isinstance(data, str) or not isinstance(module, str) or not isinstance(name, str):
        return
    with _lock:
        _recorded.setdefault(data, {"module": module, "name": name, "data": data})
    replay = _replay
    if replay is not None:
        replay.wait_for(data)


MANIFEST_NAME = ".inferno-kernels.json"


def manifest_path(flag: str, model_dir: str, device: str) -> str:
    """The manifest a worker uses: `flag` itself, or for `auto` (or empty) a file beside the model on
    a GPU (in its directory; a single-file model's name plus the suffix); "" for `off`, a CPU worker or
    no model."""
    if flag not in ("", "auto"):
        return "" if flag == "off" else flag
    if not model_dir or not device.startswith("cuda"):
        return ""
    model = Path(model_dir)
    return str(model / MANIFEST_NAME) if model.is_dir() else f"{model}{MANIFEST_NAME}"


def triton_cache_dir() -> Path:
    """Where Triton keeps compiled kernels (its own rule, read without importing it)."""
    home = os.environ.get("TRITON_HOME") or str(Path.home())
    return Path(os.environ.get("TRITON_CACHE_DIR") or Path(home) / ".triton" / "cache")


def cache_marker(doc: dict) -> Path:
    """The file in Triton's cache that says every variant of this manifest (as it stands) is there."""
    key = hashlib.sha256(json.dumps([doc.get("triton"), doc.get("target"), sorted(e["data"] for e in doc["kernels"])])
                         .encode()).hexdigest()[:32]
    return triton_cache_dir() / f"inferno-manifest-{key}.done"


def mark_in_cache(doc: dict) -> None:
    marker = cache_marker(doc)
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
    except OSError:
        pass  # a read-only cache: the next start replays again, as without the marker


def digest(data: str) -> str:
    """A variant's marker name (its specialization data hashed)."""
    return hashlib.sha256(data.encode()).hexdigest()[:32]


class Replay:
    """Helper processes compiling a manifest's variants beside this process: which variants they
    hold, and where each leaves its marker once its variant is in the cache (compiled or failed)."""

    def __init__(self, proc: subprocess.Popen, done_dir: Path, wanted: set[str]):
        self.proc, self.done_dir, self.wanted = proc, done_dir, wanted
        self.waited = 0.0  # seconds compiles spent waiting for the helpers

    def wait_for(self, data: str, timeout: float = WAIT_S) -> float:
        """Until the helpers have this variant in the cache, or have ended; the seconds waited (0
        for a variant they do not hold)."""
        if data not in self.wanted:
            return 0.0
        marker = self.done_dir / digest(data)
        t0 = time.monotonic()
        while not marker.exists() and self.proc.poll() is None and time.monotonic() - t0 < timeout:
            time.sleep(0.005)
        waited = time.monotonic() - t0
        self.waited += waited
        return waited


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
    return len(write_doc(path, entries, target)["kernels"])


def write_doc(path: str | Path, entries: list[dict], target: dict) -> dict:
    """write(), returning the manifest as written."""
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
    return doc


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


def compile_entries(entries: list[dict], target: dict, done_dir: str = "") -> tuple[int, list[str]]:
    """Compile each entry into Triton's cache (a helper process's share): (compiled, failures). With
    `done_dir`, a marker there for each entry once it is done (compiled or not)."""
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
        if done_dir:
            Path(done_dir, digest(entry["data"])).touch()
    return done, failed


def precompile(path: str | Path, jobs: int, done_dir: str = "") -> dict:
    """Every variant of the manifest at path compiled into the cache, over `jobs` processes (a marker
    for each in `done_dir`, if given)."""
    import triton
    t0 = time.perf_counter()
    doc = read(path)
    if doc is None:
        return {"compiled": 0, "failed": [], "seconds": 0.0, "skipped": "no manifest"}
    if doc.get("triton") != triton.__version__:
        return {"compiled": 0, "failed": [], "seconds": 0.0,
                "skipped": f"recorded with triton {doc.get('triton')}, this is {triton.__version__}"}
    entries = doc["kernels"]
    if not entries:
        return {"compiled": 0, "failed": [], "seconds": 0.0, "skipped": "no kernels"}
    jobs = max(1, min(jobs, len(entries)))
    # Round robin: a kernel's variants (often the slow ones) spread over the processes.
    shares = [entries[i::jobs] for i in range(jobs)]
    done, failed = 0, []
    if jobs == 1:
        done, failed = compile_entries(entries, doc["target"], done_dir)
    else:
        with ProcessPoolExecutor(jobs, mp_context=get_context("spawn")) as pool:
            for d, f in pool.map(compile_entries, shares, [doc["target"]] * jobs, [done_dir] * jobs):
                done, failed = done + d, failed + f
    if not failed:
        mark_in_cache(doc)
    return {"compiled": done, "failed": failed, "seconds": round(time.perf_counter() - t0, 2), "jobs": jobs}


def default_jobs() -> int:
    """Most cores, some left to the worker's own start (imports, the weights' read)."""
    return max(1, min(16, (os.cpu_count() or 2) - 2))


def start_precompile(path: str | Path, jobs: int | None = None, report=None) -> Replay | None:
    """The replay in a process of its own, started now (None: no manifest at path). This process's
    compiles of its variants wait for it (note); a thread reaps it, hands its result line to `report`
    and removes its markers."""
    doc = read(path)
    if doc is None or cache_marker(doc).exists():
        return None
    done_dir = Path(tempfile.mkdtemp(prefix="inferno-kernels-"))
    cmd = [sys.executable, "-m", "services.worker.kernel_manifest", str(path), "--jobs", str(jobs or default_jobs()),
           "--done-dir", str(done_dir)]
    replay = Replay(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True), done_dir,
                    {e["data"] for e in doc["kernels"]})

    def reap() -> None:
        global _replay
        out, _ = replay.proc.communicate()
        if _replay is replay:
            _replay = None
        shutil.rmtree(done_dir, ignore_errors=True)
        if report is not None:
            try:
                result = json.loads(out.strip().splitlines()[-1])
            except (ValueError, IndexError):
                result = {"exit": replay.proc.returncode}
            report({**result, "waited_s": round(replay.waited, 2)})
    global _replay
    _replay = replay
    threading.Thread(target=reap, name="kernel-manifest", daemon=True).start()
    return replay


def replay_at_start(path: str, device: str) -> Replay | None:
    """A GPU process's start: the manifest's variants compiled beside it, if there is one and the
    cache does not hold them all already."""
    if not path or not device.startswith("cuda"):
        return None
    import structlog
    log = structlog.get_logger("worker.kernels")
    replay = start_precompile(path, report=lambda result: log.info("kernel manifest compiled", manifest=path, **result))
    if replay is not None:
        log.info("kernel manifest replayed beside the start", manifest=path, jobs=default_jobs(), pid=replay.proc.pid)
    return replay


def save(path: str) -> int | None:
    """This process's recorded variants merged into the manifest at path; None where nothing was
    recorded or the file cannot be written (a read-only volume: the next start compiles as before)."""
    entries = recorded()
    if not path or not entries:
        return None
    try:
        doc = write_doc(path, entries, current_target())
        if {e["data"] for e in doc["kernels"]} <= {e["data"] for e in entries}:
            mark_in_cache(doc)  # this process compiled or loaded every one of them: they are in its cache
        return len(doc["kernels"])
    except OSError as e:
        import structlog
        structlog.get_logger("worker.kernels").warning("kernel manifest not written", manifest=path, error=str(e))
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Compile a kernel manifest's variants into Triton's cache.")
    ap.add_argument("manifest")
    ap.add_argument("--jobs", type=int, default=default_jobs())
    ap.add_argument("--done-dir", default="", help="a marker here for each variant once it is in the cache")
    args = ap.parse_args(argv)
    result = precompile(args.manifest, args.jobs, args.done_dir)
    print(json.dumps({**result, "failed": result["failed"][:5], "failed_count": len(result["failed"])}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
