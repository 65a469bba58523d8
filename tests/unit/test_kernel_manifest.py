"""Triton kernel variants recorded as a worker compiles them, and compiled ahead from that record in
parallel processes, for sm_90 on a machine without a GPU (Triton's wheel ships ptxas)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

from services.worker import kernel_manifest as km

TARGET = {"backend": "cuda", "arch": 90, "warp_size": 32}


def silu_entry(block: int, pdl: bool, module: str = "services.worker.kernels.silu_mul") -> dict:
    """One variant as Triton's jit_cache_hook serializes it (JITFunction.preload's format)."""
    data = {"name": f"{module}._silu_mul_kernel",
            "signature": {"x_ptr": "*bf16", "out_ptr": "*bf16", "inter": "i32", "x_stride": "i32",
                          "out_stride": "i32", "BLOCK": "constexpr", "PDL": "constexpr"},
            "constant_keys": [[5], [6]], "constant_vals": [block, pdl],
            "attrs_keys": [[0], [1], [3], [4]], "attrs_vals": [[["tt.divisibility", 16]]] * 4,
            "options": {"num_warps": 4, "num_stages": 3, "launch_pdl": pdl}, "key": f"silu-{block}-{pdl}"}
    return {"module": module, "name": "_silu_mul_kernel", "data": json.dumps(data)}


def test_compiles_are_recorded_once_and_merged_per_triton_and_target(tmp_path, monkeypatch):
    import triton

    monkeypatch.setattr(km, "_recorded", {})
    a, b = silu_entry(1024, True), silu_entry(512, False)
    for entry in (a, a, b):  # the hook's arguments: fn (module, name), compile (with the serialized variant)
        km.note(SimpleNamespace(module=entry["module"], name=entry["name"]), {"specialization_data": entry["data"]})
    km.note(None, None)  # a hook call without them records nothing
    assert km.recorded() == [a, b]
    path = tmp_path / "kernels.json"
    assert km.write(path, [a], TARGET) == 1 and km.write(path, [a, b], TARGET) == 2
    doc = km.read(path)
    assert doc["triton"] == triton.__version__ and doc["target"] == TARGET and doc["kernels"] == [a, b]
    assert km.write(path, [b], {**TARGET, "arch": 100}) == 1  # another GPU's variants replace them
    assert km.read(tmp_path / "none.json") is None


def test_a_compile_watch_records_what_it_sees():
    from services.worker.compile_watch import CompileWatch

    entry = silu_entry(256, False)
    CompileWatch(serving=lambda: False)._before(fn=SimpleNamespace(module=entry["module"], name=entry["name"]),
                                                compile={"specialization_data": entry["data"]})
    assert entry in km.recorded()


def test_a_manifest_compiles_over_processes_into_the_cache_and_then_hits_it(tmp_path):
    path = tmp_path / "kernels.json"
    km.write(path, [silu_entry(1024, True), silu_entry(512, False), silu_entry(64, False, module="no.such.module")],
             TARGET)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")

    def replay() -> dict:
        done = subprocess.run([sys.executable, "-m", "services.worker.kernel_manifest", str(path), "--jobs", "2"],
                              env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    first = replay()
    assert (first["compiled"], first["failed_count"], first["jobs"]) == (2, 1, 2)
    assert "no.such.module" in first["failed"][0]  # a variant it cannot rebuild is left to the worker
    files = sorted(p.relative_to(tmp_path) for p in (tmp_path / "cache").rglob("*") if p.is_file())
    assert any(str(p).endswith(".cubin") for p in files)
    assert replay()["compiled"] == 2  # the same keys: loads from the cache, nothing new written
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "cache").rglob("*") if p.is_file()) == files
