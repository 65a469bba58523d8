"""The KV pool's sizing dry run, remembered: its activation peak per configuration, on disk.

The dry run (gpu_memory.dry_run_peak_bytes) runs the largest step once, ~1 s of every process
start of an 8B model on an H100 (W5b's "kv" part). Its result follows only from what the key
holds, so a start with the same key reads the figure instead: the model's shape on this rank, the
dtypes, the step limits, the device, torch, and the source of the engine and its kernels (a change
to either can change the activations). Anything unknown or unreadable means a dry run.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from pathlib import Path

import torch

from services.packaged_models import cache_dir

FILE = "activation_peaks.json"
_SOURCES = (Path(__file__).resolve().parent, Path(__file__).resolve().parent.parent / "kernels")


@functools.lru_cache(maxsize=1)
def _source_digest() -> str:
    h = hashlib.sha256()
    for folder in _SOURCES:
        for path in sorted(folder.rglob("*.py")):
            h.update(path.name.encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def key(engine) -> str:
    cfg, device = engine.config, engine.device
    props = torch.cuda.get_device_properties(device)
    parts = {
        "model": dataclasses.asdict(engine.rank_config), "dtype": str(engine.dtype), "kv_dtype": str(engine.kv_dtype),
        "quantization": cfg.quantization, "max_num_batched_tokens": cfg.max_num_batched_tokens,
        "max_num_seqs": cfg.max_num_seqs, "block_size": cfg.block_size, "device": props.name,
        "layout": (engine.layout.tp, engine.layout.pp, engine.layout.stage),
        "memory": props.total_memory, "torch": torch.__version__, "source": _source_digest(),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _path() -> Path:
    return cache_dir() / FILE


def lookup(k: str) -> int | None:
    try:
        value = json.loads(_path().read_text()).get(k)
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and value > 0 else None


def remember(k: str, peak: int) -> None:
    """Best effort (a read-only home leaves every start its dry run); written whole, then renamed,
    so a reader never sees half a file."""
    path = _path()
    try:
        known = json.loads(path.read_text()) if path.exists() else {}
        known = known if isinstance(known, dict) else {}
    except (OSError, ValueError):
        known = {}
    known[k] = int(peak)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known))
        tmp.replace(path)
    except OSError:
        pass
