"""A rank's weight bytes: its share of the model built on the meta device (no memory, no files) and summed."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import nn

from services.worker.engine.model import DecoderLM
from services.worker.engine.model_config import ModelConfig
from services.worker.engine.ops import TorchOps

# --quantization fp8 quantizes the loaded 16-bit weights (engine.py), one tensor at a time through an fp32
# copy (kernels/fp8_linear.quantize_rows_ref: the copy, its quotient and the clamped quotient live at once):
# the load needs the 16-bit weights plus 3 × 2 × the largest one's bytes.
QUANTIZE_TEMPORARIES = 6
# After it, torch's allocator keeps segments that the 16-bit weights and those copies left part-filled by
# the e4m3 ones: about 3.5 × the largest quantized tensor's 16-bit bytes. Measured on an H200 (nvidia-h200,
# 2026-11-29), torch_reserved_gib above the tensors less the 0.033 every start has: llama-3.1-8b 0.77
# (largest 224 MiB: 3.5 ×), qwen2.5-7b 1.04 (259 MiB: 4.1 ×), qwen3-30b-a3b 2.20 (a layer's experts, 768
# MiB: 2.9 ×).
FP8_SLACK_FACTOR = 3.5


@dataclass(frozen=True, slots=True)
class RankWeights:
    tensors: int  # bytes the rank's model holds once loaded (and quantized)
    load_peak: int  # bytes at once while it loads: the 16-bit tensors, with fp8 the quantization's copies too
    fp8_slack: int  # the allocator's part-filled segments after fp8 quantization (0 without)


@lru_cache(maxsize=None)
def rank_weights(rank_config: ModelConfig, dtype: torch.dtype, fp8: bool) -> RankWeights:
    """Every tensor the loader allocates for a model of this shape but the rotary table (rope_bytes), as
    it does (loader.load_model): built on meta and cast to `dtype`, then with `fp8` the model's own
    quantize_fp8 (engine.py quantizes after the load). Generic over what the model holds, so a new
    attention or MoE shape is counted without changes here. Cached by shape: a group's ranks and a
    --compare's layouts share them."""
    with torch.device("meta"):
        model = DecoderLM(rank_config, TorchOps()).to(dtype).keep_fp32()
        model.finish_load()  # (what the loader does last: shared experts fused into the stacked ones)
    counts = keep_one_layer_per_shape(model)
    loaded = held_bytes(model, counts)
    if not fp8:
        return RankWeights(loaded, loaded, 0)
    model.quantize_fp8()  # on meta: ~2.5 ms a tensor, hence one layer of each shape
    largest = max((t.numel() for t in model_tensors(model) if t.dtype == torch.float8_e4m3fn), default=0)
    return RankWeights(held_bytes(model, counts), loaded + QUANTIZE_TEMPORARIES * largest * dtype.itemsize,
                       int(FP8_SLACK_FACTOR * largest * dtype.itemsize))


@lru_cache(maxsize=None)
def rope_bytes(model_config: ModelConfig, positions: int) -> int:
    """What init_rope adds to a model (the rotary table), which every rank makes alike for the whole model's
    max_model_len (loader.load_model): once per model, not per rank's shape."""
    with torch.device("meta"):
        model = DecoderLM(model_config, TorchOps())
    before = sum(nbytes(t) for t in model_tensors(model))
    # On the CPU, then moved to meta: meta math would import torch's decompositions (~1 s) for a
    # table that takes ~0.1 s to compute.
    model.init_rope(positions, "meta")
    return sum(nbytes(t) for t in model_tensors(model)) - before


def keep_one_layer_per_shape(model: DecoderLM) -> list[int]:
    """Cut model.layers to one layer of each kind (class, tensor names, shapes and dtypes); return how many
    layers each one kept stands for."""
    kept: dict[tuple, int] = {}
    layers, counts = [], []
    for layer in model.layers:
        tensors = [*layer.named_parameters(), *layer.named_buffers()]
        key = (type(layer), tuple((name, tuple(t.shape), t.dtype) for name, t in tensors))
        if key not in kept:
            kept[key] = len(layers)
            layers.append(layer)
            counts.append(0)
        counts[kept[key]] += 1
    model.layers = nn.ModuleList(layers)
    return counts


def held_bytes(model: DecoderLM, counts: list[int]) -> int:
    """The model's bytes with each kept layer counted for the layers it stands for."""
    in_layers = {id(t) for t in model_tensors(model.layers)}
    rest = sum(nbytes(t) for t in model_tensors(model) if id(t) not in in_layers)
    return rest + sum(n * sum(nbytes(t) for t in model_tensors(layer)) for layer, n in zip(model.layers, counts))


def model_tensors(module: nn.Module) -> list[torch.Tensor]:
    """Parameters, buffers and plain tensor attributes (the fp8 scales), each once."""
    seen: dict[int, torch.Tensor] = {}
    for m in module.modules():
        for t in [*m._parameters.values(), *m._buffers.values(), *vars(m).values()]:
            if isinstance(t, torch.Tensor):
                seen[id(t)] = t
    return list(seen.values())


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
