"""The compressed weights' device decoder (Triton, interpreted) against the numpy reference, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.worker.kernels.exponent_decode import decode_device
from shared.exponent_codec import decode, encode

CHUNK = 64  # the codec's chunk is 4,096; a small one keeps the interpreter's loop short


def _weights(n: int, seed: int) -> np.ndarray:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16)
    w[::97] = 0.0
    w[5::211] = torch.tensor(3.0e4, dtype=torch.bfloat16)  # rare exponents: long codes
    return w.view(torch.int16).numpy().view(np.uint16)


@pytest.mark.parametrize("n", [1, 64, 1000, 64 * 130 + 7], ids=["one", "one-chunk", "ragged", "two-programs"])
def test_device_decode_equals_the_reference(n, device):
    values = _weights(n, seed=n)
    coded = encode(values, chunk=CHUNK)
    out = torch.empty(n, dtype=torch.bfloat16, device=device)
    decode_device(coded, out, chunk=CHUNK)
    want = decode(coded, chunk=CHUNK)
    assert np.array_equal(out.view(torch.int16).cpu().numpy().view(np.uint16), want)
    assert np.array_equal(want, values)


def test_a_single_exponent_decodes(device):
    values = np.full(300, 0x3F80, dtype=np.uint16)  # 1.0 everywhere: one symbol, a 1-bit code
    values[::3] |= 0x8000  # the sign rides in the raw byte
    coded = encode(values, chunk=CHUNK)
    out = torch.empty(300, dtype=torch.int16, device=device)
    decode_device(coded, out, chunk=CHUNK)
    assert np.array_equal(out.cpu().numpy().view(np.uint16), values)
