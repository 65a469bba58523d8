"""The sampler launches top-p's chunked chain only for batches that can need it."""

from __future__ import annotations

import torch

from services.worker.engine.ops import TorchOps
from services.worker.engine.sampler import Sampler

VOCAB = 50


class _Recording(TorchOps):
    def __init__(self):
        self.chains = []

    def sample(self, *args, chain: bool = True, one_shape: bool = False):
        self.chains.append(chain)
        return super().sample(*args)


def _draw(rows: list[tuple[float, float, int]]) -> bool:
    """rows: (temperature, top_p, top_k) each; whether the draw asked for the chain."""
    ops = _Recording()
    sampler = Sampler(ops, VOCAB, torch.device("cpu"))
    n = len(rows)
    sampler._draw(torch.zeros(n, VOCAB), [[r[0] for r in rows], [r[1] for r in rows], [0.0] * n],
                  [[r[2] for r in rows], [0] * n, [0] * n])
    return ops.chains[-1]


def test_only_a_sampled_row_with_top_p_and_no_top_k_needs_the_chain():
    assert _draw([(0.8, 0.9, 0)])
    assert _draw([(0.8, 0.9, -1)])  # -1: no top-k, as 0
    assert _draw([(0.8, 0.9, VOCAB)])  # top-k of the whole vocabulary filters nothing
    assert _draw([(0.8, 1.0, 0), (0.7, 0.95, 0)])  # one such row is enough
    assert not _draw([(0.8, 0.9, 40)])  # top-k bounds the set: the buffer ends its chain
    assert not _draw([(0.8, 1.0, 0)])  # no top-p
    assert not _draw([(0.0, 0.9, 0)])  # greedy
