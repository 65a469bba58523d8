"""Lossless BF16 compression: the exponent codec round-trips every bit pattern, chunk edges and skewed
tables, and `inferno compress` writes a directory that decodes to its source's bytes."""

from __future__ import annotations

import json

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from inferno.tools.compress import FORMAT, compress
from inferno.tools.make_model import write_model
from shared.exponent_codec import CHUNK, MAX_CODE_BITS, code_lengths, decode, encode


def roundtrip(values: np.ndarray, chunk: int = CHUNK) -> None:
    coded = encode(values, chunk)
    assert np.array_equal(decode(coded, chunk), values) and decode(coded, chunk).shape == values.shape


@settings(max_examples=60, deadline=None)
@given(arrays(np.uint16, st.integers(0, 3 * 64 + 5)), st.sampled_from([8, 64]))
def test_any_bit_patterns_round_trip(values, chunk):
    roundtrip(values, chunk)  # short, exact and ragged last chunks; any exponent, sign, NaN or Inf


def test_a_tensor_encoded_in_slices_is_the_one_encoded_whole():
    values = np.random.default_rng(3).integers(0, 1 << 16, 5 * 64 + 7, dtype=np.uint16)
    whole, sliced = encode(values, 64, slice_values=1 << 20), encode(values, 64, slice_values=100)  # 100 → 64
    for part in ("lengths", "bits", "starts", "sign_mantissa"):
        assert np.array_equal(getattr(whole, part), getattr(sliced, part))


def test_every_bf16_pattern_and_a_single_symbol_round_trip():
    roundtrip(np.arange(1 << 16, dtype=np.uint16))  # zero, subnormals, inf and nan patterns among them
    roundtrip(np.full((3, 5), 0x3F80, dtype=np.uint16))


def test_codes_stay_short_for_a_skewed_table():
    counts = np.zeros(256, dtype=np.int64)
    counts[:40] = 2 ** np.arange(40, dtype=np.int64) // 2 ** 20 + 1  # a Fibonacci-like spread: deep Huffman trees
    lengths = code_lengths(counts)
    assert lengths.max() <= MAX_CODE_BITS and (lengths[:40] > 0).all()
    assert sum(2.0 ** -int(l) for l in lengths if l) <= 1.0  # a prefix code (Kraft)


def test_weights_of_a_model_shrink_to_two_thirds():
    w = (torch.randn(256, 512) * 0.02).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    coded = encode(w)
    assert 8 * coded.nbytes / w.size < 11.2  # ≤ 70 % of BF16's 16 bits
    roundtrip(w)


def test_compress_writes_a_directory_that_decodes_to_its_source(tmp_path):
    from safetensors.torch import load_file

    model = write_model(tmp_path / "m", preset="tiny", seed=0, dtype="bfloat16")
    summary = compress(model, tmp_path / "z", verify=True)
    assert (tmp_path / "z" / "config.json").read_text() == (model / "config.json").read_text()
    assert (tmp_path / "z" / "tokenizer.json").is_file()
    from services.worker.engine.compressed_weights import load_compressed_weights

    source = load_file(model / "model.safetensors")
    got = {name: torch.empty(t.numel(), dtype=t.dtype) for name, t in source.items()}
    load_compressed_weights(tmp_path / "z", list(got), got.__getitem__)  # the loader's path, every tensor
    for name, t in source.items():
        assert np.array_equal(got[name].view(torch.int16).numpy(), t.reshape(-1).view(torch.int16).numpy()), name
    assert summary["q_proj"]["bits_per_weight"] < 11.2
    header = json.loads((tmp_path / "z" / "model.safetensors").read_bytes()[8:][:int.from_bytes(
        (tmp_path / "z" / "model.safetensors").read_bytes()[:8], "little")])
    assert header["__metadata__"]["inferno.compression"] == FORMAT


def test_an_engine_serves_a_compressed_directory_as_the_source(tmp_path):
    """The loader decodes a compressed directory's tensors into place: the same greedy tokens."""
    from services.worker.engine.engine import LLMEngine
    from services.worker.engine.engine_config import EngineConfig
    from shared.sampling_params import SamplingParams

    model = write_model(tmp_path / "m", preset="tiny", seed=0, dtype="bfloat16")
    compress(model, tmp_path / "z")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [[5, 17, 300, 42], list(range(20, 60))]
    outputs = [LLMEngine(EngineConfig(model_dir=str(d), num_blocks=64, dtype="float32")).generate(prompts, params)
               for d in (model, tmp_path / "z")]
    assert outputs[0] == outputs[1]
