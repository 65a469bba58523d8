"""The worker's compile watch: Triton's compile hooks, a warning for each compile while serving and
nothing before. The hooks are called here as Triton's JIT calls them on a cache miss (this machine
has no GPU to launch a kernel on)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from structlog.testing import capture_logs

from services.worker.compile_watch import CompileWatch

knobs = pytest.importorskip("triton").knobs


@pytest.fixture
def hooks():
    runtime = knobs.runtime
    saved = runtime.jit_cache_hook, runtime.jit_post_compile_hook
    yield runtime
    runtime.jit_cache_hook, runtime.jit_post_compile_hook = saved


def compile_once(runtime, name: str) -> bool | None:
    """What _do_compile does around a compile: the cache hook (True would skip it), then the post hook."""
    kw = dict(key=("k",), repr=f"{name}[num_warps=4](x_ptr: *bf16, BLOCK: 1024)",
              fn=SimpleNamespace(name=name), compile={}, is_manual_warmup=False, already_compiled=False)
    skipped = runtime.jit_cache_hook(**kw)
    runtime.jit_post_compile_hook(**kw)
    return skipped


def test_compiles_warn_only_while_serving(hooks):
    serving = [False]
    watch = CompileWatch(serving=lambda: serving[0])
    assert watch.install()
    with capture_logs() as logs:
        assert compile_once(hooks, "_warm_kernel") is False  # the compile goes ahead
        serving[0] = True
        compile_once(hooks, "_gemv_kernel")
    assert watch.late == 1 and watch.late_seconds >= 0.0
    [event] = logs
    assert event["event"] == "kernel compiled while serving" and event["log_level"] == "warning"
    assert event["kernel"] == "_gemv_kernel" and "BLOCK: 1024" in event["signature"]
