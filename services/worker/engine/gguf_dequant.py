"""Turns GGUF (ggml) tensor bytes into float tensors with vectorised torch ops, on the CPU or a GPU."""

from __future__ import annotations

import math
from typing import Callable

import torch

_BlockFn = Callable[[torch.Tensor], torch.Tensor]


class UnsupportedQuantType(ValueError):
    pass


def _half(blocks: torch.Tensor, start: int, count: int = 1) -> torch.Tensor:
    """`count` consecutive f16 fields from byte `start` of every block, as float32 [n_blocks, count]."""
    # The fields sit at strides (e.g. 34 bytes) that view(float16) cannot reinterpret in place, and a
    # 1-block slice would keep its odd offset, so copy them into a fresh, aligned buffer first.
    field = torch.empty((blocks.shape[0], 2 * count), dtype=torch.uint8, device=blocks.device)
    return field.copy_(blocks[:, start:start + 2 * count]).view(torch.float16).float()


def _nibbles(qs: torch.Tensor, dim: int) -> torch.Tensor:
    """Low nibbles then high nibbles of `qs`, stacked along a new axis `dim`."""
    return torch.stack((qs & 0x0F, qs >> 4), dim=dim)


def _bits(field: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """`count` fields of `width` bits of each byte, lowest first, stacked along a new axis before the last."""
    shifts = torch.arange(0, width * count, width, dtype=torch.uint8, device=field.device)
    return (field.unsqueeze(-2) >> shifts.unsqueeze(-1)) & ((1 << width) - 1)


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's get_scale_min_k4 for all 8 sub-blocks: 6-bit scales and mins packed into 12 bytes."""
    # bytes 0-3 hold sub-blocks 0-3's scales, 4-7 their mins; 8-11 hold the low 4 bits of sub-blocks
    # 4-7 (scale in the low nibble, min in the high one), whose top 2 bits ride in bits 6-7 of bytes 0-7.
    lo_sc, lo_m, hi = scales.reshape(-1, 3, 4).unbind(1)
    sc = torch.cat((lo_sc & 0x3F, (hi & 0x0F) | ((lo_sc >> 6) << 4)), dim=-1)
    m = torch.cat((lo_m & 0x3F, (hi >> 4) | ((lo_m >> 6) << 4)), dim=-1)
    return sc, m


# The decoders convert quants to float32 before touching the scales and then work in place: torch's
# mixed-dtype (int * float) kernels run about half as fast, and fresh temporaries cost memory bandwidth.

def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].view(torch.int8).float().mul_(_half(b, 0))


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 2:], dim=1).reshape(-1, 32)
    return q.float().sub_(8).mul_(_half(b, 0))


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    dm = _half(b, 0, 2)
    q = _nibbles(b[:, 4:], dim=1).reshape(-1, 32)
    return q.float().mul_(dm[:, :1]).add_(dm[:, 1:])


def _five_bit(b: torch.Tensor, qh_at: int) -> torch.Tensor:
    """Q5_0/Q5_1 quants [n, 32]: low nibbles as Q4_0, the 5th bit of element j is bit j of the
    little-endian uint32 at qh_at (bit k of byte i is element 8i + k)."""
    high = _bits(b[:, qh_at:qh_at + 4], width=1, count=8).transpose(1, 2).reshape(-1, 32)
    return _nibbles(b[:, qh_at + 4:], dim=1).reshape(-1, 32) | (high << 4)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    return _five_bit(b, 2).float().sub_(16).mul_(_half(b, 0))


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    dm = _half(b, 0, 2)
    return _five_bit(b, 4).float().mul_(dm[:, :1]).add_(dm[:, 1:])


def _k_quant(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K: y = d*sc*q - dmin*m over 8 sub-blocks of 32, q already unpacked to [n, 8, 32]."""
    dm = _half(b, 0, 2)
    sc, m = _scale_min_k4(b[:, 4:16])
    # Same association as ggml ((d*sc)*q - dmin*m) so the float32 results match bit for bit.
    return q.float().mul_((dm[:, :1] * sc).unsqueeze(-1)).sub_((dm[:, 1:] * m).unsqueeze(-1))


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    # qs is four 32-byte chunks; chunk c holds sub-block 2c in its low nibbles and 2c+1 in its high ones.
    return _k_quant(b, _nibbles(b[:, 16:].reshape(-1, 4, 32), dim=2).reshape(-1, 8, 32))


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    low = _nibbles(b[:, 48:].reshape(-1, 4, 32), dim=2).reshape(-1, 8, 32)
    # The 5th bit of element i of sub-block s is bit s of qh[i]: qh is shared by all 8 sub-blocks.
    high = _bits(b[:, 16:48], width=1, count=8)
    return _k_quant(b, low | (high << 4))


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    # Two halves of 128 elements: in each, ql's 64 bytes give elements 0-63 (low nibbles) and 64-127
    # (high nibbles), and qh's 32 bytes give the top 2 bits of elements 32k..32k+31 in bits 2k, 2k+1.
    low = _nibbles(b[:, :128].reshape(-1, 2, 64), dim=2).reshape(-1, 2, 128)
    high = _bits(b[:, 128:192].reshape(-1, 2, 32), width=2, count=4).reshape(-1, 2, 128)
    q = (low | (high << 4)).float().sub_(32).reshape(-1, 16, 16)
    d = _half(b, 208) * b[:, 192:208].view(torch.int8).float()  # one scale per 16 consecutive elements
    return q.mul_(d.unsqueeze(-1))


# name -> (elements per block, bytes per block, block decoder or the plain dtype the bytes hold)
_TYPES: dict[str, tuple[int, int, _BlockFn | torch.dtype]] = {
    "F32": (1, 4, torch.float32),
    "F16": (1, 2, torch.float16),
    "BF16": (1, 2, torch.bfloat16),
    "Q8_0": (32, 34, _q8_0),
    "Q4_0": (32, 18, _q4_0),
    "Q4_1": (32, 20, _q4_1),
    # llama.cpp's K-quant mixes fall back to these where a row is not a multiple of 256 (SmolLM2's 576).
    "Q5_0": (32, 22, _q5_0),
    "Q5_1": (32, 24, _q5_1),
    "Q4_K": (256, 144, _q4_k),
    "Q5_K": (256, 176, _q5_k),
    "Q6_K": (256, 210, _q6_k),
}

SUPPORTED_TYPES: tuple[str, ...] = tuple(_TYPES)


def block_layout(type_name: str) -> tuple[int, int]:
    """(elements per block, bytes per block) for a supported type; UnsupportedQuantType otherwise."""
    if type_name not in _TYPES:
        raise UnsupportedQuantType(
            f"GGUF tensor type {type_name!r} is not supported; supported types: {', '.join(SUPPORTED_TYPES)}")
    elems, nbytes, _ = _TYPES[type_name]
    return elems, nbytes


def dequantize(raw: torch.Tensor, type_name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """raw: a torch.uint8 tensor holding the tensor's bytes exactly as stored in the GGUF file (on any
    device; any shape, read in its logical order, so a non-contiguous one costs a copy). shape: the logical
    shape in row-major (PyTorch) order, i.e. the reverse of GGUF's ne[] order. Returns a new contiguous
    tensor of that shape in `dtype`, on raw's device; it never shares memory with raw."""
    elems, nbytes = block_layout(type_name)
    decode = _TYPES[type_name][2]
    shape = tuple(int(s) for s in shape)
    if raw.dtype != torch.uint8:
        raise TypeError(f"raw GGUF bytes must be a torch.uint8 tensor, got {raw.dtype}")
    row = shape[-1] if shape else 1
    if row % elems:
        raise ValueError(
            f"{type_name} tensor of shape {shape}: last dim {row} is not a multiple of the block size {elems}")
    expected = math.prod(shape) // elems * nbytes
    if raw.numel() != expected:
        raise ValueError(
            f"{type_name} tensor of shape {shape} needs {expected} bytes "
            f"({math.prod(shape) // elems} blocks of {nbytes}), got {raw.numel()}")
    flat = raw.contiguous().view(-1)
    if isinstance(decode, torch.dtype):
        # view(dtype) needs the bytes aligned to the element size; a tensor cut at an odd file offset may not be.
        if flat.data_ptr() % nbytes:
            flat = flat.clone()
        # A plain cast is exact either way (f16/bf16 -> f32 is lossless, then one rounding to `dtype`);
        # copy=True keeps the result from aliasing raw, which may be a read-only file mapping.
        return flat.view(decode).reshape(shape).to(dtype, copy=True)
    return decode(flat.view(-1, nbytes)).reshape(shape).to(dtype)
