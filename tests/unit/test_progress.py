"""shared/progress.py: plain lines for logs (no control characters, a final line) and the rich bar."""

from __future__ import annotations

import io
import re

from shared.progress import progress

# Anything a terminal would act on: escape sequences, carriage returns, backspaces...
CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f]")


def test_plain_lines_at_most_every_interval_then_a_final_line():
    out = io.StringIO()
    with progress("loading weights", total=4, unit="files", stream=out, every=0) as p:  # every update a line
        p.advance(1, note="1.5 GB/s")
        p.update(3)
    lines = out.getvalue().splitlines()
    assert [re.sub(r", [0-9.]+ s", ", T s", line) for line in lines] == [
        "loading weights: 1/4 files (25 %), 1.5 GB/s, T s",
        "loading weights: 3/4 files (75 %), 1.5 GB/s, T s",  # the note stays until replaced
        "loading weights: 3/4 files (75 %), 1.5 GB/s, T s — done",
    ]
    assert not CONTROL.search(out.getvalue())


def test_a_long_interval_leaves_only_the_final_line():
    out = io.StringIO()  # no terminal: plain lines, even with rich installed
    p = progress("bench", total=1000, unit="requests", stream=out, every=60)
    for done in range(0, 1001, 100):
        p.update(done, note=f"in flight {1000 - done:,}")
    assert out.getvalue() == ""
    p.close()
    assert re.fullmatch(r"bench: 1,000/1,000 requests \(100 %\), in flight 0, [0-9.]+ s — done\n", out.getvalue())


def test_without_a_total_it_counts_and_the_total_can_come_later():
    out = io.StringIO()
    p = progress("downloading", unit="MB", stream=out, every=0)
    p.update(2.5)
    p.update(12.5, total=50)
    p.close()
    first, second, final = out.getvalue().splitlines()
    assert first.startswith("downloading: 2.5 MB, ")
    assert second.startswith("downloading: 12.5/50 MB (25 %), ")
    assert final.endswith("— done")


def test_the_live_bar_ends_with_its_final_state():
    out = io.StringIO()
    with progress("capturing CUDA graphs", total=4, unit="graphs", stream=out, live=True) as p:
        for b in (256, 128, 64, 1):
            p.advance(1, note=f"{b} rows")
    text = out.getvalue()
    # rich sees no terminal behind a StringIO, so it draws the bar once, as it stops.
    assert "capturing CUDA graphs" in text and "4/4" in text and "graphs" in text and "1 rows" in text
    assert "— done" not in text  # the bar is the whole output: no plain line beside it


def test_close_gives_the_final_figures_once():
    out = io.StringIO()
    with progress("bench", total=20, unit="requests", stream=out, every=0) as p:
        p.update(17, note="in flight 3")
        p.close(20, note="errors 8")  # the with block's close after it adds nothing
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].startswith("bench: 17/20 requests (85 %), in flight 3, ")
    assert re.fullmatch(r"bench: 20/20 requests \(100 %\), errors 8, [0-9.]+ s — done", lines[1])

    out = io.StringIO()
    bar = progress("bench", total=20, unit="requests", stream=out, live=True)
    bar.close(20, note="errors 8")
    bar.close()
    assert "20/20" in out.getvalue() and "errors 8" in out.getvalue() and "— done" not in out.getvalue()
