"""A large model's load shows its progress (issue 41): plain lines into a log, no control characters.
The tiny model stands in, with the size threshold lowered."""

from __future__ import annotations

from services.worker.engine import loader


def test_loading_weights_reports_gigabytes_and_rate(model_dirs, monkeypatch, capsys):
    monkeypatch.setattr(loader, "PROGRESS_MIN_BYTES", 0)
    loader.load_model(model_dirs["LlamaForCausalLM"], "cpu")
    err = capsys.readouterr().err
    line = next(line for line in err.splitlines() if line.startswith("loading weights:"))
    assert "GB" in line and "GB/s" in line and line.endswith("— done")
    assert "\x1b" not in err and "\r" not in err
