"""A loaded model's tensors moved between the GPU and pinned host memory, in place: an evicted model
keeps its Python objects (the built, fused, quantized DecoderLM) and comes back without reading,
converting or quantizing anything again: one copy per tensor over PCIe (16 GB of an 8B at ~50 GB/s).

Every tensor a module holds moves: parameters, buffers, and the plain tensor attributes some layers
keep beside them (fp8 weights' scales). Activations a forward left behind (EAGLE-3's aux streams)
are dropped, not moved.
"""

from __future__ import annotations

import torch
from torch import nn

# Attributes a forward fills with its activations: dropped on the way out, remade by the next forward.
TRANSIENT = ("aux_hidden", "stream")


def model_bytes(model: nn.Module) -> int:
    """Bytes of every tensor the model holds (what it takes on the GPU, or pinned on the host)."""
    return sum(t.numel() * t.element_size() for _, _, t in _tensors(model))


def move_model(model: nn.Module, device: torch.device) -> int:
    """Move every tensor of `model` to `device` (pinned memory when that is the CPU and a GPU is
    there), in place; returns the bytes moved. To the GPU the copies are asynchronous on the current
    stream and synchronised at the end, so the caller sees a model ready to run."""
    to_host = device.type == "cpu"
    pin = to_host and torch.cuda.is_available()
    moved = 0
    with torch.no_grad():
        for module in model.modules():
            for name in TRANSIENT:
                if isinstance(module.__dict__.get(name), torch.Tensor):
                    setattr(module, name, None)
        for module, name, t in list(_tensors(model)):
            if t.device == device or (to_host and t.device.type == "cpu"):
                continue
            if to_host:
                out = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
                out.copy_(t)
            else:
                out = t.to(device, non_blocking=True)
            moved += t.numel() * t.element_size()
            _assign(module, name, out)
        if not to_host and device.type == "cuda":
            torch.cuda.synchronize(device)
    return moved


def _tensors(model: nn.Module):
    """(module, attribute name, tensor) for every tensor the model holds, each once."""
    seen: set[int] = set()
    for module in model.modules():
        for name, value in list(module._parameters.items()) + list(module._buffers.items()):
            if value is not None and id(value) not in seen:
                seen.add(id(value))
                yield module, name, value
        for name, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter) and id(value) not in seen:
                seen.add(id(value))
                yield module, name, value


def _assign(module: nn.Module, name: str, value: torch.Tensor) -> None:
    if name in module._parameters:
        module._parameters[name] = nn.Parameter(value, requires_grad=False)
    elif name in module._buffers:
        module._buffers[name] = value
    else:
        setattr(module, name, value)
