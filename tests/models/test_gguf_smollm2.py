"""A real model from a real GGUF file (SmolLM2-135M-Instruct, Q4_1) against transformers' own GGUF
loading of the same file: config, weights, tokenizer, chat template, logits and greedy tokens."""

from __future__ import annotations

import pytest
import torch

from services.worker.engine.loader import load_model
from services.worker.engine.model_config import ModelConfig
from shared.sampling_params import SamplingParams
from shared.tokenizer import Tokenizer
from tests.conftest import left_padded
from tests.models.conftest import make_engine
from tests.models.test_transformers_parity import engine_prefill_logits

N_NEW = 48

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Explain what a GPU is, in a few sentences."}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help you today?"},
     {"role": "user", "content": "Write a short story about a robot who learns to paint."}],
]
COMPLETIONS = [
    "The three primary colors are",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea,",
]
TEXTS = ["Hello world 12345", "  leading spaces\n\nand\ttabs", "Ünïcödé 日本語 🔥", "it's we'll 3.14159 x=42;",
         "<|im_start|>user\nhi<|im_end|>", "<think>reasoning</think> " + "a" * 40, "don't\r\n  stop"]


@pytest.fixture(scope="module")
def ours(smollm2_gguf):
    return Tokenizer.from_path(smollm2_gguf)


@pytest.fixture(scope="module")
def engine(smollm2_gguf):
    return make_engine(smollm2_gguf, num_blocks=512, max_num_batched_tokens=1024)


def test_config_from_metadata_matches_transformers(smollm2_gguf, smollm2_hf):
    cfg, hf = ModelConfig.from_path(smollm2_gguf), smollm2_hf[1].config
    assert cfg.architecture == "LlamaForCausalLM"
    for ours_key, hf_key in [("vocab_size",) * 2, ("hidden_size",) * 2, ("intermediate_size",) * 2,
                             ("num_hidden_layers",) * 2, ("num_attention_heads",) * 2,
                             ("num_key_value_heads",) * 2, ("head_dim",) * 2, ("max_position_embeddings",) * 2,
                             ("tie_word_embeddings",) * 2, ("rms_norm_eps",) * 2]:
        assert getattr(cfg, ours_key) == getattr(hf, hf_key), ours_key
    assert cfg.rope_theta == hf.rope_parameters["rope_theta"] == 100000.0
    assert cfg.rope_scaling is None


def test_weights_equal_transformers_dequantization(smollm2_gguf, smollm2_hf):
    """Every parameter bit-identical: same dequantization, q/k rows un-permuted the same way."""
    model = load_model(smollm2_gguf, "cpu", torch.float32)
    sd = smollm2_hf[1].state_dict()
    p = dict(model.named_parameters())
    assert torch.equal(p["embed_tokens.weight"], sd["model.embed_tokens.weight"])
    assert torch.equal(p["norm"], sd["model.norm.weight"])
    for i in range(model.cfg.num_hidden_layers):
        hf = f"model.layers.{i}."
        qkv = torch.cat([sd[hf + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        assert torch.equal(p[f"layers.{i}.self_attn.qkv_proj.weight"], qkv), i
        assert torch.equal(p[f"layers.{i}.self_attn.o_proj.weight"], sd[hf + "self_attn.o_proj.weight"])
        gate_up = torch.cat([sd[hf + "mlp.gate_proj.weight"], sd[hf + "mlp.up_proj.weight"]])
        assert torch.equal(p[f"layers.{i}.mlp.gate_up_proj.weight"], gate_up)
        assert torch.equal(p[f"layers.{i}.mlp.down_proj.weight"], sd[hf + "mlp.down_proj.weight"])
        assert torch.equal(p[f"layers.{i}.input_layernorm"], sd[hf + "input_layernorm.weight"])
        assert torch.equal(p[f"layers.{i}.post_attention_layernorm"], sd[hf + "post_attention_layernorm.weight"])


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_matches_transformers(text, ours, smollm2_hf):
    hf_tok = smollm2_hf[0]
    ids = ours.encode(text)
    assert ids == hf_tok(text).input_ids
    assert ours.decode(ids, skip_special_tokens=False) == hf_tok.decode(ids) == text
    assert ours.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)


def test_special_tokens_and_stops(ours):
    assert (ours.bos_token, ours.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert ours.eos_token_ids == (2,)
    assert len(ours) == 49152 and len(ours.all_special_ids) == 17


@pytest.mark.parametrize("messages", CHATS)
def test_chat_template_rendered_identically(messages, ours, smollm2_hf):
    hf_tok = smollm2_hf[0]
    for gen_prompt in (True, False):
        text = ours.apply_chat_template(messages, add_generation_prompt=gen_prompt)
        assert text == hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen_prompt)
    assert ours.encode_chat(messages) == hf_tok.apply_chat_template(
        messages, add_generation_prompt=True, return_dict=False)


def hf_generate(model, prompts: list[list[int]], n: int):
    """Greedy tokens and the log-probability of each, EOS suppressed for n tokens: per prompt, all
    prompts in one left-padded batch (one generate call; the padding is masked out)."""
    ids, mask = left_padded(prompts)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=2)
    logprobs = torch.stack(out.logits, 1).float().log_softmax(-1)  # [prompts, n, vocab]
    tokens = out.sequences[:, ids.shape[1]:]
    picked = logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return [(t.tolist(), lp.tolist()) for t, lp in zip(tokens, picked)]


def _prompts(tok):
    return [tok.encode_chat(m) for m in CHATS] + [tok.encode(t) for t in COMPLETIONS]


def test_greedy_tokens_and_logprobs_match_transformers(engine, ours, smollm2_hf):
    """Six prompts (three chats, three completions), 48 greedy tokens each, run as one batch."""
    prompts = _prompts(ours)
    params = SamplingParams(temperature=0.0, max_tokens=N_NEW, min_tokens=N_NEW, logprobs=0)
    ids = [f"p{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, params, (2,))
    tokens = {rid: [] for rid in ids}
    logprobs = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            logprobs[out.request_id].extend(out.logprobs or [])
    for rid, (want_tokens, want_logprobs) in zip(ids, hf_generate(smollm2_hf[1], prompts, N_NEW)):
        assert tokens[rid] == want_tokens, rid
        assert len(logprobs[rid]) == N_NEW
        assert max(abs(a - b) for a, b in zip(logprobs[rid], want_logprobs)) < 1e-3, rid
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks


def test_prefill_logits_match_transformers(smollm2_gguf, ours, smollm2_hf):
    prompt = ours.encode_chat(CHATS[2])
    logits = engine_prefill_logits(make_engine(smollm2_gguf), prompt)  # a fresh engine: no prefix hits
    with torch.no_grad():
        ref = smollm2_hf[1](torch.tensor([prompt])).logits[0].float()
    assert ((logits - ref).norm() / ref.norm()).item() < 1e-4


def test_the_model_answers_in_english(engine, ours):
    [out] = engine.generate([ours.encode_chat(CHATS[0])], SamplingParams(temperature=0.0, max_tokens=20), (2,))
    assert ours.decode(out) == "The capital of France is Paris."
