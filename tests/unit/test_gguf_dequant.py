"""The GGUF dequantizers: bit-exact agreement with gguf-py's numpy reference and with ggml's scalar C
loops, quantize round trips, plain types, output dtype/device, odd inputs, and errors.

Comparisons of quantized types are exact (array_equal), not within a tolerance: every output element is
computed with the same float32 operations in the same order as the references ((d*sc)*q - dmin*m and so
on, no reductions), so IEEE rounding gives identical bits; any difference is a layout bug."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf", reason="gguf (gguf-py) is the reference implementation; install the test extras")

from gguf import GGMLQuantizationType as QT  # noqa: E402
from gguf.constants import GGML_QUANT_SIZES  # noqa: E402

from services.worker.engine import gguf_dequant as gd  # noqa: E402

QUANT_TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]
PLAIN_TYPES = ["F32", "F16", "BF16"]
PLAIN_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# byte offsets of each type's f16 fields inside a block
HALF_FIELDS = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}
SHAPES = {32: [(5, 256), (4, 64), (1, 32)], 256: [(3, 512), (2, 256), (1, 256)]}


def _random_blocks(name: str, n_blocks: int, seed: int = 0) -> np.ndarray:
    """Random block bytes whose f16 fields are finite (random bytes can spell NaN/inf halves)."""
    rng = np.random.default_rng(seed)
    _, nbytes = gd.block_layout(name)
    blocks = rng.integers(0, 256, size=(n_blocks, nbytes), dtype=np.uint8)
    for off in HALF_FIELDS[name]:
        vals = rng.standard_normal(n_blocks) * 10.0 ** rng.uniform(-4, 1, n_blocks)
        blocks[:, off:off + 2] = vals.astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    return blocks.reshape(-1)


def _plain_bytes(name: str, n: int, seed: int = 0) -> np.ndarray:
    """The bytes of `n` random values stored as plain F32/F16/BF16."""
    x = torch.from_numpy(np.random.default_rng(seed).standard_normal(n).astype(np.float32) * 100)
    return x.to(PLAIN_DTYPES[name]).view(torch.uint8).numpy()


def _sample_bytes(name: str, seed: int) -> np.ndarray:
    """The bytes of a random (2, 256) tensor of type `name`."""
    elems, _ = gd.block_layout(name)
    return _plain_bytes(name, 512, seed) if name in PLAIN_TYPES else _random_blocks(name, 512 // elems, seed)


def _ours(data: np.ndarray, name: str, shape, dtype=torch.float32) -> torch.Tensor:
    return gd.dequantize(torch.from_numpy(data), name, shape, dtype)


def _reference(data: np.ndarray, name: str, shape) -> np.ndarray:
    return gguf.quants.dequantize(data, QT[name]).reshape(shape)


def test_supported_types_and_layouts_match_ggml():
    assert gd.SUPPORTED_TYPES == ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
    for name in gd.SUPPORTED_TYPES:
        assert gd.block_layout(name) == GGML_QUANT_SIZES[QT[name]]


@pytest.mark.parametrize("name", QUANT_TYPES)
def test_random_blocks_match_gguf_exactly(name):
    elems, _ = gd.block_layout(name)
    for i, shape in enumerate(SHAPES[elems]):
        data = _random_blocks(name, int(np.prod(shape)) // elems, seed=i)
        out = _ours(data, name, shape)
        assert out.shape == shape and out.dtype == torch.float32 and out.is_contiguous()
        assert np.array_equal(out.numpy(), _reference(data, name, shape)), (name, shape)


# --- literal ports of ggml's scalar dequantize_row_q{4,5,6}_K, in float32, one element at a time ---

def _f16(b: np.ndarray, off: int) -> np.float32:
    return np.float32(b[off:off + 2].view(np.float16)[0])


def _scale_min_k4(j: int, q: np.ndarray) -> tuple[int, int]:
    if j < 4:
        return int(q[j]) & 63, int(q[j + 4]) & 63
    return (int(q[j + 4]) & 0xF) | ((int(q[j - 4]) >> 6) << 4), (int(q[j + 4]) >> 4) | ((int(q[j]) >> 6) << 4)


def _ggml_q45_k(b: np.ndarray, five_bit: bool) -> list[np.float32]:
    d, dmin, scales = _f16(b, 0), _f16(b, 2), b[4:16]
    qh, ql = (b[16:48], b[48:176]) if five_bit else (None, b[16:144])
    y, is_, u1, u2 = [], 0, 1, 2
    for j in range(0, 256, 64):
        sc, m = _scale_min_k4(is_, scales)
        d1, m1 = d * np.float32(sc), dmin * np.float32(m)
        sc, m = _scale_min_k4(is_ + 1, scales)
        d2, m2 = d * np.float32(sc), dmin * np.float32(m)
        q = ql[j // 2:j // 2 + 32]
        for lo_first, dd, mm, u in ((True, d1, m1, u1), (False, d2, m2, u2)):
            for l in range(32):
                v = (int(q[l]) & 0xF) if lo_first else (int(q[l]) >> 4)
                if five_bit and int(qh[l]) & u:
                    v += 16
                y.append(dd * np.float32(v) - mm)
        is_, u1, u2 = is_ + 2, u1 << 2, u2 << 2
    return y


def _ggml_q6_k(b: np.ndarray) -> list[np.float32]:
    d, sc = _f16(b, 208), b[192:208].view(np.int8)
    y = [np.float32(0)] * 256
    for half in range(2):
        ql, qh, s, base = b[64 * half:], b[128 + 32 * half:], sc[8 * half:], 128 * half
        for l in range(32):
            is_ = l // 16
            q1 = ((int(ql[l]) & 0xF) | (((int(qh[l]) >> 0) & 3) << 4)) - 32
            q2 = ((int(ql[l + 32]) & 0xF) | (((int(qh[l]) >> 2) & 3) << 4)) - 32
            q3 = ((int(ql[l]) >> 4) | (((int(qh[l]) >> 4) & 3) << 4)) - 32
            q4 = ((int(ql[l + 32]) >> 4) | (((int(qh[l]) >> 6) & 3) << 4)) - 32
            for k, q in enumerate((q1, q2, q3, q4)):
                y[base + l + 32 * k] = d * np.float32(s[is_ + 2 * k]) * np.float32(q)
    return y


@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quants_match_ggml_scalar_loops(name):
    # gguf-py has no K-quant quantizer, so an independent port of the C loops guards the numpy reference too.
    _, nbytes = gd.block_layout(name)
    data = _random_blocks(name, 2, seed=7)
    expected = []
    for b in data.reshape(2, nbytes):
        expected += _ggml_q6_k(b) if name == "Q6_K" else _ggml_q45_k(b, five_bit=name == "Q5_K")
    out = _ours(data, name, (2, 256)).numpy()
    assert np.array_equal(out, np.array(expected, dtype=np.float32).reshape(2, 256))


@pytest.mark.parametrize("name, step_factor", [("Q8_0", 0.53), ("Q4_0", 1.01), ("Q4_1", 0.53), ("Q5_0", 1.01),
                                              ("Q5_1", 0.53)])
def test_quantize_round_trip(name, step_factor):
    # Error bound per block: half a quantization step, plus a little for the f16 rounding of the scale;
    # Q4_0 spends its 16 levels on [-8, 7]*d with d = -max/8, so the far end can be off by a whole step.
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((6, 256)) * rng.uniform(0.01, 3, (6, 1))).astype(np.float32)
    data = gguf.quants.quantize(x, QT[name]).reshape(-1)
    out = _ours(data, name, x.shape).numpy()
    assert np.array_equal(out, _reference(data, name, x.shape))
    xb, ob = x.reshape(-1, 32), out.reshape(-1, 32)
    amax = np.abs(xb).max(axis=1)
    span = xb.max(axis=1) - xb.min(axis=1)
    step = {"Q8_0": amax / 127, "Q4_0": amax / 8, "Q4_1": span / 15, "Q5_0": amax / 16, "Q5_1": span / 31}[name]
    assert np.all(np.abs(ob - xb).max(axis=1) <= step_factor * step + 1e-3 * amax * (name in ("Q4_1", "Q5_1")))


@pytest.mark.parametrize("name", PLAIN_TYPES)
def test_plain_types_exact(name):
    x = torch.randn(3, 5, 7) * 100
    stored = x.to(PLAIN_DTYPES[name])
    raw = stored.contiguous().view(-1).view(torch.uint8)
    out = gd.dequantize(raw, name, (3, 5, 7), torch.float32)
    assert torch.equal(out, stored.float())
    assert out.data_ptr() != raw.data_ptr()  # a fresh tensor: raw may be a read-only file mapping
    assert np.array_equal(out.numpy(), _reference(raw.numpy(), name, (3, 5, 7)))
    same = gd.dequantize(raw, name, (3, 5, 7), stored.dtype)
    assert torch.equal(same, stored) and same.data_ptr() != raw.data_ptr()


def test_bf16_matches_gguf_quantizer():
    x = np.random.default_rng(2).standard_normal((4, 32)).astype(np.float32)
    data = gguf.quants.quantize(x, QT.BF16).reshape(-1)
    assert np.array_equal(_ours(data, "BF16", x.shape).numpy(), _reference(data, "BF16", x.shape))


@pytest.mark.parametrize("name", QUANT_TYPES + PLAIN_TYPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_output_dtype_is_float32_result_cast(name, dtype):
    shape = (2, 256)
    data = _sample_bytes(name, seed=3)
    raw = torch.from_numpy(data)
    ref32 = gd.dequantize(raw, name, shape, torch.float32)
    out = gd.dequantize(raw, name, shape, dtype)
    assert out.dtype == dtype and out.shape == shape and out.is_contiguous()
    assert torch.equal(out, ref32.to(dtype))


@pytest.mark.parametrize("name", QUANT_TYPES + PLAIN_TYPES)
def test_output_stays_on_input_device(name):
    elems, nbytes = gd.block_layout(name)
    raw = torch.empty(512 // elems * nbytes, dtype=torch.uint8, device="meta")
    out = gd.dequantize(raw, name, (2, 256), torch.bfloat16)
    assert out.device.type == "meta" and out.shape == (2, 256) and out.dtype == torch.bfloat16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", QUANT_TYPES + PLAIN_TYPES)
def test_cuda_matches_cpu(name):
    data = _sample_bytes(name, seed=4)
    raw = torch.from_numpy(data)
    out = gd.dequantize(raw.cuda(), name, (2, 256), torch.float32)
    assert out.device.type == "cuda"
    assert torch.equal(out.cpu(), gd.dequantize(raw, name, (2, 256), torch.float32))


@pytest.mark.parametrize("name", QUANT_TYPES + PLAIN_TYPES)
def test_non_contiguous_and_misaligned_input(name):
    shape = (2, 256)
    data = _sample_bytes(name, seed=5)
    expected = _ours(data, name, shape)
    strided = torch.stack((torch.from_numpy(data), torch.zeros(data.size, dtype=torch.uint8)), dim=1)[:, 0]
    assert not strided.is_contiguous()
    assert torch.equal(gd.dequantize(strided, name, shape, torch.float32), expected)
    # a tensor cut at an odd byte offset of a bigger buffer, as a slice of an mmapped file can be
    odd = torch.cat((torch.zeros(1, dtype=torch.uint8), torch.from_numpy(data)))[1:]
    assert torch.equal(gd.dequantize(odd, name, shape, torch.float32), expected)
    assert torch.equal(gd.dequantize(torch.from_numpy(data).reshape(2, -1), name, shape, torch.float32), expected)


@pytest.mark.parametrize("name", ["IQ2_XXS", "Q2_K", "Q3_K", "Q8_K", "TQ1_0", "I8", "nonsense"])
def test_unsupported_type_is_named(name):
    with pytest.raises(gd.UnsupportedQuantType, match=name) as info:
        gd.dequantize(torch.zeros(64, dtype=torch.uint8), name, (1, 256), torch.float32)
    assert "Q4_K" in str(info.value) and "F32" in str(info.value)  # lists what is supported
    assert isinstance(info.value, ValueError)
    with pytest.raises(gd.UnsupportedQuantType, match=name):
        gd.block_layout(name)


def test_wrong_byte_count():
    with pytest.raises(ValueError, match=r"needs 288 bytes .*got 287"):
        gd.dequantize(torch.zeros(287, dtype=torch.uint8), "Q4_K", (2, 256), torch.float32)
    with pytest.raises(ValueError, match=r"needs 68 bytes"):
        gd.dequantize(torch.zeros(70, dtype=torch.uint8), "Q8_0", (2, 32), torch.float32)
    with pytest.raises(ValueError, match=r"needs 8 bytes"):
        gd.dequantize(torch.zeros(6, dtype=torch.uint8), "F16", (4,), torch.float32)


def test_last_dim_must_be_multiple_of_block():
    # (1536, 576) holds 3456 whole Q4_K blocks, but ggml blocks never straddle rows: 576 % 256 != 0
    with pytest.raises(ValueError, match=r"last dim 576 is not a multiple of the block size 256"):
        gd.dequantize(torch.zeros(3456 * 144, dtype=torch.uint8), "Q4_K", (1536, 576), torch.float32)
    with pytest.raises(ValueError, match=r"last dim 48 .* 32"):
        gd.dequantize(torch.zeros(3 * 34, dtype=torch.uint8), "Q8_0", (2, 48), torch.float32)


def test_raw_must_be_uint8():
    with pytest.raises(TypeError, match="uint8"):
        gd.dequantize(torch.zeros(8, dtype=torch.int8), "F16", (4,), torch.float32)
