"""A compressed model directory's weights (`inferno compress`, docs/compression.md) decoded into place at load."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from services.worker.kernels.exponent_decode import decode_device
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
    flat destination. On a GPU the Triton decoder (kernels/exponent_decode.py), on the CPU the numpy
    reference (seconds for a small model). Not yet overlapped with the reading."""
    from safetensors.numpy import load_file

    wanted = set(names)
    for shard in sorted(Path(model_dir).glob("*.safetensors")):
        meta = _metadata(shard)
        if meta.get("inferno.compression") != FORMAT:
            raise ValueError(f"{shard}: not a shard of a compressed directory ({FORMAT})")
        tensors = load_file(str(shard))
        for name, shape in json.loads(meta.get("inferno.shapes", "{}")).items():
            if name in wanted:
                coded, dst = read_coded(tensors, name, shape), target(name)
                if dst.is_cuda:  # decoded on the device: the coded bytes cross, not the 16-bit weights
                    if dst.dtype == torch.bfloat16:
                        decode_device(coded, dst)
                    else:
                        dst.copy_(decode_device(coded, torch.empty(dst.numel(), dtype=torch.bfloat16,
                                                                    device=dst.device)))
                else:
                    dst.copy_(torch.from_numpy(decode(coded).view(np.int16)).view(torch.bfloat16).reshape(-1))
                wanted.discard(name)
        for name in wanted & tensors.keys():
            target(name).copy_(torch.from_numpy(tensors[name]).reshape(-1))
            wanted.discard(name)
    if wanted:
        raise ValueError(f"{model_dir}: missing tensor {sorted(wanted)[0]!r} in the compressed shards")
