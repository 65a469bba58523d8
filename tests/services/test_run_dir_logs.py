"""`--run-dir` holds each child's log in both formats; in the console format the launcher also
echoes them to its terminal, as the children's own output used to go there."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from services import launcher
from services.launcher import Stack, StackConfig


@pytest.fixture
def no_nats():
    """A port that refuses connections for the whole test: bound, never listening (a free port could
    be taken meanwhile by a server of another test run)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


def start_scheduler(tmp_path, log_format: str, nats_port: int) -> Stack:
    """A scheduler whose NATS never answers: it logs its attempts until it is stopped."""
    cfg = StackConfig(model_dir=tmp_path, run_dir=tmp_path / "run", nats_port=nats_port, log_format=log_format)
    stack = Stack(cfg)
    stack.start_scheduler()
    return stack


def wait_for_line(path, line: str, times: int = 1, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while (path.read_text() if path.exists() else "").count(line) < times:
        assert time.monotonic() < deadline, f"{path} holds no {line!r} after {timeout} s"
        time.sleep(0.1)


def stopped_log(stack: Stack, name: str, first_line: str) -> str:
    """The child's log once it holds `first_line`, after the child has been stopped (SIGTERM)."""
    path = stack.cfg.run_dir / f"{name}.log"
    try:
        wait_for_line(path, first_line)
    finally:
        stack.stop()
    return path.read_text()


@pytest.mark.parametrize("log_format", ["console", "json"])
def test_a_services_log_lines_go_to_its_file_in_the_run_dir(tmp_path, log_format, no_nats, capfd):
    stack = start_scheduler(tmp_path, log_format, no_nats)
    text = stopped_log(stack, "scheduler-0", "nats_unreachable")
    lines = text.splitlines()
    assert any("nats_unreachable" in line for line in lines)
    assert any("stopped_before_connecting" in line for line in lines)  # written as it stopped, on SIGTERM
    if log_format == "json":
        assert all(json.loads(line)["service"] for line in lines)
        assert "nats_unreachable" not in capfd.readouterr().err  # the file alone
    else:
        assert not text.lstrip().startswith("{") and "\x1b[" not in text  # readable, no colour codes
        assert "stopped_before_connecting" in capfd.readouterr().err  # and on the launcher's terminal


def test_a_restarted_childs_log_continues_in_the_same_file(tmp_path, no_nats):
    stack = start_scheduler(tmp_path, "console", no_nats)
    child = stack.child("scheduler-0")
    try:
        path = stack.cfg.run_dir / "scheduler-0.log"
        wait_for_line(path, "nats_unreachable")
        child.proc.send_signal(signal.SIGTERM)
        # poll(), not wait(timeout): wait's loop asserted on a waitpid answer once under load (CI-like
        # 2-core run, 2026-11-29), while the launcher's thread polls the same child.
        deadline = time.monotonic() + 30
        while child.proc.poll() is None:
            assert time.monotonic() < deadline, "the child did not stop on SIGTERM"
            time.sleep(0.05)
        first_run = path.read_text()
        stack.restart(child)
        wait_for_line(path, "nats_unreachable", times=2)
    finally:
        stack.stop()
    text = path.read_text()
    assert text.startswith(first_run) and text.count("stopped_before_connecting") == 2
    assert child.log_tail().startswith(text[len(first_run):].splitlines()[0])  # the tail is this run's own


def test_the_default_run_dir_is_not_part_of_the_checkout():
    """Every `inferno up` in a checkout writes it: git ignores it, so the tree stays clean."""
    root = Path(__file__).resolve().parents[2]
    run_dir = launcher.parse_args([]).run_dir
    if shutil.which("git") is None or not (root / ".git").exists():
        pytest.skip("not a git checkout")
    ignored = subprocess.run(["git", "check-ignore", "-q", str(run_dir / "pids.json")], cwd=root)
    tracked = subprocess.run(["git", "ls-files", str(run_dir)], cwd=root, capture_output=True, text=True)
    assert ignored.returncode == 0 and tracked.stdout == ""
