"""Llama 4's text model (iRoPE: chunked RoPE layers with QK-norm, global NoPE layers with temperature
tuning; top-1 experts that scale their input, a shared expert; dense layers between) against
transformers on the same random weights (float32, CPU): logits, greedy tokens, mixed batches."""

from __future__ import annotations

import json

import pytest
import torch

from inferno.tools.make_model import write_model
from services.worker.engine.model_config import ModelConfig, ModelConfigError, RopeScaling
from services.worker.engine.parallel.layout import ParallelConfigError, ParallelLayout
from shared.sampling_params import SamplingParams
from tests.models.conftest import assert_group_equals_one_process, eos_ids, hf_greedy, make_engine, random_prompt
from tests.models.test_transformers_parity import engine_prefill_logits, run_staggered

ARCH = "Llama4ForCausalLM"
N_NEW = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("llama4") / "tiny", arch=ARCH, preset="tiny", seed=2, dtype="float32")


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()


def test_configs_read_irope_chunks_and_experts(model_dir, tmp_path):
    tiny = ModelConfig.from_dir(model_dir)
    l4, moe = tiny.llama4, tiny.moe
    assert (l4.nope_layers, l4.chunked_layers, l4.attention_chunk_size) == ((1,), (0,), 16)
    assert l4.qk_norm and l4.temperature_tuning and (l4.floor_scale, l4.attn_scale) == (4.0, 0.5)
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.shared_intermediate_size) == (4, 1, 32, 32)
    assert moe.sparse_layers == (1,) and moe.scale_inputs and moe.scoring == "sigmoid" and not moe.shared_gate
    assert tiny.intermediate_size == 128  # the dense layer's: intermediate_size_mlp
    scout = ModelConfig.from_dir(write_model(tmp_path / "scout", preset="llama-4-scout-17b-16e", weights=False))
    assert scout.llama4.nope_layers == tuple(range(3, 48, 4)) and scout.llama4.attention_chunk_size == 8192
    assert scout.llama4.chunked_layers == tuple(i for i in range(48) if i % 4 != 3)
    assert scout.moe.sparse_layers == tuple(range(48)) and scout.moe.num_experts == 16
    assert (scout.intermediate_size, scout.moe.intermediate_size, scout.vocab_size) == (16384, 8192, 202048)
    assert scout.rope_scaling == RopeScaling(16.0, 1.0, 1.0, 8192) and scout.rope_theta == 500000.0
    maverick = ModelConfig.from_dir(write_model(tmp_path / "maverick", preset="llama-4-maverick-17b-128e",
                                                weights=False))
    assert maverick.moe.sparse_layers == tuple(range(1, 48, 2)) and not maverick.llama4.qk_norm
    # Explicit lists win over the intervals, as in Llama4TextConfig; no chunk size, no chunked layer.
    raw = json.loads((model_dir / "config.json").read_text())
    raw.update(no_rope_layers=[0, 1], moe_layers=[0], attention_chunk_size=None)
    other = ModelConfig.from_dict(raw)
    assert (other.llama4.nope_layers, other.llama4.chunked_layers, other.moe.sparse_layers) == ((0,), (), (0,))
    with pytest.raises(ModelConfigError, match="attention_chunk_size"):
        ModelConfig.from_dict({**raw, "layer_types": ["chunked_attention", "full_attention"]})
    # The stacked experts go to ranks whole.
    with pytest.raises(ParallelConfigError, match="expert-parallel"):
        ParallelLayout(tp=2).check(scout)
    ParallelLayout(tp=2, expert_parallel=True).check(scout)


def test_prefill_logits_and_greedy_tokens_match(model_dir, hf):
    """A 37-token prompt over three chunks; then 64 decodes crossing four more chunk borders, the
    temperature of the NoPE layer rising every fourth position."""
    engine = make_engine(model_dir)
    prompt = random_prompt(37, engine.model_config.vocab_size, seed=5)
    ours = engine_prefill_logits(engine, prompt)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    rel = (ours - ref).norm() / ref.norm()
    assert rel < 1e-5, f"relative error {rel:.2e}"
    eos = eos_ids(model_dir)
    [tokens] = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=N_NEW, min_tokens=N_NEW), eos)
    assert tokens == hf_greedy(hf, prompt, N_NEW, eos)


def test_cached_prefixes_chunked_prefills_and_mixed_batches_change_no_token(model_dir, hf):
    """Requests join a running batch; the later ones share a 24-token prefix with the first (their
    prefills start mid-chunk on cached pages); prefills come in pieces of at most 20 tokens, so a
    piece's queries straddle chunk borders, beside decodes."""
    engine = make_engine(model_dir, max_num_batched_tokens=20, overlap=True)
    eos = eos_ids(model_dir)
    vocab = engine.model_config.vocab_size
    shared = random_prompt(24, vocab, seed=9)
    prompts = [shared + random_prompt(n, vocab, seed=60 + i) for i, n in enumerate([15, 1, 30])]
    prompts.insert(1, random_prompt(11, vocab, seed=3))
    params = [SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12)] * len(prompts)
    expected = [hf_greedy(hf, p, 12, eos) for p in prompts]
    assert run_staggered(engine, prompts, eos, params) == expected
    assert engine.stats().prefix_cache_hits > 0


@pytest.mark.parametrize("group", [dict(tensor_parallel_size=2, enable_expert_parallel=True),
                                   dict(pipeline_parallel_size=2)], ids=["tp2-ep", "pp2"])
def test_a_group_equals_one_process(group, model_dir):
    """Two ranks (gloo): each with half the heads, half the dense and shared MLPs and two whole experts
    (rows of the stacked tensors, turned after the load); or a stage each, the second's one layer (NoPE,
    global, the experts) its layer 0."""
    assert_group_equals_one_process(model_dir, 80, 16, **group)
