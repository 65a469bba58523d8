"""Every request's block ids mirrored into one numpy array, so a step's block table is one gather.

The block manager is the only writer of `Request.block_ids` (it appends, and clears on free); it
writes the same ids here as it appends them. A step with ~1,000 rows of ~60 blocks then takes its
table as `ids[rows, :width]` instead of walking 60,000 Python ints (≈ 3 µs per output token on
the 2-core VM, the largest single cost of a mixed step's host work).

Invariant: a row holds its request's block ids at [0, len(block_ids)) and zeros after them, so a
gather of rows is the zero-padded table the kernels expect.
"""

from __future__ import annotations

from operator import attrgetter

import numpy as np

_TABLE_ROW = attrgetter("table_row")


class BlockTables:
    def __init__(self, rows: int = 64, cols: int = 64):
        self.ids = np.zeros((rows, cols), dtype=np.int64)
        self._free_rows = list(range(rows - 1, -1, -1))

    def write(self, request, start: int) -> None:
        """Mirror request.block_ids[start:] (just appended) into the request's row."""
        n = len(request.block_ids)
        if n == start:
            return
        row = request.table_row
        if row < 0:
            row = request.table_row = self._take_row()
        if n > self.ids.shape[1]:
            self._grow(cols=max(n, 2 * self.ids.shape[1]))
        self.ids[row, start:n] = request.block_ids[start:]

    def release(self, request) -> None:
        """The request's blocks are freed: zero its row and hand it back."""
        row = request.table_row
        if row >= 0:
            self.ids[row, :len(request.block_ids)] = 0
            self._free_rows.append(row)
            request.table_row = -1

    def rows(self, requests) -> np.ndarray:
        return np.fromiter(map(_TABLE_ROW, requests), dtype=np.int64, count=len(requests))

    def _take_row(self) -> int:
        if not self._free_rows:
            old = self.ids.shape[0]
            self._grow(rows=2 * old)
            self._free_rows = list(range(2 * old - 1, old - 1, -1))
        return self._free_rows.pop()

    def _grow(self, rows: int | None = None, cols: int | None = None) -> None:
        old = self.ids
        self.ids = np.zeros((rows or old.shape[0], cols or old.shape[1]), dtype=np.int64)
        self.ids[:old.shape[0], :old.shape[1]] = old
