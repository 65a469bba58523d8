"""The random-weight model writer: determinism, Hugging Face compatibility, sharding, presets."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from inferno.tools import make_model as mm
from inferno.tools import synthetic_tokenizer
from services.worker.engine.model_config import ModelConfig

ARCHS = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
REPO = Path(__file__).resolve().parents[2]


def _hashes(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in mm.iter_model_files(d)}


def _read_all_tensors(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                out[k] = sf.get_tensor(k)
    return out


# ------------------------------------------------------------------ tokenizer training


def test_tokenizer_training_is_deterministic(monkeypatch):
    first = mm.build_tokenizer_json()
    monkeypatch.setattr(synthetic_tokenizer, "_TOKENIZER_CACHE", {})
    second = mm.build_tokenizer_json()
    assert second.tokenizer_json == first.tokenizer_json
    assert 300 <= first.size <= 1100
    assert list(first.special_ids) == list(mm.SPECIAL_TOKENS)
    # Special tokens come right after the BPE vocabulary, in Llama-3.1's order.
    ids = [first.special_ids[t] for t in mm.SPECIAL_TOKENS]
    assert ids == list(range(first.size - len(ids), first.size))


def test_tokenizer_training_is_deterministic_across_processes():
    code = ("import hashlib; from inferno.tools import make_model as mm; "
            "print(hashlib.sha256(mm.build_tokenizer_json().tokenizer_json.encode()).hexdigest())")
    digests = set()
    for hash_seed in ("0", "12345"):
        res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                             env={"PYTHONPATH": str(REPO), "PYTHONHASHSEED": hash_seed, "PATH": "/usr/bin:/bin"})
        digests.add(res.stdout.strip())
    digests.add(hashlib.sha256(mm.build_tokenizer_json().tokenizer_json.encode()).hexdigest())
    assert len(digests) == 1


def test_tokenizer_round_trips_any_utf8():
    import random

    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(mm.build_tokenizer_json().tokenizer_json)
    texts = [
        "Hello, world! 12345 3.14159",
        "def f(x):\n    return x ** 2\n\n\n",
        "  leading and trailing spaces  ",
        "émoji 😀👍🏽 CJK 日本語 中文 한국어 Ελληνικά עברית",
        "\t\r\n\x00\x7f\u200b\ufeff",
        "<|eot_id|> looks special",
    ]
    rng = random.Random(0)
    for _ in range(50):
        texts.append("".join(chr(rng.choice([rng.randint(32, 126), rng.randint(0xA0, 0x2FFF),
                                             rng.randint(0x4E00, 0x9FFF), rng.randint(0x1F300, 0x1FAFF)]))
                             for _ in range(rng.randint(0, 40))))
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids, skip_special_tokens=False) == text


# ------------------------------------------------------------------ files


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return mm.write_model(tmp_path_factory.mktemp("tiny") / "model", preset="tiny", seed=0)


def test_layout_and_metadata(tiny_dir):
    names = {p.name for p in tiny_dir.iterdir()}
    assert names == {"config.json", "generation_config.json", "model.safetensors", "special_tokens_map.json",
                     "tokenizer.json", "tokenizer_config.json"}
    tf = mm.build_tokenizer_json()
    cfg = json.loads((tiny_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert cfg["vocab_size"] % 64 == 0 and cfg["vocab_size"] >= tf.size
    assert cfg["vocab_size"] - tf.size < 64
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["head_dim"], cfg["intermediate_size"],
            cfg["max_position_embeddings"]) == (64, 2, 4, 2, 16, 128, 2048)
    assert cfg["torch_dtype"] == "bfloat16" and cfg["tie_word_embeddings"] is False
    bos, eot = tf.special_ids["<|begin_of_text|>"], tf.special_ids["<|eot_id|>"]
    assert cfg["bos_token_id"] == bos
    gen = json.loads((tiny_dir / "generation_config.json").read_text())
    assert gen["bos_token_id"] == bos
    assert isinstance(gen["eos_token_id"], list) and eot in gen["eos_token_id"]
    assert tf.special_ids["<|end_of_text|>"] in gen["eos_token_id"]
    assert {"do_sample", "temperature", "top_p"} <= gen.keys()
    tcfg = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    assert tcfg["bos_token"] == "<|begin_of_text|>" and tcfg["eos_token"] == "<|eot_id|>"
    assert tcfg["model_max_length"] == 2048 and "add_generation_prompt" in tcfg["chat_template"]
    assert json.loads((tiny_dir / "special_tokens_map.json").read_text()) == {
        "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    # The engine's own config reader accepts it.
    mc = ModelConfig.from_dir(tiny_dir)
    assert (mc.vocab_size, mc.head_dim, mc.num_key_value_heads) == (cfg["vocab_size"], 16, 2)


def test_same_seed_gives_byte_identical_files(tiny_dir, tmp_path):
    again = mm.write_model(tmp_path / "again", preset="tiny", seed=0)
    assert _hashes(again) == _hashes(tiny_dir)
    other = mm.write_model(tmp_path / "other", preset="tiny", seed=1)
    h0, h1 = _hashes(tiny_dir), _hashes(other)
    assert h0["model.safetensors"] != h1["model.safetensors"]
    assert all(h0[n] == h1[n] for n in h0 if n != "model.safetensors")  # same tokenizer and config


def test_weight_statistics(tiny_dir):
    tensors = _read_all_tensors(tiny_dir)
    emb = tensors["model.embed_tokens.weight"].float()
    assert emb.dtype == torch.float32 and tensors["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert abs(emb.std().item() - 0.02) < 0.002 and abs(emb.mean().item()) < 0.002
    norm = tensors["model.norm.weight"].float()
    assert abs(norm.mean().item() - 1.0) < 0.05 and 0.02 < norm.std().item() < 0.3
    # Every tensor is different (the seed mixes in the name).
    digests = {hashlib.sha256(t.float().numpy().tobytes()).hexdigest() for t in tensors.values()}
    assert len(digests) == len(tensors)


def test_chunked_generation_is_deterministic(monkeypatch):
    spec = mm.TensorSpec("model.layers.0.mlp.up_proj.weight", (100, 37), "weight")
    monkeypatch.setattr(mm, "_CHUNK_ELEMENTS", 1000)  # several chunks per tensor
    a = mm.generate_tensor(spec, seed=3, dtype="float32")
    b = mm.generate_tensor(spec, seed=3, dtype="float32")
    assert torch.equal(a, b) and a.shape == (100, 37)
    assert not torch.equal(a, mm.generate_tensor(spec, seed=4, dtype="float32"))


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_other_dtypes(tmp_path, dtype):
    d = mm.write_model(tmp_path / dtype, preset="tiny", dtype=dtype)
    assert json.loads((d / "config.json").read_text())["torch_dtype"] == dtype
    t = _read_all_tensors(d)["lm_head.weight"]
    assert t.dtype == getattr(torch, dtype)


def test_sharding(tmp_path, tiny_dir):
    limit = 100_000
    d = mm.write_model(tmp_path / "sharded", preset="tiny", seed=0, max_shard_bytes=limit)
    shards = sorted(d.glob("model-*.safetensors"))
    n = len(shards)
    assert n > 1 and not (d / "model.safetensors").exists()
    assert [s.name for s in shards] == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    index = json.loads((d / "model.safetensors.index.json").read_text())
    tensors = _read_all_tensors(d)
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    for shard in shards:
        with safe_open(str(shard), framework="pt") as sf:
            keys = list(sf.keys())
            size = sum(sf.get_tensor(k).numel() * 2 for k in keys)
            assert all(index["weight_map"][k] == shard.name for k in keys)
            assert size <= limit or len(keys) == 1
    # Same values as the single-file model: sharding does not change the numbers.
    single = _read_all_tensors(tiny_dir)
    assert set(single) == set(tensors) and all(torch.equal(single[k], tensors[k]) for k in single)
    # Rewriting as a single file removes the old shards and index.
    mm.write_model(d, preset="tiny", seed=0)
    assert {p.name for p in d.glob("model*")} == {"model.safetensors"}


def test_plan_shards_matches_huggingface_rules():
    specs = [mm.TensorSpec(f"t{i}", (n,), "weight") for i, n in enumerate([10, 10, 30, 5, 5, 5])]
    plan = mm.plan_shards(specs, 1, 20)
    assert [[s.name for s in shard] for shard in plan] == [["t0", "t1"], ["t2"], ["t3", "t4", "t5"]]


def test_safetensors_header_is_aligned(tiny_dir):
    raw = (tiny_dir / "model.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    assert n % 8 == 0
    header = json.loads(raw[8:8 + n])
    assert header["__metadata__"] == {"format": "pt"}
    end = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
    assert len(raw) == 8 + n + end


# ------------------------------------------------------------------ transformers compatibility


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_loads_with_no_missing_or_unexpected_keys(tmp_path, arch, tied):
    transformers = pytest.importorskip("transformers")
    d = mm.write_model(tmp_path / "m", arch=arch, preset="tiny", seed=7, tie_word_embeddings=tied,
                       max_shard_bytes=150_000 if tied else None)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(d), output_loading_info=True)
    assert type(model).__name__ == arch
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert not info.get("error_msgs")
    assert model.dtype == torch.bfloat16
    assert model.config.tie_word_embeddings is tied
    # The loaded parameters are exactly the file's tensors (nothing was re-initialised).
    tensors = _read_all_tensors(d)
    state = model.state_dict()
    for name, t in tensors.items():
        assert torch.equal(state[name], t), name
    if tied:
        assert "lm_head.weight" not in tensors
        assert torch.equal(model.lm_head.weight, tensors["model.embed_tokens.weight"])
    else:
        assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    names = set(tensors)
    if arch == "Qwen2ForCausalLM":
        assert {"model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.k_proj.bias",
                "model.layers.0.self_attn.v_proj.bias"} <= names
    else:
        assert not any(n.endswith(".bias") for n in names)
    if arch == "Qwen3ForCausalLM":
        assert {"model.layers.1.self_attn.q_norm.weight", "model.layers.1.self_attn.k_norm.weight"} <= names
        assert tensors["model.layers.1.self_attn.q_norm.weight"].shape == (16,)
    # A forward pass runs and gives finite logits over the padded vocabulary.
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3, 4]])).logits
    assert logits.shape == (1, 4, model.config.vocab_size) and torch.isfinite(logits).all()
    # The engine's config reader agrees with transformers.
    mc = ModelConfig.from_dir(d)
    assert mc.architecture == arch and mc.tie_word_embeddings is tied
    assert mc.attention_bias is (arch == "Qwen2ForCausalLM") and mc.qk_norm is (arch == "Qwen3ForCausalLM")
    assert mc.sliding_window is None
    if arch == "LlamaForCausalLM":  # the tiny Llama carries llama3 rope scaling; transformers uses it
        assert mc.rope_scaling is not None and mc.rope_scaling.original_max_position_embeddings == 256
        assert model.model.rotary_emb.rope_type == "llama3"
        inv = model.model.rotary_emb.inv_freq.float()
        ratio = (inv / (1.0 / 10000.0 ** (torch.arange(0, 16, 2).float() / 16))).tolist()
        assert ratio[:3] == pytest.approx([1.0] * 3) and 0.125 < ratio[3] < 1.0  # kept, blended,
        assert ratio[4:] == pytest.approx([0.125] * 4)  # and divided by the factor: all three bands
    else:
        assert mc.rope_scaling is None and model.model.rotary_emb.rope_type == "default"
    assert mc.head_dim == getattr(model.config, "head_dim", 16) == 16


@pytest.mark.parametrize("preset", ["llama-3.1-8b", "qwen2.5-7b", "qwen3-8b", "small"])
def test_big_preset_shapes_match_transformers(preset):
    """Build the big models on the meta device (no memory) and compare every tensor's shape."""
    transformers = pytest.importorskip("transformers")
    p = mm.PRESETS[preset]
    arch = p.architecture
    tied = p.tie_word_embeddings
    tf = mm.build_tokenizer_json()
    cfg = mm.model_config_dict(arch, p, p.vocab_size, "bfloat16", tied, tf.special_ids["<|begin_of_text|>"],
                               [tf.special_ids["<|eot_id|>"]])
    config = transformers.AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if tied:
        expected.pop("lm_head.weight", None)
    specs = mm.tensor_specs(arch, p, p.vocab_size, tied)
    assert {s.name: s.shape for s in specs} == expected
    mc = ModelConfig.from_dict(cfg)
    assert mc.vocab_size == p.vocab_size and mc.head_dim == p.head_dim


def test_llama_31_8b_preset_is_exact():
    p = mm.PRESETS["llama-3.1-8b"]
    assert (p.hidden_size, p.num_hidden_layers, p.num_attention_heads, p.num_key_value_heads,
            p.intermediate_size, p.vocab_size, p.rope_theta, p.max_position_embeddings, p.rms_norm_eps,
            p.tie_word_embeddings) == (4096, 32, 32, 8, 14336, 128256, 500000.0, 131072, 1e-5, False)
    assert p.rope_scaling == {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8192, "rope_type": "llama3"}
    specs = mm.tensor_specs("LlamaForCausalLM", p, p.vocab_size, False)
    assert sum(s.numel for s in specs) == 8_030_261_248  # Llama-3.1-8B's parameter count
    shards = mm.plan_shards(specs, 2, mm.DEFAULT_MAX_SHARD_BYTES)
    assert len(shards) == 4  # as the published checkpoint
    cfg = mm.model_config_dict("LlamaForCausalLM", p, p.vocab_size, "bfloat16", False, 1, [2, 3])
    mc = ModelConfig.from_dict(cfg)
    assert mc.rope_scaling is not None and mc.rope_scaling.factor == 8.0
    assert mc.rope_scaling.original_max_position_embeddings == 8192 and mc.max_model_len == 131072
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(**cfg)
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    assert rope["rope_type"] == "llama3" and rope["factor"] == 8.0


def test_transformers_generation_matches_a_manual_greedy_loop(tiny_dir):
    """A smoke test that the model is usable end to end in transformers."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(str(tiny_dir))
    ids = tok("Hello, world", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    seq = ids
    with torch.no_grad():
        for _ in range(5):
            nxt = model(seq).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
            if nxt.item() in model.generation_config.eos_token_id:
                break
    assert out[0, : seq.shape[1]].tolist() == seq[0].tolist()


# ------------------------------------------------------------------ errors and CLI


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="preset"):
        mm.write_model(tmp_path, preset="huge")
    with pytest.raises(ValueError, match="architecture"):
        mm.write_model(tmp_path, arch="GPT2LMHeadModel")
    with pytest.raises(ValueError, match="dtype"):
        mm.write_model(tmp_path, dtype="int8")
    with pytest.raises(ValueError, match="max_shard_bytes"):
        mm.write_model(tmp_path, max_shard_bytes=0)
    with pytest.raises(ValueError, match="device"):
        mm.write_model(tmp_path, device="tpu")


def test_cli(tmp_path, capsys):
    out = tmp_path / "cli"
    rc = mm.main([str(out), "--arch", "Qwen3ForCausalLM", "--preset", "tiny", "--seed", "5", "--dtype", "float16",
                  "--tied", "--max-shard-bytes", "100KB", "--quiet"])
    assert rc == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["tie_word_embeddings"] is True
    assert cfg["torch_dtype"] == "float16"
    assert (out / "model.safetensors.index.json").exists()
    ref = mm.write_model(tmp_path / "ref", arch="Qwen3ForCausalLM", preset="tiny", seed=5, dtype="float16",
                         tie_word_embeddings=True, max_shard_bytes=100_000)
    assert _hashes(out) == _hashes(ref)
    assert mm.main([str(tmp_path / "x"), "--preset", "tiny", "--untied", "--quiet"]) == 0
    assert json.loads((tmp_path / "x" / "config.json").read_text())["tie_word_embeddings"] is False
    with pytest.raises(SystemExit):
        mm.main([str(tmp_path / "y"), "--max-shard-bytes", "lots"])
    assert mm.main([str(tmp_path / "z"), "--device", "tpu", "--quiet"]) == 2
    assert "device" in capsys.readouterr().err


def test_cli_shows_the_weights_written_and_writes_the_same_files(tmp_path, capsys):
    argv = ["--preset", "tiny", "--seed", "5", "--max-shard-bytes", "100KB"]
    assert mm.main([str(tmp_path / "quiet"), *argv, "--quiet"]) == 0
    assert capsys.readouterr() == ("", "")
    assert mm.main([str(tmp_path / "shown"), *argv]) == 0
    out, err = capsys.readouterr()
    assert out == f"{tmp_path / 'shown'}\n"
    # No terminal: a plain line every few seconds, here only the last one, naming the last shard.
    n = len(list((tmp_path / "shown").glob("model-*.safetensors")))
    assert re.fullmatch(rf"writing weights: ([0-9.]+)/\1 MB \(100 %\), model-{n:05d}-of-{n:05d}\.safetensors, "
                        r"[0-9.,]+ MB/s, [0-9.]+ s — done\n", err), err
    assert _hashes(tmp_path / "shown") == _hashes(tmp_path / "quiet")


def test_large_presets_tokenizer_covers_every_model_id():
    """Random weights sample any id: each must decode to visible text, specials at the end."""
    from tokenizers import Tokenizer as RustTokenizer

    tf = mm.build_tokenizer_json(128256)
    tok = RustTokenizer.from_str(tf.tokenizer_json)
    assert tf.size == tok.get_vocab_size(with_added_tokens=True) == 128256
    assert tf.special_ids["<|begin_of_text|>"] == 128245 and tf.special_ids["<|python_tag|>"] == 128255
    assert tok.decode([1000, 50000, 128244]) == "<1000><50000><128244>"
    assert 50000 not in tok.encode("a <50000> b").ids  # encoding never yields a filler
