"""Progress of long work (a benchmark, a download, writing or loading a model, capturing graphs): a
`rich` progress bar when the output is a terminal, else a plain line every few seconds, with no
control characters (CI logs, a service's log file).

    with progress("loading weights", total=n_files, unit="files") as p:
        for ...:
            p.advance(1, note="12.3 GB/s")

Without `rich` installed (the GPU image lacks it) the plain lines go out on a terminal too.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

PLAIN_EVERY_S = 5.0  # a plain line at most this often
# rich's default is 10 redraws a second, about 1.3 % of a core: that shows in a load generator's
# own CPU figure, and a bar whose numbers change a few times a second needs no more.
LIVE_REFRESH_PER_S = 2
BAR_WIDTH = 20  # characters: rich's 40 leaves a note little room on a terminal of 100 columns


class Progress:
    """Counts units of work done out of `total` (None: unknown) with a free-form note beside them."""

    def __init__(self, description: str, total: float | None = None, unit: str = "", stream: TextIO | None = None,
                 every: float = PLAIN_EVERY_S, live: bool | None = None):
        self.description = description
        self.total = total
        self.unit = unit
        self.done = 0.0
        self.note = ""
        self.stream = stream if stream is not None else sys.stderr
        self.every = every
        self.started = time.monotonic()
        self._last_line = self.started
        self._lock = threading.Lock()  # advance() from several threads (a load's copy lanes)
        self._bar = None
        self._closed = False
        if live is None:
            live = getattr(self.stream, "isatty", lambda: False)()
        if live:
            self._bar = _rich_bar(self)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def advance(self, n: float = 1, note: str | None = None) -> None:
        with self._lock:
            self.update(self.done + n, note)

    def update(self, done: float, note: str | None = None, total: float | None = None) -> None:
        self.done = done
        if note is not None:
            self.note = note
        if total is not None:
            self.total = total
        if self._bar is not None:
            bar, task = self._bar
            bar.update(task, completed=done, total=self.total, note=self.note)
            return
        now = time.monotonic()
        if now - self._last_line >= self.every:
            self._last_line = now
            self._line()

    def close(self, done: float | None = None, note: str | None = None) -> None:
        """The final line, or the bar's last state; done and note, when given, are the final ones (an
        update() just before would show them twice). A second close does nothing."""
        if self._closed:
            return
        self._closed = True
        self.done = self.done if done is None else done
        self.note = self.note if note is None else note
        if self._bar is not None:
            bar, task = self._bar
            bar.update(task, completed=self.done, total=self.total, note=self.note)
            bar.stop()
            self._bar = None
        else:
            self._line(final=True)

    def line(self) -> str:
        """The plain line: description, done / total unit (percent), the note, seconds so far."""
        unit = f" {self.unit}" if self.unit else ""
        count = f"{_num(self.done)}/{_num(self.total)}{unit} ({100 * self.done / self.total:.0f} %)" if self.total \
            else f"{_num(self.done)}{unit}"
        note = f", {self.note}" if self.note else ""
        return f"{self.description}: {count}{note}, {time.monotonic() - self.started:.1f} s"

    def _line(self, final: bool = False) -> None:
        print(self.line() + (" — done" if final else ""), file=self.stream, flush=True)


def progress(description: str, total: float | None = None, unit: str = "", stream: TextIO | None = None,
             every: float = PLAIN_EVERY_S, live: bool | None = None) -> Progress:
    return Progress(description, total, unit, stream, every, live)


def _num(x: float | None) -> str:
    if x is None:
        return "?"
    return f"{x:,.0f}" if float(x).is_integer() or x >= 100 else f"{x:,.1f}"


def _rich_bar(p: Progress):
    """A started rich progress bar with one task for `p`, or None without rich."""
    try:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, \
            TimeElapsedColumn
        from rich.table import Column
    except ImportError:
        return None

    def fixed() -> Column:  # on a narrow terminal the note wraps, rather than every column being cut short
        return Column(no_wrap=True)

    # stdout is left alone: it may carry a report piped elsewhere, which must not end up in the bar's stream.
    bar = RichProgress(TextColumn("[bold]{task.description}", table_column=fixed()),
                       BarColumn(BAR_WIDTH, table_column=fixed()), MofNCompleteColumn(table_column=fixed()),
                       TextColumn(p.unit, table_column=fixed()), TimeElapsedColumn(table_column=fixed()),
                       TextColumn("{task.fields[note]}", table_column=Column(no_wrap=False)),
                       console=Console(file=p.stream), transient=False,
                       refresh_per_second=LIVE_REFRESH_PER_S, redirect_stdout=False)
    task = bar.add_task(p.description, total=p.total, note="")
    bar.start()
    return bar, task
