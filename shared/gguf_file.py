"""A GGUF file (llama.cpp's format) read with the `gguf` package: its metadata and tensor index.

A GGUF carries in one file what a Hugging Face directory spreads over config.json, the tokenizer
files and the safetensors shards. This module only reads; what the keys mean for the model, the
tokenizer and the weights is decided beside each of them (model_config, gguf_tokenizer,
gguf_weights). Opening is cached per (path, size, mtime): the gateway and the worker of one
process tree each parse the file once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

GGUF_MAGIC = b"GGUF"


class GGUFError(ValueError):
    """The file is not a readable GGUF, or lacks what serving it needs; the message says which."""


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    """One tensor's place in the file. shape is in PyTorch (row-major) order: GGUF's ne reversed."""

    name: str
    type_name: str  # a gguf.GGMLQuantizationType name: "F32", "Q4_K", ...
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int


@dataclass(frozen=True, slots=True)
class GGUFFile:
    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def arch_key(self, name: str, default: Any = None) -> Any:
        """`{architecture}.{name}`, e.g. arch_key("block_count") → llama.block_count."""
        return self.metadata.get(f"{self.architecture}.{name}", default)


def is_gguf(path: str | Path) -> bool:
    """A regular file that starts with the GGUF magic (the suffix alone is not trusted)."""
    p = Path(path)
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def open_gguf(path: str | Path) -> GGUFFile:
    p = Path(path).resolve()
    st = p.stat()
    return _open(p, st.st_size, st.st_mtime_ns)


@lru_cache(maxsize=4)
def _open(path: Path, size: int, mtime_ns: int) -> GGUFFile:
    try:
        import gguf
    except ImportError as e:  # pragma: no cover - a dependency of the project
        raise GGUFError("reading GGUF files needs the 'gguf' package (pip install gguf)") from e
    if not is_gguf(path):
        raise GGUFError(f"{path} is not a GGUF file (it does not start with b'GGUF')")
    try:
        reader = gguf.GGUFReader(os.fspath(path), "r")
    except Exception as e:  # the reader raises ValueError, struct.error, IndexError... on bad files
        raise GGUFError(f"{path} cannot be read as GGUF: {e}") from e
    metadata = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue  # the header's own counts
        try:
            metadata[key] = field.contents()
        except Exception as e:
            raise GGUFError(f"{path}: metadata key {key!r} cannot be decoded: {e}") from e
    tensors = {}
    for t in reader.tensors:
        tensors[t.name] = GGUFTensor(
            name=t.name, type_name=t.tensor_type.name,
            shape=tuple(int(d) for d in reversed(t.shape.tolist())),
            offset=int(t.data_offset), nbytes=int(t.n_bytes))
    return GGUFFile(path=path, metadata=metadata, tensors=tensors)
