"""Speculative decoding's configuration (vLLM's `--speculative-config` keys) and its n-gram drafter.

A draft is checked the way jump-forward's is (drafts.py): the step computes the draft's tokens and
draws a row after each, with the mask and the seeded counter token-by-token decoding would use at
that place, and keeps the draft's tokens the draws confirm, then the first draw that differs. For a
draft of single tokens that is speculative sampling's rule (accept with probability p(draft), else
draw from the rest of p), and the answer is that of decoding without a draft, token for token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

METHODS = ("ngram", "draft_model", "eagle3")
# Rows past which a bf16 step's GEMMs are bound by compute, not by reading the weights (an H100's or
# H200's ~990 TFLOP/s over 3.3–4.8 TB/s is ~200–300 FLOP a byte, 2 FLOP a weight a row): speculation
# pauses where its checks would take more rows than this.
COMPUTE_BOUND_ROWS = 256
LOOKBACK = 4096  # tokens the n-gram lookup searches, the latest: a step's search stays ~0.1 ms


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2  # the shortest n-gram of the latest tokens looked up earlier in the sequence
    prompt_lookup_max: int = 4
    # More running requests than this: no drafts (the steps overlap again); 0: no bound.
    disable_by_batch_size: int = 32
    model: str = ""  # a draft model or EAGLE-3 head directory (draft_model, eagle3)

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """From --speculative-config's JSON (vLLM's keys); ValueError naming what is wrong."""
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ValueError(f"--speculative-config is not JSON: {e}") from None
        if not isinstance(data, dict):
            raise ValueError("--speculative-config must be a JSON object")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"--speculative-config: unknown keys {unknown} (known: {sorted(known)})")
        cfg = cls(**data)
        cfg.check()
        return cfg

    def drafts_at(self, running: int) -> bool:
        """Drafts are made while at most disable_by_batch_size requests run, and while a step of drafts
        stays weight-bound: past COMPUTE_BOUND_ROWS rows (k + 1 a request) its GEMMs cost by the row,
        and every rejected draft token is a row paid for nothing."""
        return ((not self.disable_by_batch_size or running <= self.disable_by_batch_size)
                and running * (self.num_speculative_tokens + 1) <= COMPUTE_BOUND_ROWS)

    def check(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"--speculative-config: method must be one of {METHODS}, got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"--speculative-config: {name} must be a non-negative int, got {value!r}")
        if not 1 <= self.num_speculative_tokens <= 64:
            raise ValueError("--speculative-config: num_speculative_tokens must be in [1, 64]")
        if self.method != "ngram" and not self.model:
            raise ValueError(f"--speculative-config: method {self.method!r} needs \"model\": a directory")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("--speculative-config: needs 1 <= prompt_lookup_min <= prompt_lookup_max")


def ngram_draft(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Prompt lookup: the k tokens that followed the latest earlier occurrence of the sequence's last
    n tokens (the longest n from n_max down to n_min that occurs); [] when none does."""
    size = len(tokens)
    if k <= 0 or size <= n_min:
        return []
    arr = np.asarray(tokens[-LOOKBACK:], dtype=np.int64)
    for n in range(min(n_max, len(arr) - 1), n_min - 1, -1):
        pattern = arr[-n:]
        # Starts of earlier windows equal to the pattern, the latest first; the suffix itself is not one.
        views = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)
        hits = np.flatnonzero((views == pattern).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return arr[start:start + k].tolist()
    return []
