"""The sampler's kernel variants compiled beside serving, and the exact draws meanwhile.

The draw's Triton kernels come in ~22 variants (batch-size classes, the logits' dtype, which of their
launches a batch needs: sampling.warm_row_counts), ~1.3 s each to compile on an H200 host. With an
empty Triton cache they were 30 s of a 48 s start to the first token (the KV sizing's dry draw 16.5
s, the warm-up 19 s; 8B, 2026-11-29). A first token needs none of them: a greedy batch takes the
argmax, and sample_ref draws bit for bit as the kernels do. So a worker compiles them on a thread
once it serves and its CUDA graphs are captured (Warmup.start: a launch from another thread may break
a capture), and until every one is compiled each draw is sample_ref's,
FALLBACK_ROWS rows at a time (at once, its fp32 copies and sort of a 128k vocabulary take ~6 MB a
row). `inferno bench-engine`, the tests and `inferno warm-kernels` compile them first (Warmup.run).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import structlog
import torch

from services.worker.engine.cuda_device import bind_thread
from services.worker.kernels.sampling import workspace_bytes
from services.worker.kernels.sampling_ref import sample_ref

log = structlog.get_logger("worker.sampler")

FALLBACK_ROWS = 32  # rows of one sample_ref call while the kernels compile (~190 MB at a 128k vocabulary)
# Warm-up draws compiling at once. Each holds the GIL for much of its compile, and the step thread
# and the event loop queue behind every one of them: with 8, a worker's first lane had first tokens
# of ~1 s (two H200s, 2026-11-29); a 2.2 ms stand-in step beside 1 / 2 / 4 / 8 compiling threads took
# 10.5 / 17.8 / 22.0 / 30.9 ms at worst (a 2-core CPU, bench-free probe). Two keep the 22 variants to
# ~15 s, and a later start's are compiled by the kernel manifest's helper processes instead.
WARM_THREADS = 2


def draw_exact(logits, temperature, top_k, top_p, min_p, seeds, offsets) -> torch.Tensor:
    """sample_ref's tokens, FALLBACK_ROWS rows at a time (each row's draw is its own: the same tokens)."""
    n = logits.shape[0]
    if n <= FALLBACK_ROWS:
        return sample_ref(logits, temperature, top_k, top_p, min_p, seeds, offsets)
    parts = [sample_ref(*(t[i:i + FALLBACK_ROWS] for t in (logits, temperature, top_k, top_p, min_p, seeds, offsets)))
             for i in range(0, n, FALLBACK_ROWS)]
    return torch.cat(parts)


def warm_batches(rows: list[int], logits_dtype: torch.dtype) -> list[tuple[torch.dtype, list[tuple]]]:
    """(logits dtype, draws) of the warm-up, one logits buffer per dtype: each draw is (rows, float
    rows, int rows) as Sampler._draw_kernel takes them. At every batch-size class in the model's logits
    dtype; logits widened to fp32 (a batch with penalties, rare) draw in one launch shape, so one size
    compiles theirs. The first and last sizes read the row two ways (split over chunks or not:
    sampling._collects). A batch without chain rows (top-p or min-p alone) skips the rounds: other
    variants, at the first and last sizes."""
    batches = []
    for dtype in dict.fromkeys((logits_dtype, torch.float32)):
        sizes = rows if dtype == logits_dtype else list(dict.fromkeys((rows[0], rows[-1])))
        draws = [(n, [[1.0] * n, [0.9] * n, [0.0] * n], [[0] * n, [0] * n, [0] * n]) for n in sizes]
        draws += [(n, [[1.0] * n, [1.0] * n, [0.0] * n], [[40] * n, [0] * n, [0] * n])
                  for n in dict.fromkeys((sizes[0], sizes[-1]))]
        batches.append((dtype, draws))
    return batches


class Warmup:
    """The warm-up draws of one sampler (`draw`: its kernel path), now (run) or on a thread (start);
    `ready` once every one has run (never, if one failed: the draws then stay with sample_ref)."""

    def __init__(self, draw: Callable, rows: list[int], logits_dtype: torch.dtype, vocab: int,
                 device: torch.device):
        self.draw, self.vocab, self.device = draw, vocab, device
        self.batches = warm_batches(rows, logits_dtype) if rows else []
        self.ready = not self.batches
        self._stopped = False
        self.draws = sum(len(d) for _, d in self.batches)
        self._thread: threading.Thread | None = None

    def reserve_bytes(self) -> int:
        """Device bytes the warm-up holds at most (one dtype's logits at its largest size, and a draw's
        buffers per thread): beside a serving step's when it runs on a thread."""
        if not self.batches:
            return 0
        largest = max(max(n for n, _, _ in draws) * self.vocab * dtype.itemsize for dtype, draws in self.batches)
        n_max = max(n for _, draws in self.batches for n, _, _ in draws)
        return largest + WARM_THREADS * workspace_bytes(n_max, self.vocab, self.device)

    def run(self) -> int:
        """Every warm-up draw, now; returns how many."""
        for dtype, draws in self.batches:
            self._run_batch(dtype, draws)
        self.ready = not self._stopped
        return self.draws

    def wait(self, timeout: float | None = None) -> bool:
        """Until a started warm-up has ended (ready or failed); whether the kernels are ready."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self.ready

    @property
    def started(self) -> bool:
        return self._thread is not None

    def stop(self, timeout: float = 30.0) -> None:
        """No more draws (its model is being unloaded); waits for those under way (a compile: seconds)."""
        self._stopped = True
        self.wait(timeout)

    def start(self) -> None:
        """The warm-up on a thread of its own: the sampler draws with sample_ref until it is done."""
        def warm() -> None:
            bind_thread(self.device)
            try:
                self.run()
                log.info("sampler kernels compiled", draws=self.draws)
            except Exception:  # the exact draws go on: slower, never wrong
                log.exception("sampler warm-up failed: draws stay with sample_ref")
        self._thread = threading.Thread(target=warm, name="sampler-warmup", daemon=True)
        self._thread.start()

    def _run_batch(self, dtype: torch.dtype, draws: list[tuple]) -> None:
        """On a GPU the first draw alone (it compiles the launches every size shares), then the others
        on threads, so that their kernels compile side by side (Triton's compiler and ptxas run
        outside the GIL for much of a compile); elsewhere in order."""
        if self._stopped:
            return
        logits = torch.zeros(max(n for n, _, _ in draws), self.vocab, dtype=dtype, device=self.device)
        jobs = [(logits[:n], floats, ints) for n, floats, ints in draws]
        if self.device.type != "cuda" or len(jobs) < 3:
            for job in jobs:
                self._draw(*job)
            return
        self._draw(*jobs[0])
        with ThreadPoolExecutor(min(WARM_THREADS, len(jobs) - 1), initializer=bind_thread,
                                initargs=(self.device,)) as pool:
            for future in [pool.submit(self._draw, *job) for job in jobs[1:]]:
                future.result()
        torch.cuda.synchronize(self.device)

    def _draw(self, *job) -> None:
        if not self._stopped:
            self.draw(*job)
