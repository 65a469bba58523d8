"""Reads safetensors headers and tensor byte ranges without the library, so bytes can land in
pinned buffers or straight in parameters with a single copy."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


class SafetensorsError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class TensorEntry:
    name: str
    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def read_header(path: Path) -> dict[str, TensorEntry]:
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise SafetensorsError(f"{path}: too short to be a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > 100 << 20:
            raise SafetensorsError(f"{path}: header of {n} bytes is implausible")
        try:
            meta = json.loads(f.read(n))
        except json.JSONDecodeError as e:
            raise SafetensorsError(f"{path}: unreadable header: {e}") from e
    base = 8 + n
    entries = {}
    for name, info in meta.items():
        if name == "__metadata__":
            continue
        dtype = DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise SafetensorsError(f"{path}: tensor {name!r} has unsupported dtype {info.get('dtype')!r}")
        start, end = info["data_offsets"]
        entries[name] = TensorEntry(name, path, dtype, tuple(info["shape"]), base + start, base + end)
    return entries


def find_weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map") or {}
        files = sorted({model_dir / f for f in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise SafetensorsError(f"{index} names shard(s) that do not exist: {', '.join(missing)}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise SafetensorsError(f"{model_dir}: no *.safetensors weights found")
    return files


def read_all_headers(model_dir: Path) -> dict[str, TensorEntry]:
    entries: dict[str, TensorEntry] = {}
    for path in find_weight_files(model_dir):
        entries.update(read_header(path))
    return entries
