"""One step's outputs as columns: a thousand rows a step on a GPU, so no object per row.

Row i is request `request_ids[i]`'s new token. The rare rows that end, fail, hand their KV on or
carry logprobs keep a whole RequestOutput in `special`. The TokenBatch for the gateway is packed
straight from the columns (token_batches.py); iterating yields RequestOutputs, for the few callers
that want them (tests, hand-offs).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from services.worker.engine.request_output import RequestOutput

__all__ = ["RequestOutput", "StepOutputs"]


def _empty() -> np.ndarray:
    return np.zeros(0, dtype=np.int32)


@dataclass(slots=True)
class StepOutputs:
    request_ids: list[str] = field(default_factory=list)
    # int32 columns, one entry a row, except token_ids: token_counts[i] (1, or 0 for a row that
    # failed) tokens a row, back to back
    token_ids: np.ndarray = field(default_factory=_empty)
    token_counts: np.ndarray = field(default_factory=_empty)
    num_prompt_tokens: np.ndarray = field(default_factory=_empty)
    num_cached_tokens: np.ndarray = field(default_factory=_empty)
    num_output_tokens: np.ndarray = field(default_factory=_empty)
    special: dict[int, RequestOutput] = field(default_factory=dict)  # row → its whole output

    @classmethod
    def of(cls, outputs: list[RequestOutput]) -> StepOutputs:
        """Columns of per-request outputs (failed steps, the model-free emitter)."""
        special = {i: o for i, o in enumerate(outputs)
                   if o.finish_reason is not None or o.handoff is not None or o.logprobs is not None}
        column = (lambda values: np.array(values, dtype=np.int32))
        return cls([o.request_id for o in outputs], column([t for o in outputs for t in o.new_token_ids]),
                   column([len(o.new_token_ids) for o in outputs]), column([o.num_prompt_tokens for o in outputs]),
                   column([o.num_cached_tokens for o in outputs]), column([o.num_output_tokens for o in outputs]),
                   special)

    @classmethod
    def join(cls, parts: list[StepOutputs]) -> StepOutputs:
        """Several steps' outputs in one (a pipeline may finish more than one step per call)."""
        if len(parts) == 1:
            return parts[0]
        special, base = {}, 0
        for part in parts:
            special.update((base + i, o) for i, o in part.special.items())
            base += len(part)
        cat = (lambda name: np.concatenate([getattr(p, name) for p in parts]))
        return cls([rid for p in parts for rid in p.request_ids], cat("token_ids"), cat("token_counts"),
                   cat("num_prompt_tokens"), cat("num_cached_tokens"), cat("num_output_tokens"), special)

    def take(self, rows: list[int]) -> StepOutputs:
        """These rows only (those of one gateway when several are served)."""
        idx = np.asarray(rows, dtype=np.int64)
        counts = self.token_counts[idx]
        starts = (np.cumsum(self.token_counts) - self.token_counts)[idx]
        tokens = self.token_ids[starts[counts > 0]] if len(self.token_ids) else _empty()
        special = {j: self.special[i] for j, i in enumerate(rows) if i in self.special}
        return StepOutputs([self.request_ids[i] for i in rows], tokens, counts, self.num_prompt_tokens[idx],
                           self.num_cached_tokens[idx], self.num_output_tokens[idx], special)

    def row(self, i: int) -> RequestOutput:
        """Row i as a RequestOutput (its special one if it has one)."""
        out = self.special.get(i)
        if out is not None:
            return out
        start = int(self.token_counts[:i].sum())
        return RequestOutput(self.request_ids[i], self.token_ids[start:start + self.token_counts[i]].tolist(),
                             int(self.num_prompt_tokens[i]), int(self.num_cached_tokens[i]),
                             int(self.num_output_tokens[i]))

    @property
    def any_finished(self) -> bool:
        return any(o.finish_reason is not None for o in self.special.values())

    @property
    def any_tokens(self) -> bool:
        return len(self.token_ids) > 0

    def ended(self) -> list[RequestOutput]:
        """The rows whose request is done here: finished, or handed to a decode worker."""
        return [o for o in self.special.values() if o.finish_reason is not None or o.handoff is not None]

    def __len__(self) -> int:
        return len(self.request_ids)

    def __bool__(self) -> bool:
        return bool(self.request_ids)

    def __getitem__(self, i: int) -> RequestOutput:
        return self.row(range(len(self))[i])

    def __iter__(self) -> Iterator[RequestOutput]:
        tokens, counts, at = self.token_ids.tolist(), self.token_counts.tolist(), 0
        for i, rid in enumerate(self.request_ids):
            n = counts[i]
            out = self.special.get(i)
            if out is None:
                out = RequestOutput(rid, tokens[at:at + n], int(self.num_prompt_tokens[i]),
                                    int(self.num_cached_tokens[i]), int(self.num_output_tokens[i]))
            at += n
            yield out
