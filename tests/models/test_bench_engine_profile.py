"""`inferno bench-engine --profile FILE [--profile-trace]`: the decode steps' tables, and the timeline."""

from __future__ import annotations

import gzip
import json
import os

from services.worker.engine import bench_engine
from services.worker.engine.torch_profile import FOLLOWERS_ENV, TRACE_ENV


def test_profile_tables_and_timeline(model_dirs, tmp_path, capsys, monkeypatch):
    for name in (FOLLOWERS_ENV, TRACE_ENV):  # bench-engine sets them for its other ranks: unset after the test
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    out = tmp_path / "profile.txt"
    assert bench_engine.main(["--model", str(model_dirs["LlamaForCausalLM"]), "--device", "cpu", "--batch-size", "2",
                              "--prompt-len", "8", "--decode-tokens", "3", "--json", "--profile", str(out),
                              "--profile-trace"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["decode_tokens_per_s"] > 0 and result["expert_spread"] is None  # a dense model
    assert out.read_text().startswith("steps 3,") and "by the host's own time" in out.read_text()
    with gzip.open(f"{out}.trace.json.gz") as f:
        assert json.load(f)["traceEvents"]
    assert os.environ[FOLLOWERS_ENV] == str(out) and os.environ[TRACE_ENV] == "1"  # what the other ranks read
