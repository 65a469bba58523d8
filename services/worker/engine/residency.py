"""A loaded model's tensors moved between the GPU and pinned host memory, in place: an evicted model
keeps its Python objects (the built, fused, quantized DecoderLM) and comes back without reading,
converting or quantizing anything again: one copy per tensor over PCIe (16 GB of an 8B at ~50 GB/s).

Every tensor a module holds moves: parameters, buffers, and the plain tensor attributes some layers
keep beside them (fp8 weights' scales). Activations a forward left behind (EAGLE-3's aux streams)
are dropped, not moved.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

# Attributes a forward fills with its activations: dropped on the way out, remade by the next forward.
TRANSIENT = ("aux_hidden", "stream")


def model_bytes(model: nn.Module) -> int:
    """Bytes of every tensor the model holds (what it takes on the GPU, or pinned on the host)."""
    return sum(t.numel() * t.element_size() for _, _, t in _tensors(model))


def host_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The tensors move_model takes to the host, in the order it allocates their destinations."""
    return [t for _, _, t in _tensors(model) if t.device.type != "cpu"]


def move_model(model: nn.Module, device: torch.device, host_alloc=None) -> int:
    """Move every tensor of `model` to `device` (pinned memory when that is the CPU and a GPU is
    there), in place; returns the bytes moved. Returns once the copies are done. `host_alloc(shape,
    dtype)`: where each host destination goes, in host_tensors' order (a PinnedArena's views)."""
    to_host = device.type == "cpu"
    cuda = torch.cuda.is_available() and (to_host or device.type == "cuda")
    with torch.no_grad():
        for module in model.modules():
            for name in TRANSIENT:
                if isinstance(module.__dict__.get(name), torch.Tensor):
                    setattr(module, name, None)
        moves = [(m, name, t) for m, name, t in _tensors(model)
                 if not (t.device == device or (to_host and t.device.type == "cpu"))]
        # Every destination first, on the current stream; then the copies on a stream of their own,
        # after what the current stream has queued (a destination may be memory it freed): on the
        # default stream they would queue behind, and hold up, the steps of the process's other
        # models (services/worker/model_host.py).
        if to_host and host_alloc is not None:
            outs = [host_alloc(t.shape, t.dtype) for _, _, t in moves]
        else:
            outs = [torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda) if to_host
                    else torch.empty(t.shape, dtype=t.dtype, device=device) for _, _, t in moves]
        stream = torch.cuda.Stream() if cuda else None
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for (_, _, t), out in zip(moves, outs):
                out.copy_(t, non_blocking=cuda)
        if stream is not None:
            stream.synchronize()
        for (module, name, _), out in zip(moves, outs):
            _assign(module, name, out)
    return sum(t.numel() * t.element_size() for _, _, t in moves)


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
