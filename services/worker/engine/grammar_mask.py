"""The grammar's part of a draw: the constrained rows' bitmasks (a bit per token), filled by the
requests' matchers on CPU threads, copied to the device and applied to those logits rows in place.

With overlapped steps the engine launches step N+1's forward first, then reads step N's tokens and
lets the matchers take them, and only then fills N+1's masks: the fill runs while the GPU computes
N+1's forward, and the draw waits for it only when the fill outlasts the forward. `wait` keeps how
long the GPU sat idle for the masks (CUDA events around the gap), for benchmarks.
"""

from __future__ import annotations

import os
import time

import torch

FILL_THREADS = 8  # xgrammar's fill threads at most (a GPU host has 16 cores or more)


def accept_tokens(matchers: list, tokens: list[int]) -> list[bool]:
    """Each matcher (services/worker/grammar.Matcher) takes its token, in one call for the batch
    (False: refused, or it had ended)."""
    import xgrammar as xgr

    return xgr.BatchGrammarMatcher.batch_accept_token([m.raw for m in matchers], tokens)


class GrammarMask:
    def __init__(self, vocab_size: int, device: torch.device, max_rows: int, timing: bool = False):
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size, self.device = vocab_size, device
        self._cuda = device.type == "cuda"
        self._batch = xgr.BatchGrammarMatcher(max(1, min(FILL_THREADS, (os.cpu_count() or 2) // 2)))
        # Two host buffers, pinned on CUDA: one step's copy may still be reading one while the next fills.
        self._host = [self._empty(max_rows) for _ in range(2)]
        self._turn = 0
        # A matcher's `also` row and its copy on the device, by the row's id.
        self._allowed_rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.timing = timing
        self.fill_seconds = 0.0  # the host's fills, summed (timing only)
        self.wait_seconds = 0.0  # the GPU's idle time waiting for masks, summed (timing only)
        self._pending_wait: list[tuple] = []  # event pairs not yet read

    def _empty(self, rows: int) -> torch.Tensor:
        mask = self._xgr.allocate_token_bitmask(rows, self.vocab_size)
        return mask.pin_memory() if self._cuda else mask

    def apply(self, logits: torch.Tensor, requests: list, rows: list[int], ready=None,
              places: list[int] | None = None) -> None:
        """Mask logits rows `rows` (their requests hold matchers) to what each grammar allows next.
        `ready`: a CUDA event after the logits, from which the GPU's wait for the masks is timed.
        `places`: per row, its place j in its request's jump-forward draft: the mask after the
        draft's first j tokens (the rows of one draft come in order, j = 0 .. its length)."""
        matchers, live, drafted = [], [], []
        for row in rows:
            r = requests[row]
            m = r.matcher
            if m.terminated:  # a request that ended in the step before: its row is dropped
                continue
            if places is not None and r.draft_len:
                drafted.append(row)
            else:
                matchers.append(m)
                live.append(row)
        if not live and not drafted:
            return
        t0 = time.perf_counter() if self.timing else 0.0
        n = len(requests)
        turn = self._turn
        self._turn ^= 1
        if n > self._host[turn].shape[0]:
            self._host[turn] = self._empty(n)
        host = self._host[turn][:n]
        if live:
            self._batch.batch_fill_next_token_bitmask([m.raw for m in matchers], host, live)
        for row in drafted:  # one matcher walked through its draft and back
            r, j = requests[row], places[row]
            m = r.matcher
            if j:
                m.accept(r.all_token_ids[j - 1 - r.draft_len])
            m.raw.fill_next_token_bitmask(host, row)
            if j == r.draft_len:
                m.raw.rollback(j)
            matchers.append(m)
            live.append(row)
        if self.timing:
            self.fill_seconds += time.perf_counter() - t0
            if ready is not None:
                copied = torch.cuda.Event(enable_timing=True)
                copied.record()
                self._pending_wait.append((ready, copied))
        mask = host.to(self.device, non_blocking=True) if self._cuda else host
        self._and_allowed(mask, matchers, live)
        self._xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=self.vocab_size,
                                              indices=None if len(live) == n else live)

    def _and_allowed(self, mask: torch.Tensor, matchers: list, live: list[int]) -> None:
        """AND in the rows of tokens each grammar's kind allows at all (Matcher.also): the whole
        mask at once when every live row shares one (unconstrained rows are never applied)."""
        groups: dict[int, list[int]] = {}
        for m, row in zip(matchers, live):
            if m.also is not None:
                groups.setdefault(id(m.also), []).append(row)
        for key, group in groups.items():
            source = next(m.also for m in matchers if id(m.also) == key)
            known = self._allowed_rows.get(key)
            if known is None or known[0] is not source:
                known = self._allowed_rows[key] = (source, source.to(self.device))
            also = known[1]
            if len(group) == len(live):
                mask &= also
            else:
                mask[torch.tensor(group, device=self.device)] &= also

    def read_waits(self) -> None:
        """Add the finished steps' GPU waits to wait_seconds (their events have completed)."""
        keep = []
        for ready, copied in self._pending_wait:
            if copied.query():
                self.wait_seconds += max(ready.elapsed_time(copied), 0.0) / 1e3
            else:
                keep.append((ready, copied))
        self._pending_wait = keep
