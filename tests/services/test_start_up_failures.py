"""A child that exits during start-up with a configuration error stops the stack at once, with its
error, instead of leaving `inferno up` to wait out its 120 s (`-tp 2` with SmolLM2's 9 heads)."""

from __future__ import annotations

import time

import pytest

from inferno.tools.make_model import write_model
from services import launcher
from services.launcher import Stack, StackConfig, free_port
from shared.config import CONFIG_ERROR_EXIT

HEADS_ERROR = "4 attention heads do not split over tensor_parallel_size 3"  # the tiny preset has 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("model") / "tiny", preset="tiny", seed=0, dtype="float32")


def stack_config(tmp_path, model_dir, **fields) -> StackConfig:
    return StackConfig(model_dir=model_dir, run_dir=tmp_path / "run", port=free_port(), nats_port=free_port(),
                       log_format="console", **fields)


def failed_start_up(stack: Stack, child) -> tuple[str, float]:
    """The error wait_ready raised once `child` had exited, and how long it took to raise it."""
    child.proc.wait(timeout=30)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        stack.wait_ready(timeout=20)
    return str(info.value), time.monotonic() - t0


def test_a_service_exiting_with_a_config_error_ends_start_up_with_its_error(tmp_path, tiny):
    stack = Stack(stack_config(tmp_path, tiny, kvstore_capacity_gb=-1.0))  # not critical: the stack could do without it
    try:
        kvstore = stack.start_kvstore()
        error, seconds = failed_start_up(stack, kvstore)
    finally:
        stack.stop()
    assert kvstore.proc.returncode == CONFIG_ERROR_EXIT
    assert seconds < 1.0
    assert "kvstore exited with code 2 (a configuration error) during start-up" in error
    assert "--capacity-gb must be positive, got -1.0" in error  # the tail of its log


def test_a_worker_whose_model_does_not_split_over_its_group_exits_at_once(tmp_path, tiny):
    stack = Stack(stack_config(tmp_path, tiny, tensor_parallel_size=3))
    try:
        t0 = time.monotonic()
        worker = stack.start_worker(0)
        error, seconds = failed_start_up(stack, worker)
        started_s = time.monotonic() - t0
    finally:
        stack.stop()
    assert worker.proc.returncode == CONFIG_ERROR_EXIT
    assert seconds < 1.0 and started_s < 15  # before NATS, the model or torch: no server runs here
    assert "worker-0 exited with code 2 (a configuration error) during start-up" in error
    assert HEADS_ERROR in error


def test_inferno_up_stops_the_stack_and_exits_non_zero(tmp_path, tiny, monkeypatch, capsys):
    monkeypatch.setattr(launcher.signal, "signal", lambda *args: None)  # pytest keeps its own handlers
    t0 = time.monotonic()
    code = launcher.main(["--model", str(tiny), "-tp", "3", "--port", str(free_port()), "--run-dir",
                          str(tmp_path / "run")])
    seconds = time.monotonic() - t0
    err = capsys.readouterr().err
    assert code == 1
    assert HEADS_ERROR in err and "not ready" not in err
    assert seconds < 30  # was the full 120 s of waiting for /ready
