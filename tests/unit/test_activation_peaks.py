"""The KV sizing dry run's remembered peaks (engine/activation_peaks.py): on disk, per key, and
never trusted when unreadable."""

from __future__ import annotations

from services.worker.engine import activation_peaks


def test_a_remembered_peak_is_found_under_its_key_only(tmp_path, monkeypatch):
    monkeypatch.setenv("INFERNO_CACHE_DIR", str(tmp_path))
    assert activation_peaks.lookup("a") is None  # no file yet: a dry run
    activation_peaks.remember("a", 123 << 20)
    activation_peaks.remember("b", 7)
    assert activation_peaks.lookup("a") == 123 << 20
    assert activation_peaks.lookup("b") == 7
    assert activation_peaks.lookup("c") is None
    assert not list(tmp_path.glob("*.tmp"))  # written whole, then renamed


def test_an_unreadable_or_odd_file_means_a_dry_run(tmp_path, monkeypatch):
    monkeypatch.setenv("INFERNO_CACHE_DIR", str(tmp_path))
    path = tmp_path / activation_peaks.FILE
    path.write_text("{not json")
    assert activation_peaks.lookup("a") is None
    activation_peaks.remember("a", 5)  # a broken file is replaced, not a reason to fail
    assert activation_peaks.lookup("a") == 5
    path.write_text('{"a": -1, "b": "12", "c": 0}')
    assert [activation_peaks.lookup(k) for k in "abc"] == [None, None, None]
    path.write_text("[1, 2]")
    assert activation_peaks.lookup("a") is None


def test_the_source_digest_follows_the_engine_and_kernel_files():
    digest = activation_peaks._source_digest()
    assert len(digest) == 16 and digest == activation_peaks._source_digest()
    assert any(p.name == "kernels" for p in activation_peaks._SOURCES)
