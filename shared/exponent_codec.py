"""Lossless BF16 compression (Unweight's idea): each weight's 8 exponent bits Huffman-coded, its sign
and 7 mantissa bits kept raw; the reference encoder and decoder (numpy).

Trained (and HF-initialised) weights use a handful of exponents, so the exponent byte carries 2-3
bits of information: a BF16 matrix shrinks to ~10.5-11 bits a weight. The exponents are coded in
independent chunks of CHUNK weights, each starting on a byte of its own (`starts`), so a decoder
can run every chunk at once (a GPU lane each); codes are at most MAX_CODE_BITS long, so one
table of 2^MAX_CODE_BITS entries decodes a code from a window of the bitstream. The container that
holds these arrays is docs/compression.md's.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

CHUNK = 4096  # weights per independently decodable chunk
MAX_CODE_BITS = 12
SLICE = 1 << 24  # weights encoded at a time (a multiple of CHUNK)


@dataclass(frozen=True)
class CodedTensor:
    shape: tuple[int, ...]
    lengths: np.ndarray  # uint8 [256]: each exponent's code length, 0 where it never occurs (canonical codes)
    bits: np.ndarray  # uint8: the chunks' bitstreams back to back, most significant bit first
    starts: np.ndarray  # int64 [chunks + 1]: each chunk's first byte in `bits`, and the end
    sign_mantissa: np.ndarray  # uint8 [numel]: sign bit, then the 7 mantissa bits

    @property
    def nbytes(self) -> int:
        return self.lengths.nbytes + self.bits.nbytes + self.starts.nbytes + self.sign_mantissa.nbytes


def split(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """BF16 bit patterns (uint16) → (exponent bytes, sign-and-mantissa bytes)."""
    exponent = ((values >> 7) & 0xFF).astype(np.uint8)
    sign_mantissa = (((values >> 8) & 0x80) | (values & 0x7F)).astype(np.uint8)
    return exponent, sign_mantissa


def join(exponent: np.ndarray, sign_mantissa: np.ndarray) -> np.ndarray:
    sm = sign_mantissa.astype(np.uint16)
    return ((sm & 0x80) << 8) | (exponent.astype(np.uint16) << 7) | (sm & 0x7F)


def code_lengths(counts: np.ndarray, max_bits: int = MAX_CODE_BITS) -> np.ndarray:
    """Huffman code lengths of 256 symbols, none longer than max_bits (rare symbols' counts are
    flattened until the tree is shallow enough: a little size for a bounded decode table)."""
    counts = counts.astype(np.int64)
    while True:
        present = [(int(c), s) for s, c in enumerate(counts) if c]
        lengths = np.zeros(256, dtype=np.uint8)
        if len(present) == 1:
            lengths[present[0][1]] = 1
            return lengths
        heap = [(c, i, (s,)) for i, (c, s) in enumerate(present)]
        heapq.heapify(heap)
        tie = len(heap)
        while len(heap) > 1:
            c1, _, a = heapq.heappop(heap)
            c2, _, b = heapq.heappop(heap)
            for s in a + b:
                lengths[s] += 1
            heapq.heappush(heap, (c1 + c2, tie, a + b))
            tie += 1
        if lengths.max() <= max_bits:
            return lengths
        counts = np.where(counts > 0, counts // 2 + 1, 0)


def canonical_codes(lengths: np.ndarray) -> np.ndarray:
    """uint32 [256]: the canonical code of each symbol (by length, then symbol), from its length alone."""
    codes = np.zeros(256, dtype=np.uint32)
    code, prev = 0, 0
    for s in sorted((s for s in range(256) if lengths[s]), key=lambda s: (lengths[s], s)):
        code <<= int(lengths[s]) - prev
        codes[s], prev = code, int(lengths[s])
        code += 1
    return codes


def encode(values: np.ndarray, chunk: int = CHUNK, slice_values: int = SLICE) -> CodedTensor:
    """BF16 bit patterns (uint16, any shape) → their coded form. One code table for the tensor; the
    bitstream is made `slice_values` weights (whole chunks) at a time, so the working arrays (~40 bytes
    a weight) stay small for an 8B's 525 M-weight embedding."""
    flat = values.reshape(-1)
    exponent, sign_mantissa = split(flat)
    lengths = code_lengths(np.bincount(exponent, minlength=256))
    codes = canonical_codes(lengths)
    step = max(chunk, slice_values // chunk * chunk)
    parts, starts, at = [], [np.zeros(1, np.int64)], 0
    for lo in range(0, flat.size, step):
        bits, chunk_starts = _encode_chunks(exponent[lo:lo + step], lengths, codes, chunk)
        parts.append(bits)
        starts.append(chunk_starts[1:] + at)
        at += int(chunk_starts[-1])
    bits = np.concatenate(parts) if parts else np.zeros(0, np.uint8)
    return CodedTensor(tuple(values.shape), lengths, bits, np.concatenate(starts), sign_mantissa)


def _encode_chunks(exponent: np.ndarray, lengths: np.ndarray, codes: np.ndarray,
                   chunk: int) -> tuple[np.ndarray, np.ndarray]:
    """The packed bitstream of whole chunks of exponents, and each chunk's first byte (then the end)."""
    n = exponent.size
    size = lengths[exponent].astype(np.int64)
    code = codes[exponent]
    # Each chunk's bits start on a byte: its symbols' bit offsets from the chunk's start.
    chunk_of = np.arange(n) // chunk
    first = np.cumsum(size) - size
    chunk_first = first[::chunk]
    offset = first - chunk_first[chunk_of]
    chunk_bits = np.add.reduceat(size, np.arange(0, n, chunk)) if n else np.zeros(0, np.int64)
    chunk_bytes = (chunk_bits + 7) // 8
    starts = np.concatenate([[0], np.cumsum(chunk_bytes)]).astype(np.int64)
    bit_at = starts[chunk_of] * 8 + offset
    bits = np.zeros(int(starts[-1]) * 8, dtype=bool)
    for b in range(MAX_CODE_BITS):
        sel = size > b
        bits[bit_at[sel] + b] = (code[sel] >> (size[sel] - 1 - b).astype(np.uint32)) & 1
    return np.packbits(bits), starts


def decode_table(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(symbol, length) for every MAX_CODE_BITS-bit window: the window starts with exactly one code."""
    codes = canonical_codes(lengths)
    symbol = np.zeros(1 << MAX_CODE_BITS, dtype=np.uint8)
    length = np.zeros(1 << MAX_CODE_BITS, dtype=np.uint8)
    for s in range(256):
        if lengths[s]:
            shift = MAX_CODE_BITS - int(lengths[s])
            lo = int(codes[s]) << shift
            symbol[lo:lo + (1 << shift)], length[lo:lo + (1 << shift)] = s, lengths[s]
    return symbol, length


def decode(coded: CodedTensor, chunk: int = CHUNK) -> np.ndarray:
    """The BF16 bit patterns (uint16, the original shape). Every chunk advances together, one code a
    step: the reference for the GPU decoder, which gives each chunk a lane."""
    n = coded.sign_mantissa.size
    symbol, length = decode_table(coded.lengths)
    chunks = len(coded.starts) - 1
    data = np.concatenate([coded.bits, np.zeros(4, dtype=np.uint8)]).astype(np.uint32)
    pos = coded.starts[:-1] * 8  # each chunk's bit pointer
    count = np.minimum(chunk, n - np.arange(chunks) * chunk)  # the last chunk may be short
    exponent = np.zeros((chunks, chunk), dtype=np.uint8)
    for i in range(int(count.max()) if chunks else 0):
        live = count > i
        byte, bit = pos >> 3, pos & 7
        window = (data[byte] << 16 | data[byte + 1] << 8 | data[byte + 2]) >> (24 - MAX_CODE_BITS - bit).astype(
            np.uint32) & ((1 << MAX_CODE_BITS) - 1)
        exponent[:, i] = symbol[window]
        pos = pos + np.where(live, length[window], 0)
    flat = exponent.reshape(-1)[:n]
    return join(flat, coded.sign_mantissa).reshape(coded.shape)


# -- the container (docs/compression.md): a coded tensor NAME as four safetensors tensors ----------------

FORMAT = "inferno-bf16-exponent-huffman-v1"  # the files' __metadata__["inferno.compression"]


def coded_parts(name: str, coded: CodedTensor) -> dict[str, np.ndarray]:
    return {f"{name}.__code_lengths": coded.lengths, f"{name}.__chunk_starts": coded.starts,
            f"{name}.__exponent_bits": coded.bits, f"{name}.__sign_mantissa": coded.sign_mantissa}


def read_coded(tensors: dict[str, np.ndarray], name: str, shape) -> CodedTensor:
    return CodedTensor(tuple(shape), lengths=tensors[f"{name}.__code_lengths"], bits=tensors[f"{name}.__exponent_bits"],
                       starts=tensors[f"{name}.__chunk_starts"], sign_mantissa=tensors[f"{name}.__sign_mantissa"])
