"""--load-format dummy: weights drawn on the device from a config-only directory (shape benchmarks),
and the llama-3.1-70b preset's shapes."""

from __future__ import annotations

import math

import pytest
import torch

from services.worker.engine.engine import LLMEngine
from services.worker.engine.engine_config import EngineConfig
from services.worker.engine.loader import load_model
from inferno.tools.make_model import PRESETS, main as make_model_main, tensor_specs, write_model
from services.worker.engine.model_config import ModelConfig
from shared.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def config_only(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("dummy") / "tiny", preset="tiny", dtype="float32", weights=False)


def test_a_config_only_directory_has_no_weights_and_needs_dummy(config_only):
    assert (config_only / "config.json").is_file() and (config_only / "tokenizer.json").is_file()
    assert not list(config_only.glob("*.safetensors"))
    with pytest.raises(Exception, match="safetensors|missing"):
        load_model(config_only)


def test_dummy_weights_are_drawn_deterministically_and_serve(config_only):
    a, b = load_model(config_only, load_format="dummy", seed=3), load_model(config_only, load_format="dummy", seed=3)
    for (name, x), (_, y) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(x, y), name
        assert torch.isfinite(x).all(), name
    c = load_model(config_only, load_format="dummy", seed=4)
    assert not torch.equal(a.embed_tokens.weight, c.embed_tokens.weight)
    norms = [p for n, p in a.named_parameters() if p.dim() == 1]
    assert all(abs(p.mean().item() - 1.0) < 0.2 for p in norms)

    def generate():
        engine = LLMEngine(EngineConfig(model_dir=str(config_only), device="cpu", dtype="float32", num_blocks=64,
                                        load_format="dummy", seed=3))
        return engine.generate([[5, 6, 7, 8, 9]], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))

    assert generate() == generate() and len(generate()[0]) == 12


def test_llama_3_1_70b_preset_has_the_real_shapes(tmp_path):
    assert make_model_main([str(tmp_path / "70b"), "--preset", "llama-3.1-70b", "--config-only", "--quiet"]) == 0
    cfg = ModelConfig.from_path(tmp_path / "70b")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (8192, 80, 64, 8)
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.head_dim) == (28672, 128256, 128)
    assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 8.0
    params = sum(math.prod(s.shape) for s in tensor_specs("LlamaForCausalLM", PRESETS["llama-3.1-70b"], 128256, False))
    assert params == 70_553_706_496  # Llama-3.1-70B's parameter count
