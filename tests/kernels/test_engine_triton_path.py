"""The whole engine on the Triton kernels (interpreted on the CPU) gives the torch path's tokens."""

from __future__ import annotations

import dataclasses
import json

from safetensors.torch import load_file, save_file

from services.worker.engine.engine import LLMEngine
from services.worker.engine.engine_config import EngineConfig
from inferno.tools import make_model
from shared.sampling_params import SamplingParams

VOCAB = 128
# Three prompts, so a decode step has three rows (the GEMV, the norm and the activation apart):
# the longest spans two KV pages and two query tiles of the prefill.
PROMPTS = [[5 + (i * 7 + j) % 100 for j in range(n)] for i, n in enumerate([3, 9, 17])]


def _model(tmp_path, monkeypatch, arch=None):
    """The tiny preset at half its width (two layers, GQA, head_dim 16 and its rope scaling kept) with
    the first VOCAB rows of its vocabulary: the interpreter's cost is the GEMV's programs, one per
    four output rows, most of them the LM head's (1,024 rows at the tiny preset's vocabulary)."""
    tiny = make_model.PRESETS["tiny"]
    monkeypatch.setitem(make_model.PRESETS, "kernels", dataclasses.replace(tiny, hidden_size=32, intermediate_size=32))
    model_dir = make_model.write_model(tmp_path / "m", arch=arch, preset="kernels", seed=0, dtype="float32")
    weights = load_file(model_dir / "model.safetensors")
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        weights[name] = weights[name][:VOCAB].contiguous()
    save_file(weights, model_dir / "model.safetensors")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "vocab_size": VOCAB}))
    return model_dir


def test_triton_engine_matches_torch_engine(tmp_path, monkeypatch):
    """Greedy and sampled requests (top-k, top-p, seeded) in one batch, prefill and two decode steps;
    the GPU runs Triton with overlapped steps, so does the interpreted engine here."""
    model_dir = _model(tmp_path, monkeypatch)
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    sampled = [SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=seed, max_tokens=3, ignore_eos=True)
               for seed in (3, 4)]
    outputs = {kernels: LLMEngine(EngineConfig(model_dir=str(model_dir), num_blocks=64, kernels=kernels,
                                               overlap=kernels == "triton")).generate(PROMPTS, [greedy, *sampled])
               for kernels in ("torch", "triton")}
    assert outputs["triton"] == outputs["torch"]


def test_triton_engine_with_fp8_matches_torch_engine(tmp_path, monkeypatch):
    """fp8 KV: the same bytes in both caches (the KV write rounds as torch does), read the same way by
    the prefill and the decode. fp8 weights: GEMV rows (weight-only) and quantized GEMM rows (the
    prefill), the same rule on both paths. Both at once: each is checked by every token."""
    model_dir = _model(tmp_path, monkeypatch)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    outputs = {kernels: LLMEngine(EngineConfig(model_dir=str(model_dir), num_blocks=64, kernels=kernels,
                                               kv_cache_dtype="fp8", quantization="fp8")).generate(PROMPTS, params)
               for kernels in ("torch", "triton")}
    assert outputs["triton"] == outputs["torch"]


def test_triton_engine_serves_a_mixture_of_experts_as_torch(tmp_path, monkeypatch):
    """Qwen3-MoE's experts: the prefill through the grouped GEMMs, the decode through the GEMV path,
    the router's kernel; then fp8 experts (the same per-row rule on both paths)."""
    model_dir = _model(tmp_path, monkeypatch, arch="Qwen3MoeForCausalLM")
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    for quantization in (None, "fp8"):
        outputs = {kernels: LLMEngine(EngineConfig(model_dir=str(model_dir), num_blocks=64, kernels=kernels,
                                                   quantization=quantization)).generate(PROMPTS, params)
                   for kernels in ("torch", "triton")}
        assert outputs["triton"] == outputs["torch"], quantization


def test_triton_engine_serves_latent_attention_as_torch(tmp_path, monkeypatch):
    """DeepSeek-V3: the latent cache's rotary write, the expanded prefill, the absorbed decode kernel
    and the grouped router with its shared expert; then fp8 latents and fp8 weights."""
    model_dir = _model(tmp_path, monkeypatch, arch="DeepseekV3ForCausalLM")
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    for quantization in (None, "fp8"):
        kv = "fp8" if quantization else "auto"
        outputs = {kernels: LLMEngine(EngineConfig(model_dir=str(model_dir), num_blocks=64, kernels=kernels,
                                                   quantization=quantization, kv_cache_dtype=kv)).generate(
            PROMPTS, params) for kernels in ("torch", "triton")}
        assert outputs["triton"] == outputs["torch"], quantization


def test_triton_engine_serves_llama4_as_torch(tmp_path, monkeypatch):
    """Llama 4: a chunked RoPE layer (interleaved rotary with the QK-norm in the KV write, the 17-token
    prompt over two chunks of 16) and a global NoPE layer (temperature-scaled queries, input-scaled
    top-1 experts through the router's kernel and the grouped GEMMs, then the GEMV path)."""
    model_dir = _model(tmp_path, monkeypatch, arch="Llama4ForCausalLM")
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    outputs = {kernels: LLMEngine(EngineConfig(model_dir=str(model_dir), num_blocks=64, kernels=kernels)).generate(
        PROMPTS, params) for kernels in ("torch", "triton")}
    assert outputs["triton"] == outputs["torch"]
