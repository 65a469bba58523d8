"""The whole engine on the Triton kernels (interpreted on the CPU) gives the torch path's tokens."""

from __future__ import annotations

import pytest

from services.worker.engine.engine import LLMEngine
from services.worker.engine.engine_config import EngineConfig
from inferno.tools.make_model import write_model
from shared.sampling_params import SamplingParams


def test_triton_engine_matches_torch_engine(tmp_path):
    model_dir = write_model(tmp_path / "m", preset="tiny", seed=0, dtype="float32")
    prompts = [[5 + (i * 7 + j) % 200 for j in range(n)] for i, n in enumerate([5, 20, 37])]
    for params in (SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
                   SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=3, max_tokens=5, ignore_eos=True)):
        outputs = {}
        for kernels in ("torch", "triton"):
            # The GPU runs Triton with overlapped steps: so does the interpreted engine here.
            engine = LLMEngine(EngineConfig(model_dir=str(model_dir), num_blocks=64, kernels=kernels,
                                            overlap=kernels == "triton"))
            outputs[kernels] = engine.generate(prompts, params)
        assert outputs["triton"] == outputs["torch"]



@pytest.mark.parametrize("fp8", [{"kv_cache_dtype": "fp8"}, {"quantization": "fp8"}], ids=["kv-cache", "weights"])
def test_triton_engine_with_fp8_matches_torch_engine(fp8, tmp_path):
    """fp8 KV: the same bytes in both caches (the KV write rounds as torch does), read the same way.
    fp8 weights: GEMV rows (weight-only) and quantized GEMM rows, the same rule on both paths."""
    model_dir = write_model(tmp_path / "m", preset="tiny", seed=0, dtype="float32")
    prompts = [[5 + (i * 7 + j) % 200 for j in range(n)] for i, n in enumerate([5, 20, 37])]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    outputs = {kernels: LLMEngine(EngineConfig(model_dir=str(model_dir), num_blocks=64, kernels=kernels,
                                               **fp8)).generate(prompts, params)
               for kernels in ("torch", "triton")}
    assert outputs["triton"] == outputs["torch"]
