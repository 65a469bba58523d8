"""Decoding `inferno compress`'s BF16 weights on the device: the Triton kernel, beside its reference
(shared/exponent_codec.decode, numpy).

Each lane owns one chunk of CHUNK weights, whose exponent codes start on a byte of their own: it
reads a MAX_CODE_BITS window of its bitstream, looks the code up in the 2^MAX_CODE_BITS-entry
tables (symbol and length), joins the exponent with the weight's raw sign and mantissa byte, and
moves its bit pointer on by the code's length. All of a program's lanes step together.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from services.worker.kernels._common import check, check_tensor
from shared.exponent_codec import CHUNK, MAX_CODE_BITS, CodedTensor, decode_table

BLOCK_CHUNKS = 128  # lanes (chunks) a program


@triton.jit
def _decode_kernel(bits_ptr, starts_ptr, symbol_ptr, length_ptr, sm_ptr, out_ptr, n, chunks,
                   CHUNK: tl.constexpr, CODE_BITS: tl.constexpr, BLOCK: tl.constexpr):
    lane = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = lane < chunks
    pos = tl.load(starts_ptr + lane, mask=live, other=0) * 8  # each lane's bit pointer
    first = lane.to(tl.int64) * CHUNK
    for i in range(CHUNK):
        index = first + i
        ok = live & (index < n)
        byte = pos >> 3
        b0 = tl.load(bits_ptr + byte, mask=ok, other=0).to(tl.uint32)
        b1 = tl.load(bits_ptr + byte + 1, mask=ok, other=0).to(tl.uint32)
        b2 = tl.load(bits_ptr + byte + 2, mask=ok, other=0).to(tl.uint32)
        shift = (24 - CODE_BITS - (pos & 7)).to(tl.uint32)
        window = (((b0 << 16) | (b1 << 8) | b2) >> shift) & ((1 << CODE_BITS) - 1)
        exponent = tl.load(symbol_ptr + window, mask=ok, other=0).to(tl.uint16)
        pos += tl.load(length_ptr + window, mask=ok, other=0).to(tl.int64)
        sm = tl.load(sm_ptr + index, mask=ok, other=0).to(tl.uint16)
        value = ((sm & 0x80) << 8) | (exponent << 7) | (sm & 0x7F)
        tl.store(out_ptr + index, value.to(tl.int16, bitcast=True), mask=ok)


def decode_device(coded: CodedTensor, out: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """shared/exponent_codec.decode's values written into `out` (a bf16 or int16 tensor of the coded
    tensor's numel, on the device), decoded there: the coded parts go over as they are (10.6 bits
    a weight), not the 16-bit weights."""
    n = coded.sign_mantissa.size
    check(out.numel() == n and out.is_contiguous(), "out must be contiguous with {} elements, got {}", n,
          out.numel())
    check_tensor(out, "out", ndim=out.dim(), dtypes=(torch.bfloat16, torch.int16))
    device = out.device
    if n == 0:
        return out
    symbol, length = decode_table(coded.lengths)
    # Three bytes are read from every position: the stream's end is padded so the last window stays inside.
    bits = torch.from_numpy(np.concatenate([coded.bits, np.zeros(4, np.uint8)])).to(device, non_blocking=True)
    starts = torch.from_numpy(np.ascontiguousarray(coded.starts)).to(device, non_blocking=True)
    tables = torch.from_numpy(np.stack([symbol, length])).to(device)
    sm = torch.from_numpy(np.ascontiguousarray(coded.sign_mantissa)).to(device, non_blocking=True)
    chunks = len(coded.starts) - 1
    _decode_kernel[(triton.cdiv(chunks, BLOCK_CHUNKS),)](
        bits, starts, tables[0], tables[1], sm, out.view(torch.int16), n, chunks,
        CHUNK=chunk, CODE_BITS=MAX_CODE_BITS, BLOCK=BLOCK_CHUNKS, num_warps=4)
    return out
