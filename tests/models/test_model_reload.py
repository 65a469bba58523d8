"""A worker's model builds (services/worker/model_build.py): a bad model refused before anything is
freed, with a message that names what is wrong; a replaced model's KV pool reused by a model of the
same KV shape (same tensor, zeroed, same tokens as a fresh engine) and freed for any other."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from inferno.tools.make_model import write_model
from services.worker.model_build import (Leftovers, ModelCheckError, ModelSpec, build_model, check_model,
                                         release_model)
from services.worker.prefetch import Prefetch, start_prefetch, weight_files
from shared.config import WorkerServiceConfig
from shared.sampling_params import SamplingParams
from tests.models.conftest import make_engine, random_prompt

CFG = WorkerServiceConfig(device="cpu", num_blocks=64, dtype="float32", max_num_seqs=16, max_num_batched_tokens=512,
                          kvstore="off")
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0)


def spec(model_dir, **kw) -> ModelSpec:
    return ModelSpec.of(CFG, str(model_dir), **kw)


def test_bad_models_are_refused_with_the_reason(model_dirs, tmp_path):
    with pytest.raises(ModelCheckError, match="no such model directory"):
        check_model(spec(tmp_path / "missing"), CFG)
    no_weights = tmp_path / "no-weights"
    shutil.copytree(model_dirs["LlamaForCausalLM"], no_weights)
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(ModelCheckError, match="no \\*.safetensors weights"):
        check_model(spec(no_weights), CFG)
    odd = tmp_path / "odd-arch"
    shutil.copytree(model_dirs["LlamaForCausalLM"], odd)
    config = json.loads((odd / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelCheckError, match="GPT2LMHeadModel"):
        check_model(spec(odd), CFG)
    no_tokenizer = tmp_path / "no-tokenizer"
    shutil.copytree(model_dirs["LlamaForCausalLM"], no_tokenizer)
    (no_tokenizer / "tokenizer.json").unlink()
    with pytest.raises(ModelCheckError, match="tokenizer.json"):
        check_model(spec(no_tokenizer), CFG)


def test_spec_defaults_from_the_worker(model_dirs):
    s = ModelSpec.of(CFG, "/models/llama-3.1-8b")
    assert (s.model_name, s.dtype, s.max_model_len, s.load_format) == ("llama-3.1-8b", "float32", None, "auto")
    assert ModelSpec.of(CFG, "/m/x.Q4_K.gguf").model_name == "x.Q4_K"
    assert ModelSpec.of(CFG, "/m/a", "served", "bfloat16", 512, "dummy") == \
        ModelSpec("/m/a", "served", "bfloat16", 512, "dummy")


def test_replace_reuses_the_kv_pool_of_the_same_shape(model_dirs):
    a, b = model_dirs["LlamaForCausalLM"], model_dirs["Qwen2ForCausalLM"]  # one KV shape, other weights
    checked_a, checked_b = check_model(spec(a), CFG), check_model(spec(b), CFG)
    assert checked_a.kv_shape == checked_b.kv_shape == (2, 2, 2, 16, "float32")  # layers, K+V, heads, dim
    built = build_model(checked_a, CFG, cuda_graphs=True, overlap=False)
    vocab = built.engine.model_config.vocab_size
    prompts = [random_prompt(n, vocab, seed=40 + n) for n in (5, 37, 70)]
    assert built.engine.generate(prompts, GREEDY) == make_engine(a, num_blocks=64).generate(prompts, GREEDY)
    pool = built.engine.kv_cache.pool
    assert pool.abs().sum() > 0  # the prompts' KV is in it

    leftovers = release_model(built, CFG, checked_b)
    assert built.engine is None and leftovers.kv_cache.pool is pool
    replaced = build_model(checked_b, CFG, cuda_graphs=True, overlap=False, leftovers=leftovers)
    assert replaced.engine.kv_cache.pool is pool and replaced.timings["kv_reused"]
    assert pool.abs().sum() == 0  # handed over as a new pool would be
    assert replaced.engine.generate(prompts, GREEDY) == make_engine(b, num_blocks=64).generate(prompts, GREEDY)


def test_replace_frees_a_kv_pool_of_another_shape(model_dirs, tmp_path):
    deeper = write_model(tmp_path / "deeper", preset="tiny", seed=3, dtype="float32", weights=False)
    config = json.loads((deeper / "config.json").read_text())
    (deeper / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    checked_deeper = check_model(spec(deeper, load_format="dummy"), CFG)
    assert checked_deeper.kv_shape == (3, 2, 2, 16, "float32")
    built = build_model(check_model(spec(model_dirs["LlamaForCausalLM"]), CFG), CFG, True, False)
    leftovers = release_model(built, CFG, checked_deeper)
    assert leftovers.kv_cache is None
    other = build_model(checked_deeper, CFG, True, False, leftovers)
    assert other.engine.kv_cache.pool.shape[0] == 3 and not other.timings["kv_reused"]
    assert len(other.engine.generate([[5, 6, 7]], GREEDY)[0]) == 12


def test_release_without_a_next_model_keeps_nothing(model_dirs):
    built = build_model(check_model(spec(model_dirs["LlamaForCausalLM"]), CFG), CFG, True, False)
    assert release_model(built, CFG) == Leftovers()


def test_prefetch_reads_ahead_every_weight_file(model_dirs, tmp_path):
    files = weight_files(model_dirs["LlamaForCausalLM"])
    assert [f.name for f in files] == ["model.safetensors"]
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        (sharded / name).write_bytes(b"\0" * 3000)
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    assert [f.name for f in weight_files(sharded)] == ["model-00001-of-00002.safetensors",
                                                       "model-00002-of-00002.safetensors"]
    prefetch = Prefetch(weight_files(sharded), threads=2, chunk_bytes=1000).start()
    for t in prefetch.threads:
        t.join(10)
    report = prefetch.report()
    assert prefetch.done and len(prefetch.chunks) == 6 and report["prefetch_s"] >= 0
    assert prefetch.read_bytes == 0  # just written: every page is cached, nothing to read
    assert start_prefetch(tmp_path / "missing") is None


def test_kv_pool_device_and_dtype_match_the_engine(model_dirs):
    built = build_model(check_model(spec(model_dirs["LlamaForCausalLM"]), CFG), CFG, True, False)
    assert built.engine.kv_cache.pool.dtype == torch.float32 == built.engine.dtype
