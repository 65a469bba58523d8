"""--kv-cache-dtype fp8: the pool holds e4m3 bytes (a quarter of float32's, half of bf16's), the
engine's logits stay near those of a full-precision cache, and pages move as bytes."""

from __future__ import annotations

import pytest
import torch

from services.worker.engine.engine_config import EngineConfig
from services.worker.engine.kv_pages import gather_pages, scatter_pages
from shared.sampling_params import SamplingParams
from tests.models.conftest import make_engine, random_prompt
from tests.models.test_transformers_parity import engine_prefill_logits


def test_fp8_pool_and_logits_near_full_precision(model_dirs):
    model = model_dirs["LlamaForCausalLM"]
    full, fp8 = make_engine(model), make_engine(model, kv_cache_dtype="fp8")
    assert fp8.kv_cache.pool.dtype == torch.float8_e4m3fn
    assert fp8.kv_cache.nbytes * 4 == full.kv_cache.nbytes
    prompt = random_prompt(45, full.model_config.vocab_size, seed=3)
    ref, ours = engine_prefill_logits(full, prompt), engine_prefill_logits(fp8, prompt)
    rel = float((ours - ref).norm() / ref.norm())
    assert 0 < rel < 0.05, rel  # rounded (so not equal), but close
    top = ref.topk(5, dim=-1).indices
    assert (ours.argmax(-1)[:, None] == top).any(-1).float().mean() > 0.95


def test_fp8_engine_serves_chunked_prefill_and_decodes(model_dirs):
    """Prompts over several chunks (each chunk reads the fp8 KV of the ones before), a shared
    prefix from the cache, and decodes: every request runs to its length."""
    engine = make_engine(model_dirs["LlamaForCausalLM"], kv_cache_dtype="fp8_e4m3", max_num_batched_tokens=32)
    vocab = engine.model_config.vocab_size
    prefix = random_prompt(40, vocab, seed=5)
    prompts = [prefix + random_prompt(9, vocab, seed=6), prefix + random_prompt(13, vocab, seed=7)]
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert [len(o) for o in outs] == [12, 12]
    assert all(0 <= t < vocab for o in outs for t in o)


def test_fp8_pages_round_trip_as_bytes(model_dirs):
    engine = make_engine(model_dirs["LlamaForCausalLM"], kv_cache_dtype="fp8", num_blocks=8)
    pool = engine.kv_cache.pool
    pool.view(torch.uint8).copy_(torch.randint(0, 120, pool.shape, dtype=torch.uint8))  # finite e4m3 bytes
    pages = gather_pages(engine.kv_cache, [5, 2])
    assert pages.dtype == torch.float8_e4m3fn and pages.shape[0] == 2
    scatter_pages(engine.kv_cache, [0, 1], pages)
    assert torch.equal(pool[:, :, 0].view(torch.uint8), pool[:, :, 5].view(torch.uint8))
    assert torch.equal(pool[:, :, 1].view(torch.uint8), pool[:, :, 2].view(torch.uint8))


def test_unknown_kv_cache_dtype_is_refused():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(model_dir="x", kv_cache_dtype="int4")
