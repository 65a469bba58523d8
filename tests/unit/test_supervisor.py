"""Supervisor: which child is restarted when, with a fake clock and fake processes."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from services.launcher import Child
from services.supervisor import Backoff, Supervisor


class FakeProc:
    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode


@dataclass
class FakeStack:
    children: list[Child]
    stopping: bool = False
    reported: set = field(default_factory=set)
    next_pid: int = 100

    def restart(self, child: Child) -> None:
        if self.stopping:
            raise RuntimeError("the stack is stopping")
        self.next_pid += 1
        child.proc = FakeProc(self.next_pid)
        child.started = clock.now


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


clock = Clock()


@pytest.fixture
def stack():
    clock.now = 0.0
    return FakeStack([Child(name, FakeProc(i), critical=True, argv=[name], started=0.0)
                      for i, name in enumerate(["nats", "scheduler-0", "worker-0", "gateway"])])


def die(stack: FakeStack, name: str, code: int = -9) -> Child:
    child = next(c for c in stack.children if c.name == name)
    child.proc.returncode = code
    return child


def test_a_dead_child_is_restarted_after_its_backoff_and_the_others_are_left_alone(stack):
    sup = Supervisor(stack, Backoff(first=0.5, cap=10.0, reset_after=30.0), clock=clock)
    clock.now = 5.0
    worker = die(stack, "worker-0")
    assert sup.poll() == []  # noticed; waits 0.5 s
    clock.now = 5.4
    assert sup.poll() == []
    clock.now = 5.5
    assert sup.poll() == ["worker-0"]
    assert worker.proc.pid == 101 and worker.proc.poll() is None and worker.argv == ["worker-0"]
    assert [c.proc.pid for c in stack.children] == [0, 1, 101, 3]
    assert sup.restarts == {"worker-0": 1}
    assert sup.poll() == []


def test_backoff_doubles_while_the_child_dies_young_up_to_the_cap_then_resets(stack):
    sup = Supervisor(stack, Backoff(first=0.5, cap=4.0, reset_after=30.0), clock=clock)
    delays = []
    for _ in range(6):
        die(stack, "scheduler-0")
        start = clock.now
        sup.poll()
        while not sup.poll():
            clock.now += 0.25
        delays.append(clock.now - start)
        clock.now += 1.0  # runs 1 s, then dies again
    assert delays == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    clock.now += 30.0  # a long healthy run forgets the crash loop
    die(stack, "scheduler-0")
    sup.poll()
    clock.now += 0.5
    assert sup.poll() == ["scheduler-0"]


def test_nothing_is_restarted_once_the_stack_is_stopping(stack):
    sup = Supervisor(stack, Backoff(first=0.5), clock=clock)
    die(stack, "nats")
    sup.poll()
    stack.stopping = True
    clock.now = 10.0
    assert sup.poll() == []
    assert stack.children[0].proc.poll() == -9


def test_backoff_is_checked():
    with pytest.raises(ValueError):
        Backoff(first=0)
    with pytest.raises(ValueError):
        Backoff(first=5, cap=1)


def test_a_child_that_exits_with_a_configuration_error_is_not_restarted(stack, capsys):
    from shared.config import CONFIG_ERROR_EXIT

    sup = Supervisor(stack, Backoff(first=0.5), clock=clock)
    worker = die(stack, "worker-0", CONFIG_ERROR_EXIT)  # its flags or model cannot work: again would fail again
    die(stack, "scheduler-0", -9)
    for now in (1.0, 2.0, 60.0):
        clock.now = now
        restarted = sup.poll()
        assert "worker-0" not in restarted
    assert sup.failed == {"worker-0"} and worker.proc.poll() == CONFIG_ERROR_EXIT
    assert sup.restarts == {"scheduler-0": 1}
    assert capsys.readouterr().err.count("worker-0 exited with code 2 (a configuration error)") == 1
