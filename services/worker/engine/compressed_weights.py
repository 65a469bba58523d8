"""A compressed model directory's weights (`inferno compress`, docs/compression.md) decoded into place at load."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from shared.exponent_codec import FORMAT, decode, read_coded


def _metadata(path: Path) -> dict:
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(size)).get("__metadata__") or {}


def is_compressed(model_dir: Path) -> bool:
    shards = sorted(Path(model_dir).glob("*.safetensors")) if Path(model_dir).is_dir() else []
    return bool(shards) and _metadata(shards[0]).get("inferno.compression") == FORMAT


def load_compressed_weights(model_dir: Path, names: list[str], target: Callable[[str], torch.Tensor]) -> None:
    """Every checkpoint tensor in `names` decoded (BF16 ones) or read (the rest) into target(name), its
    flat destination. The numpy reference decoder: seconds for a small model on the CPU; decoding on
    the GPU while reading is issue 39's next step."""
    from safetensors.numpy import load_file

    wanted = set(names)
    for shard in sorted(Path(model_dir).glob("*.safetensors")):
        meta = _metadata(shard)
        if meta.get("inferno.compression") != FORMAT:
            raise ValueError(f"{shard}: not a shard of a compressed directory ({FORMAT})")
        tensors = load_file(str(shard))
        for name, shape in json.loads(meta.get("inferno.shapes", "{}")).items():
            if name in wanted:
                values = torch.from_numpy(decode(read_coded(tensors, name, shape)).view(np.int16)).view(torch.bfloat16)
                target(name).copy_(values.reshape(-1))
                wanted.discard(name)
        for name in wanted & tensors.keys():
            target(name).copy_(torch.from_numpy(tensors[name]).reshape(-1))
            wanted.discard(name)
    if wanted:
        raise ValueError(f"{model_dir}: missing tensor {sorted(wanted)[0]!r} in the compressed shards")
