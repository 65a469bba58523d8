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


def test_the_helpers_compile_the_workers_own_cache_entries_and_mark_each(tmp_path):
    """The question the replay stands on: a variant the helpers compile from the manifest is the
    entry the worker's own launch looks for. The worker's JIT path runs for sm_90 without a GPU
    (tests/unit/jit_without_gpu.py): recorded into a manifest, compiled by two helper processes into an
    empty cache (a marker each; a variant they cannot rebuild is left to the worker), then the worker's
    path again finds every variant there and writes nothing."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}

    def worker_path(cache: str) -> dict:
        done = subprocess.run([sys.executable, "-m", "tests.unit.jit_without_gpu"], env={**env, "TRITON_CACHE_DIR": cache},
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    first = worker_path(str(tmp_path / "a"))
    assert first["before"] == 0 and first["after"] > 0 and len(first["recorded"]) == 2
    manifest, done_dir = tmp_path / "kernels.json", tmp_path / "done"
    done_dir.mkdir()
    lost = silu_entry(64, False, module="no.such.module")
    km.write(manifest, [*first["recorded"], lost], TARGET)
    helpers = subprocess.run([sys.executable, "-m", "services.worker.kernel_manifest", str(manifest), "--jobs", "2",
                              "--done-dir", str(done_dir)], env={**env, "TRITON_CACHE_DIR": str(tmp_path / "b")},
                             capture_output=True, text=True, timeout=300)
    result = json.loads(helpers.stdout.strip().splitlines()[-1])
    assert (result["compiled"], result["failed_count"], result["jobs"]) == (2, 1, 2), helpers.stderr[-2000:]
    assert "no.such.module" in result["failed"][0]
    marked = [*first["recorded"], lost]
    assert sorted(p.name for p in done_dir.iterdir()) == sorted(km.digest(e["data"]) for e in marked)
    again = worker_path(str(tmp_path / "b"))
    assert again["recorded"] == first["recorded"]  # the same variants, named the same: what note() waits for
    assert again["before"] == again["after"] > 0  # every one found in the cache: nothing compiled


def test_a_compile_waits_for_the_helpers_copy_of_its_variant(tmp_path):
    """note() holds a compile of a variant the helpers hold until its marker is there, not one they
    do not hold, and not once they have ended."""
    marker = tmp_path / km.digest("held")
    helper = subprocess.Popen([sys.executable, "-c", "import pathlib, sys, time; time.sleep(0.4); "
                               "pathlib.Path(sys.argv[1]).touch(); time.sleep(30)", str(marker)])
    try:
        replay = km.Replay(helper, tmp_path, {"held"})
        assert replay.wait_for("other") == 0.0
        assert 0.3 < replay.wait_for("held") < 5 and marker.exists()
    finally:
        helper.kill()
        helper.wait()
    assert replay.wait_for(json.dumps("never marked")) == 0.0  # not held
    km.Replay(helper, tmp_path, {"gone"}).wait_for("gone")  # the helpers ended: no wait (would hang otherwise)


def test_the_default_manifest_lies_beside_the_model(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    assert km.manifest_path("auto", str(model), "cuda:0") == str(model / ".inferno-kernels.json")
    assert km.manifest_path("", str(gguf), "cuda") == f"{gguf}.inferno-kernels.json"
    assert km.manifest_path("auto", str(model), "cpu") == ""  # the CPU path compiles no Triton kernel
    assert km.manifest_path("auto", "", "cuda") == ""  # no model at start: nothing to record yet
    assert km.manifest_path("off", str(model), "cuda") == ""
    assert km.manifest_path("/v/k.json", str(model), "cpu") == "/v/k.json"  # a path is taken as given


def test_a_cache_that_holds_the_whole_manifest_starts_no_helpers(tmp_path, monkeypatch):
    """A worker that compiled or loaded every variant of the manifest marks its cache; the next start
    with that cache leaves the helpers out, while a manifest with more in it replays again."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(km, "current_target", lambda: TARGET)
    a, b = silu_entry(1024, True), silu_entry(512, False)
    path = tmp_path / "kernels.json"
    monkeypatch.setattr(km, "_recorded", {a["data"]: a})
    assert km.save(str(path)) == 1 and km.cache_marker(km.read(path)).exists()
    assert km.start_precompile(path) is None  # nothing to compile: no helper process
    km.write(path, [b], TARGET)  # another replica recorded one more
    assert not km.cache_marker(km.read(path)).exists()
    monkeypatch.setattr(km, "_recorded", {a["data"]: a})
    km.save(str(path))  # this process lacks b: its cache is not marked as holding the manifest
    assert not km.cache_marker(km.read(path)).exists()
