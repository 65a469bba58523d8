"""Restarts the stack's children that exit (workers, scheduler, kvstore, nats-server, gateway), each
with its own exponential backoff, while the others keep running; one that exits with a
configuration error is left down, as starting it again would fail again."""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from services.children import Child
from shared.config import CONFIG_ERROR_EXIT


class Supervised(Protocol):
    """What the supervisor needs of a stack (services/launcher.py's Stack)."""

    children: list[Child]
    stopping: bool  # set once it is being stopped: nothing is restarted then
    reported: set[str]  # children whose exit has been told

    def restart(self, child: Child) -> None: ...


@dataclass(frozen=True, slots=True)
class Backoff:
    first: float = 0.5  # seconds before the first restart: a crash loop must not spin
    cap: float = 10.0
    reset_after: float = 30.0  # a child that ran this long before dying starts from `first` again

    def __post_init__(self) -> None:
        if not 0 < self.first <= self.cap:
            raise ValueError("backoff needs 0 < first <= cap")
        if self.reset_after <= 0:
            raise ValueError("reset_after must be positive")


@dataclass(slots=True)
class _Pending:
    delay: float  # the backoff this death earned
    restart_at: float  # monotonic seconds


class Supervisor:
    """Watches a Stack's children; `poll()` does one round (the launcher's loop or a test's thread
    calls it). A dead child is restarted with the same argv after its backoff; the delay doubles
    while it keeps dying young and is forgotten once it has run for `reset_after`."""

    def __init__(self, stack: Supervised, backoff: Backoff = Backoff(),
                 clock: Callable[[], float] = time.monotonic):
        self.stack = stack
        self.backoff = backoff
        self.clock = clock
        self.restarts: dict[str, int] = {}  # child name → restarts so far
        self.failed: set[str] = set()  # children left down: they exited with a configuration error
        self._delay: dict[str, float] = {}  # child name → the backoff of its last restart
        self._pending: dict[str, _Pending] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def poll(self) -> list[str]:
        """Notice exits, restart the children whose backoff has passed; returns the names restarted."""
        if self.stack.stopping:
            return []
        now = self.clock()
        restarted = []
        for child in list(self.stack.children):
            code = child.proc.poll()
            if code is None or child.name in self.failed:
                continue
            if code == CONFIG_ERROR_EXIT:
                self.failed.add(child.name)
                self.stack.reported.add(child.name)
                print(f"inferno: {child.exit_report()}\ninferno: {child.name} is not restarted: it would fail "
                      "the same way", file=sys.stderr, flush=True)
                continue
            pending = self._pending.get(child.name)
            if pending is None:
                pending = self._pending[child.name] = self._schedule(child, code, now)
            if now >= pending.restart_at and self._restart(child):
                restarted.append(child.name)
        return restarted

    def _schedule(self, child: Child, code: int, now: float) -> _Pending:
        ran = now - child.started
        last = self._delay.get(child.name)
        delay = self.backoff.first if last is None or ran >= self.backoff.reset_after else \
            min(self.backoff.cap, 2 * last)
        self._delay[child.name] = delay
        self.stack.reported.add(child.name)
        print(f"inferno: {child.name} exited with code {code} after {ran:.1f} s; restarting it in {delay:g} s",
              file=sys.stderr, flush=True)
        return _Pending(delay, now + delay)

    def _restart(self, child: Child) -> bool:
        del self._pending[child.name]
        try:
            self.stack.restart(child)
        except RuntimeError:  # stop() began meanwhile
            return False
        except OSError as e:  # e.g. the binary vanished: try again after a longer backoff
            print(f"inferno: {child.name} could not be restarted: {e}", file=sys.stderr, flush=True)
            child.started = self.clock()
            return False
        self.restarts[child.name] = self.restarts.get(child.name, 0) + 1
        print(f"inferno: {child.name} restarted (pid {child.proc.pid})", file=sys.stderr, flush=True)
        return True

    # -- a background thread, for callers without a loop of their own (tests) -----------------------

    def start(self, interval: float = 0.2) -> "Supervisor":
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, args=(interval,), name="inferno-supervisor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self.poll()
