"""Loading errors name what is wrong: a missing tensor, a wrong shape, an unknown architecture."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.worker.engine.loader import WeightLoadError, load_model
from inferno.tools.make_model import write_model
from services.worker.engine.model_config import ModelConfigError


@pytest.fixture()
def model_dir(tmp_path):
    return write_model(tmp_path / "m", arch="LlamaForCausalLM", preset="tiny", seed=0, dtype="float32")


def rewrite(model_dir, edit):
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def test_missing_tensor_is_named(model_dir):
    rewrite(model_dir, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(WeightLoadError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        load_model(model_dir)


def test_wrong_shape_is_named(model_dir):
    def edit(t):
        t["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, 5)
    rewrite(model_dir, edit)
    with pytest.raises(WeightLoadError, match=r"'model\.layers\.0\.self_attn\.k_proj\.weight' has shape \[3, 5\]"):
        load_model(model_dir)


def test_unknown_architecture_is_named(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["architectures"] = ["GPTBigCodeForCausalLM"]
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError, match="unsupported architecture 'GPTBigCodeForCausalLM'"):
        load_model(model_dir)


def test_bad_config_is_named(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["num_key_value_heads"] = 3
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError, match="multiple of num_key_value_heads"):
        load_model(model_dir)


def test_sharded_checkpoint_loads_like_single(tmp_path):
    single = write_model(tmp_path / "single", preset="tiny", seed=5, dtype="float32")
    sharded = write_model(tmp_path / "sharded", preset="tiny", seed=5, dtype="float32", max_shard_bytes=40_000)
    assert (sharded / "model.safetensors.index.json").is_file()
    a = load_model(single).state_dict()
    b = load_model(sharded).state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_missing_shard_is_named(tmp_path):
    sharded = write_model(tmp_path / "sharded", preset="tiny", seed=5, dtype="float32", max_shard_bytes=40_000)
    victim = sorted(sharded.glob("model-*.safetensors"))[0]
    victim.unlink()
    with pytest.raises(ValueError, match=victim.name):
        load_model(sharded)
