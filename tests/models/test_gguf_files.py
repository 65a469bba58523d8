"""GGUF files written from the tiny random models the way llama.cpp writes them: every supported
architecture round-trips to the same logits as its safetensors directory, quantized files match
transformers' own GGUF loading, and bad files fail with errors that name the problem."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.worker.engine.loader import WeightLoadError, load_model
from services.worker.engine.model_config import ModelConfig, RopeFreqFactors
from shared.gguf_file import GGUFError
from shared.tokenizer import Tokenizer, TokenizerError
from tests.models.conftest import ARCHS, eos_ids, make_engine, random_prompt
from tests.models.gguf_builder import write_gguf
from tests.models.test_transformers_parity import engine_prefill_logits, greedy

gguf = pytest.importorskip("gguf", reason="the gguf package writes the test files")


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("arch", ARCHS)
def test_f32_file_is_the_same_model_as_its_directory(arch, model_dirs, gguf_dir):
    """Names, q/k permutation, biases, q/k norms, tied heads and llama3 rope (as rope_freqs) survive."""
    path = write_gguf(model_dirs[arch], gguf_dir / f"{arch}.gguf")
    cfg_dir, cfg_file = ModelConfig.from_dir(model_dirs[arch]), ModelConfig.from_path(path)
    expected_arch = "LlamaForCausalLM" if arch == "MistralForCausalLM" else arch
    assert cfg_file.architecture == expected_arch
    assert cfg_file.tie_word_embeddings == cfg_dir.tie_word_embeddings
    if arch == "LlamaForCausalLM":
        assert isinstance(cfg_file.rope_scaling, RopeFreqFactors)
    from_dir, from_file = make_engine(model_dirs[arch]), make_engine(path)
    prompt = random_prompt(45, cfg_dir.vocab_size, seed=3)
    assert rel(engine_prefill_logits(from_file, prompt), engine_prefill_logits(from_dir, prompt)) < 1e-6
    eos = eos_ids(model_dirs[arch])
    assert from_file.generate([prompt], greedy(), eos) == from_dir.generate([prompt], greedy(), eos)


# Mistral is written as "llama" (q/k permuted, no rope scaling: the tiny Llama's llama3 rope_freqs are
# ignored by transformers' GGUF loader). Qwen3 is left out: transformers' GGUF mapping ignores
# key_length and assumes head_dim 128, which the tiny model does not have (its F32 round trip above
# covers it).
@pytest.mark.parametrize("arch", ["MistralForCausalLM", "Qwen2ForCausalLM"])
@pytest.mark.parametrize("qtype", ["F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_quantized_file_matches_transformers_gguf_loading(arch, qtype, model_dirs, gguf_dir):
    from transformers import AutoModelForCausalLM

    path = write_gguf(model_dirs[arch], gguf_dir / f"{arch}-{qtype}.gguf", matrix_type=qtype)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    engine = make_engine(path)
    prompt = random_prompt(40, engine.model_config.vocab_size, seed=5)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    assert rel(engine_prefill_logits(engine, prompt), ref) < 1e-4


def test_tokenizer_from_metadata_matches_the_directory(model_dirs, gguf_dir):
    d = model_dirs["LlamaForCausalLM"]
    path = write_gguf(d, gguf_dir / "tok.gguf")
    ours, ref = Tokenizer.from_path(path), Tokenizer.from_dir(d)
    for text in ["Hello world 12345 it's", "x\n\n  y\t", "Ünïcödé 🔥 <|eot_id|>"]:
        # The directory's post-processor adds <|begin_of_text|>; the file's metadata says no BOS.
        assert ours.encode(text) == ref.encode(text, add_special_tokens=False)
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text
    messages = [{"role": "user", "content": "Hi"}]
    assert ours.apply_chat_template(messages) == ref.apply_chat_template(messages)


def test_sentencepiece_vocabulary_matches_transformers(gguf_dir):
    """llama.cpp's `llama` tokenizer (Llama 2, Mistral): scores instead of merges, byte fallback."""
    from transformers import AutoTokenizer

    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    words = ["▁", "e", "t", "a", "h", "l", "o", "w", "r", "d", "▁t", "he", "▁the", "ll", "llo", "▁he", "▁hello",
             "▁w", "or", "ld", "▁wor", "▁world", "▁a", "at", "▁at", "er", "▁h"]
    tokens = pieces + words
    types = [2, 3, 3] + [6] * 256 + [1] * len(words)
    scores = [0.0] * len(pieces) + [-float(i) for i in range(len(words))]
    path = gguf_dir / "spm.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores(scores)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours = Tokenizer.from_path(path)
    hf = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in ["hello world", "the heather at", "  two  spaces", "ünï 🔥 x", "hello</s>"]:
        assert ours.encode(text) == hf(text).input_ids, text
        assert ours.decode(ours.encode(text)) == hf.decode(hf(text).input_ids, skip_special_tokens=True)


# ---------------------------------------------------------------------------- errors


def test_unsupported_architecture_is_named(model_dirs, gguf_dir):
    path = write_gguf(model_dirs["LlamaForCausalLM"], gguf_dir / "gemma.gguf", arch_override="gemma2")
    with pytest.raises(GGUFError, match="unsupported GGUF architecture 'gemma2'.*llama, qwen2, qwen3"):
        ModelConfig.from_path(path)


def test_unsupported_quant_type_is_named(model_dirs, gguf_dir):
    # IQ4_NL: 18 bytes per 32 weights; the bytes need not mean anything, loading stops at the type.
    path = write_gguf(model_dirs["Qwen2ForCausalLM"], gguf_dir / "iq4.gguf",
                      skip=("model.layers.0.mlp.down_proj.weight",),
                      raw_tensors={"blk.0.ffn_down.weight": (np.zeros((64, 128 // 32 * 18), np.uint8), "IQ4_NL")})
    with pytest.raises(WeightLoadError, match="blk.0.ffn_down.weight.*IQ4_NL.*not supported.*Q4_K"):
        load_model(path)


def test_missing_tensor_is_named(model_dirs, gguf_dir):
    path = write_gguf(model_dirs["Qwen3ForCausalLM"], gguf_dir / "missing.gguf",
                      skip=("model.layers.1.self_attn.k_norm.weight",))
    with pytest.raises(WeightLoadError, match="missing tensor for 'model.layers.1.self_attn.k_norm.weight'"):
        load_model(path)


def test_not_a_gguf_and_truncated_files(tmp_path, model_dirs, gguf_dir):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model at all")
    with pytest.raises(Exception, match="config.json|not a directory"):
        ModelConfig.from_path(junk)  # no magic: treated as a (missing) directory, and says so
    path = write_gguf(model_dirs["Qwen2ForCausalLM"], gguf_dir / "whole.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size - 4096])
    with pytest.raises((GGUFError, WeightLoadError), match="cut.gguf"):
        load_model(cut)
    with pytest.raises(TokenizerError):
        Tokenizer.from_path(_without_tokenizer(model_dirs["Qwen2ForCausalLM"], gguf_dir))


def _without_tokenizer(model_dir, gguf_dir):
    path = gguf_dir / "notok.gguf"
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
