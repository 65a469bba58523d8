"""EAGLE-3 heads (eagle3.py) written by make_model.write_eagle3: loading, and drafts that match a plain-torch
reference of the published layout's math, prefill and decode through the paged KV cache."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from inferno.tools.make_model import main as make_model_main, write_eagle3
from services.worker.engine.attention_metadata import AttentionMetadata
from services.worker.engine.eagle3 import Eagle3Config, load_eagle3
from services.worker.engine.kv_cache import KVCache
from services.worker.engine.ops import TorchOps
from services.worker.kernels.rope import rope_cos_sin_cache
from tests.models.conftest import make_engine

BLOCK = 4
TABLE = [2, 0, 3]  # out of order: a paging mistake shows


@pytest.fixture(scope="module")
def target(model_dirs):
    return make_engine(model_dirs["LlamaForCausalLM"]).model


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory):
    return write_eagle3(tmp_path_factory.mktemp("eagle3"), target_preset="tiny", seed=3, dtype="float32")


@pytest.fixture(scope="module")
def head(head_dir, target):
    return load_eagle3(head_dir, target, "cpu", torch.float32, TorchOps())


def reference(w: dict, cfg: dict, embed: torch.Tensor, ids, hidden, positions):
    """The head over tokens 0..n-1 of one sequence, all at once: (normed, prenorm, logits)."""
    eps, nh, nkv, hd = cfg["rms_norm_eps"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    n = len(ids)

    def rms(x, name):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w[name]

    def rope(x):  # x: [n, heads, hd], rotate_half style
        scaling = SimpleNamespace(**cfg["rope_scaling"])  # the tiny Llama's llama3 scaling
        cs = rope_cos_sin_cache(hd, 64, cfg["rope_theta"], scaling)[positions]
        cos, sin = torch.cat([cs[:, :hd // 2]] * 2, -1)[:, None], torch.cat([cs[:, hd // 2:]] * 2, -1)[:, None]
        x1, x2 = x[..., :hd // 2], x[..., hd // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    a = "midlayer.self_attn."
    x = torch.cat([rms(embed[ids], "midlayer.input_layernorm.weight"), rms(hidden, "midlayer.hidden_norm.weight")], -1)
    q = rope((x @ w[a + "q_proj.weight"].T).view(n, nh, hd))
    k = rope((x @ w[a + "k_proj.weight"].T).view(n, nkv, hd)).repeat_interleave(nh // nkv, dim=1)
    v = (x @ w[a + "v_proj.weight"].T).view(n, nkv, hd).repeat_interleave(nh // nkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * hd ** -0.5
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, nh * hd) @ w[a + "o_proj.weight"].T
    s = attn + hidden
    m = "midlayer.mlp."
    t = rms(s, "midlayer.post_attention_layernorm.weight")
    gated = F.silu(t @ w[m + "gate_proj.weight"].T) * (t @ w[m + "up_proj.weight"].T)
    prenorm = gated @ w[m + "down_proj.weight"].T + s
    normed = rms(prenorm, "norm.weight")
    return normed, prenorm, normed @ w["lm_head.weight"].T


def meta_for(start: int, n: int) -> AttentionMetadata:
    """One sequence whose tokens start..start+n-1 are new (their KV written this step), in blocks TABLE."""
    pos = torch.arange(start, start + n)
    slots = torch.tensor(TABLE)[pos // BLOCK] * BLOCK + pos % BLOCK
    return AttentionMetadata(slot_mapping=slots, block_tables=torch.tensor([TABLE], dtype=torch.int32),
                             seq_lens=torch.tensor([start + n], dtype=torch.int32),
                             query_start_loc=torch.tensor([0, n], dtype=torch.int32),
                             max_query_len=n, max_seq_len=start + n)


def test_drafts_match_a_plain_torch_reference_in_prefill_and_decode(head, head_dir, target):
    cfg = json.loads((head_dir / "config.json").read_text())
    w = load_file(head_dir / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg["vocab_size"], (8,), generator=g)
    aux = torch.randn(8, 3 * cfg["target_hidden_size"], generator=g)
    kv = KVCache(head.config.kv_config(), num_blocks=4, block_size=BLOCK, dtype=torch.float32, device="cpu")
    embed = target.embed_tokens.weight

    with torch.inference_mode():
        normed, prenorm = head(ids[:7], head.fuse(aux[:7]), torch.arange(7), kv.layers[0], meta_for(0, 7))
        logits = head.compute_logits(normed)
        hidden = aux[:7] @ w["fc.weight"].T
        ref_normed, ref_prenorm, ref_logits = reference(w, cfg, embed, ids[:7], hidden, torch.arange(7))
        torch.testing.assert_close(prenorm, ref_prenorm, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(normed, ref_normed, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
        assert logits.shape == (7, cfg["draft_vocab_size"])

        # The next draft step: the last prenorm output as its hidden input, attention over the cached 7.
        normed, prenorm = head(ids[7:], prenorm[-1:], torch.tensor([7]), kv.layers[0], meta_for(7, 1))
        ref = reference(w, cfg, embed, ids, torch.cat([hidden, ref_prenorm[-1:]]), torch.arange(8))
        torch.testing.assert_close(prenorm, ref[1][-1:], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(head.compute_logits(normed), ref[2][-1:], atol=1e-4, rtol=1e-4)


def test_head_layout_and_the_draft_to_target_map(head, head_dir, target):
    w = load_file(head_dir / "model.safetensors")
    assert head.embed_tokens is target.embed_tokens  # no table of its own: the target's
    draft = torch.arange(64)
    targets = head.to_target(draft)
    torch.testing.assert_close(targets, draft + w["d2t"])
    assert targets.tolist() == sorted(set(targets.tolist())) and w["t2d"][targets].all() and w["t2d"].sum() == 64
    assert head.config.aux_layer_ids(32) == (2, 16, 29)  # Llama 3.1 8B's, as vLLM takes them
    assert head.config.aux_layer_ids(2) == (0, 1, 1)  # a test model's: in range, one layer twice


def test_aux_layers_from_the_config(head_dir, tmp_path):
    cfg = json.loads((head_dir / "config.json").read_text())
    for ids, ok in (([1, 5, 9], True), ([9, 5, 1], False), ([1, 5, 12], False)):
        eagle = {"eagle_aux_hidden_state_layer_ids": ids}
        (tmp_path / "config.json").write_text(json.dumps({**cfg, "eagle_config": eagle}))
        if ok:
            assert Eagle3Config.from_dir(tmp_path).aux_layer_ids(12) == tuple(ids)
        else:
            with pytest.raises(ValueError, match="ascending"):
                Eagle3Config.from_dir(tmp_path).aux_layer_ids(12)


def test_a_pytorch_model_bin_loads_the_same(head, head_dir, target, tmp_path):
    (tmp_path / "config.json").write_text((head_dir / "config.json").read_text())
    torch.save(load_file(head_dir / "model.safetensors"), tmp_path / "pytorch_model.bin")
    other = load_eagle3(tmp_path, target, "cpu", torch.float32, TorchOps())
    for (name, a), (_, b) in zip(head.state_dict().items(), other.state_dict().items()):
        assert torch.equal(a, b), name


def test_bad_heads_are_refused_with_the_reason(head_dir, target, tmp_path):
    (tmp_path / "config.json").write_text((head_dir / "config.json").read_text())
    tensors = load_file(head_dir / "model.safetensors")
    del tensors["midlayer.mlp.up_proj.weight"]
    torch.save(tensors, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="midlayer.mlp.up_proj.weight"):
        load_eagle3(tmp_path, target, "cpu", torch.float32, TorchOps())

    tensors = load_file(head_dir / "model.safetensors")
    tensors["d2t"][-1] += 10_000
    torch.save(tensors, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="d2t"):
        load_eagle3(tmp_path, target, "cpu", torch.float32, TorchOps())

    cfg = json.loads((head_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "vocab_size": cfg["vocab_size"] + 64}))
    with pytest.raises(ValueError, match="vocab_size"):
        load_eagle3(tmp_path, target, "cpu", torch.float32, TorchOps())

    (tmp_path / "config.json").write_text(json.dumps({**cfg, "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="not an EAGLE-3 head"):
        Eagle3Config.from_dir(tmp_path)


def test_make_model_writes_the_same_head_byte_for_byte(head_dir, tmp_path):
    assert make_model_main([str(tmp_path), "--preset", "eagle3-tiny", "--dtype", "float32", "--seed", "3",
                            "--quiet"]) == 0
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / name).read_bytes() == (head_dir / name).read_bytes(), name
    assert make_model_main([str(tmp_path), "--preset", "eagle3-tiny", "--config-only", "--quiet"]) == 2
