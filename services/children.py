"""The stack's child processes: each one's record, its log file in the run dir (what it wrote this
run, and why it exited), and the echo of every log onto the launcher's terminal (console format)."""

from __future__ import annotations

import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from shared.config import CONFIG_ERROR_EXIT

TAIL_LINES = 12


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    critical: bool  # the stack cannot serve without it
    argv: list[str] = field(default_factory=list)  # kept, so a restart is the same process again
    started: float = field(default_factory=time.monotonic)
    log: Path | None = None  # its stdout and stderr, appended to across restarts
    log_from: int = 0  # the log's size when this run began: what follows is this run's

    def log_tail(self, lines: int = TAIL_LINES) -> str:
        """The last lines this run of the child wrote ("" when none, or no log)."""
        try:
            with open(self.log, "rb") as f:
                f.seek(self.log_from)
                text = f.read().decode("utf-8", "replace")
        except (OSError, TypeError):
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def exit_report(self, when: str = "") -> str:
        """How it exited, and the end of its log: what `inferno up` says of a child that died."""
        code = self.proc.poll()
        kind = " (a configuration error)" if code == CONFIG_ERROR_EXIT else ""
        said = f"{self.name} exited with code {code}{kind}{when}"
        tail = self.log_tail()
        if tail:
            return said + ":\n" + "\n".join(f"  | {line}" for line in tail.splitlines())
        return said + (f" (nothing in {self.log})" if self.log else "")


class LogEcho:
    """Copies what the children write to their logs onto a stream (the launcher's terminal), whole
    lines at a time: the logs are the children's only output, so they outlive the launcher."""

    def __init__(self, out: TextIO, interval: float = 0.1):
        self.out = out
        self.interval = interval
        self._offsets: dict[Path, int] = {}  # log → bytes copied so far
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def follow(self, log: Path, offset: int) -> None:
        """Echo `log` from `offset` on (a restarted child's log is followed on from where it was)."""
        with self._lock:
            self._offsets.setdefault(log, offset)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="inferno-log-echo", daemon=True)
                self._thread.start()

    def stop(self) -> None:
        """After the children have stopped: their last lines, then no more."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._copy()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._copy()

    def _copy(self) -> None:
        with self._lock:
            for log, offset in self._offsets.items():
                try:
                    with open(log, "rb") as f:
                        f.seek(offset)
                        data = f.read()
                except OSError:
                    continue
                end = data.rfind(b"\n") + 1
                if end:
                    self.out.write(data[:end].decode("utf-8", "replace"))
                    self.out.flush()
                    self._offsets[log] = offset + end
