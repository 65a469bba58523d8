"""`inferno warm-kernels` runs a worker's whole start-up path on random weights and exits."""

from __future__ import annotations

from inferno.tools.make_model import write_model
from services.worker import warm_kernels


def test_warm_kernels_runs_the_start_up_path_and_says_where_the_cache_is(tmp_path, monkeypatch, capsys):
    model = write_model(tmp_path / "m", preset="tiny", seed=0, dtype="float32")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    assert warm_kernels.main(["--model-dir", str(model), "--device", "cpu", "--num-blocks", "32"]) == 0
    out = capsys.readouterr().out
    assert "inferno warm-kernels: m on cpu" in out and str(tmp_path / "cache") in out
    assert warm_kernels.main(["--device", "cpu"]) == 2  # which model's shapes: required
