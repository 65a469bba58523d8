"""Random-weight tiny models of every supported architecture, and their transformers twins."""

from __future__ import annotations

import json

import pytest
import torch

from services.worker.engine.engine import LLMEngine
from services.worker.engine.engine_config import EngineConfig
from inferno.tools.make_model import write_model

ARCHS = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
MOE_ARCHS = ["MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM"]


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """One float32 tiny model per architecture (Qwen3 tied, the others untied; Llama with llama3 rope)."""
    root = tmp_path_factory.mktemp("models")
    return {
        arch: write_model(root / arch, arch=arch, preset="tiny", seed=1, dtype="float32",
                          tie_word_embeddings=arch == "Qwen3ForCausalLM")
        for arch in ARCHS
    }


@pytest.fixture(scope="session")
def hf_models(model_dirs):
    from transformers import AutoModelForCausalLM

    cache = {}

    def get(arch):
        if arch not in cache:
            cache[arch] = AutoModelForCausalLM.from_pretrained(
                model_dirs[arch], torch_dtype=torch.float32, attn_implementation="eager").eval()
        return cache[arch]

    return get


def eos_ids(model_dir) -> tuple[int, ...]:
    eos = json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"]
    return tuple(eos if isinstance(eos, list) else [eos])


def make_engine(model_dir, **overrides) -> LLMEngine:
    kwargs = dict(model_dir=str(model_dir), device="cpu", dtype="float32", num_blocks=256,
                  max_num_batched_tokens=512, max_num_seqs=16)
    kwargs.update(overrides)
    return LLMEngine(EngineConfig(**kwargs))


def random_prompt(length: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, vocab, (length,), generator=g).tolist()


def hf_greedy(hf_model, prompt: list[int], n: int, eos: tuple[int, ...]) -> list[int]:
    """transformers' greedy generate with EOS suppressed for n tokens (min_new_tokens)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                do_sample=False, eos_token_id=list(eos), pad_token_id=eos[0])
    return out[0, len(prompt):].tolist()


def run_requests(engine, prompts, params, eos=(), matchers=None):
    """Add every request (`matchers`: per request a function making its grammar's matcher, or None),
    step until done; per request its tokens and finish reason, and the forwards taken."""
    for i, (p, sp) in enumerate(zip(prompts, params)):
        make = matchers[i] if matchers else None
        engine.add_request(f"r{i}", p, sp, eos, matcher=make() if make else None)
    out, finish, steps = {f"r{i}": [] for i in range(len(prompts))}, {}, engine.steps
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
            if o.finished:
                finish[o.request_id] = o.finish_reason
    return [(out[f"r{i}"], finish.get(f"r{i}")) for i in range(len(prompts))], engine.steps - steps


def assert_group_equals_one_process(model_dir, seed: int, max_tokens: int, check=None, **group) -> None:
    """Greedy tokens of a parallel group (`group`: its EngineConfig fields; gloo ranks) on three prompts
    (9, 33 and 2 tokens), equal to one float64 process's; `check(engine, prompts)` runs on the group's
    engine before it closes."""
    from services.worker.engine.model_config import ModelConfig
    from shared.sampling_params import SamplingParams

    eos = eos_ids(model_dir)
    vocab = ModelConfig.from_dir(model_dir).vocab_size
    prompts = [random_prompt(n, vocab, seed=seed + n) for n in (9, 33, 2)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens)
    want = make_engine(model_dir, dtype="float64").generate(prompts, params, eos)
    engine = make_engine(model_dir, dtype="float64", max_num_batched_tokens=16, **group)
    try:
        assert engine.generate(prompts, params, eos) == want
        if check is not None:
            check(engine, prompts)
    finally:
        engine.close()
