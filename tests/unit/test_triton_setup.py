"""The early first Triton launch (services/worker/kernels/triton_setup.py): one thread a process,
waited for without error, and nothing to wait for when none was started."""

import structlog
import torch

from services.worker.kernels import triton_setup


def test_wait_without_start_returns(monkeypatch):
    monkeypatch.setattr(triton_setup, "_thread", None)
    triton_setup.wait()


def test_start_launches_once_and_wait_joins(monkeypatch):
    monkeypatch.setattr(triton_setup, "_thread", None)
    launched = []
    real = triton_setup._first_launch
    monkeypatch.setattr(triton_setup, "_first_launch", lambda device: (launched.append(device), real(device)))
    with structlog.testing.capture_logs() as logs:
        triton_setup.start(torch.device("cpu"))
        triton_setup.start(torch.device("cpu"))  # a second call starts nothing
        triton_setup.wait()
    assert launched == [torch.device("cpu")]
    assert logs == []  # the kernel ran (interpreted here)
    assert not triton_setup._thread.is_alive()


def test_a_failed_launch_is_only_logged(monkeypatch):
    monkeypatch.setattr(triton_setup, "_thread", None)
    with structlog.testing.capture_logs() as logs:
        triton_setup.start("not-a-device")  # the thread's error is caught: the first real launch pays instead
        triton_setup.wait()
    assert [e["event"] for e in logs] == ["triton setup launch failed"]
