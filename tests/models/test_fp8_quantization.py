"""--quantization fp8: every layer projection becomes e4m3 with per-channel scales (embeddings and
the LM head stay), and the engine's logits stay near the unquantized model's."""

from __future__ import annotations

import pytest
import torch

from services.worker.engine.engine_config import EngineConfig
from services.worker.engine.layers import Linear
from shared.sampling_params import SamplingParams
from tests.models.conftest import make_engine, random_prompt
from tests.models.test_transformers_parity import engine_prefill_logits


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM"])  # Qwen2: projections with biases
def test_fp8_projections_and_logits_near_the_full_model(arch, model_dirs):
    full, fp8 = make_engine(model_dirs[arch]), make_engine(model_dirs[arch], quantization="fp8")
    linears = [m for m in fp8.model.layers.modules() if isinstance(m, Linear)]
    assert linears and all(m.weight.dtype == torch.float8_e4m3fn and m.weight_scale is not None for m in linears)
    assert fp8.model.embed_tokens.weight.dtype == torch.float32
    prompt = random_prompt(45, full.model_config.vocab_size, seed=3)
    ref, ours = engine_prefill_logits(full, prompt), engine_prefill_logits(fp8, prompt)
    rel = float((ours - ref).norm() / ref.norm())
    assert 0 < rel < 0.1, rel
    top = ref.topk(5, dim=-1).indices
    assert (ours.argmax(-1)[:, None] == top).any(-1).float().mean() > 0.9


def test_fp8_weights_with_an_fp8_cache_serve_to_the_end(model_dirs):
    engine = make_engine(model_dirs["LlamaForCausalLM"], quantization="fp8", kv_cache_dtype="fp8",
                         max_num_batched_tokens=32)
    vocab = engine.model_config.vocab_size
    prompts = [random_prompt(n, vocab, seed=n) for n in (9, 40, 70)]
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    assert [len(o) for o in outs] == [10, 10, 10]


def test_unknown_quantization_is_refused():
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(model_dir="x", quantization="int4")
