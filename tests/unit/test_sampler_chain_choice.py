"""The sampler launches the kernels' chunked chain and their second read only for batches that need them."""

from __future__ import annotations

import torch

from services.worker.engine.ops import TorchOps
from services.worker.engine.sampler import Sampler

VOCAB = 50


class _Recording(TorchOps):
    def __init__(self):
        self.asked = []

    def sample(self, *args, chain: bool = True, second_read: bool = True, one_shape: bool = False):
        self.asked.append((chain, second_read))
        return super().sample(*args)


def _draw(rows: list[tuple]) -> tuple[bool, bool]:
    """rows: (temperature, top_p, top_k[, min_p]) each; whether the draw asked for the chain, and for
    the second read."""
    ops = _Recording()
    sampler = Sampler(ops, VOCAB, torch.device("cpu"))
    n = len(rows)
    sampler._draw(torch.zeros(n, VOCAB), [[r[0] for r in rows], [r[1] for r in rows],
                                          [r[3] if len(r) > 3 else 0.0 for r in rows]],
                  [[r[2] for r in rows], [0] * n, [0] * n])
    return ops.asked[-1]


def test_a_sampled_row_with_top_p_or_min_p_and_no_top_k_needs_the_chain():
    assert _draw([(0.8, 0.9, 0)])[0]
    assert _draw([(0.8, 0.9, -1)])[0]  # -1: no top-k, as 0
    assert _draw([(0.8, 0.9, VOCAB)])[0]  # top-k of the whole vocabulary filters nothing
    assert _draw([(0.8, 1.0, 0), (0.7, 0.95, 0)])[0]  # one such row is enough
    assert _draw([(0.8, 1.0, 0, 0.1)])[0]  # min-p alone: a chain row too
    assert not _draw([(0.8, 0.9, 40)])[0]  # top-k bounds the set: the second read's buffer ends its chain
    assert not _draw([(0.8, 1.0, 0)])[0]  # no filter
    assert not _draw([(0.0, 0.9, 0)])[0]  # greedy


def test_only_a_sampled_row_with_top_k_needs_the_second_read():
    assert _draw([(0.8, 0.9, 40)]) == (False, True)
    assert _draw([(0.8, 0.9, 40), (0.8, 0.9, 0)]) == (True, True)
    assert _draw([(0.8, 0.9, 0), (0.8, 1.0, 0, 0.05)]) == (True, False)
    assert _draw([(0.0, 1.0, 5), (0.8, 1.0, 0)]) == (False, False)  # greedy top-k: argmax in pass 1
