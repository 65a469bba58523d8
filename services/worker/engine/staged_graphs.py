"""The engine's CUDA graphs in two stages: before a worker says it is ready, the buckets its first
steps need; after, the others, one per turn of the step thread, between steps.

Capturing every bucket (32 decode batch sizes and 10 mixed-step token counts at the GPU defaults)
took 1.4–2.3 s of an 8B model's start on the H100, most of the 2.5 s a load on a running worker may
take to its first token. Until a bucket is captured its steps replay the next larger one (padded
rows cost little next to the weights every step reads), so nothing runs eagerly that would not.
The graphs, their static buffers and their order are the engine's own (cuda_graphs.py,
mixed_graphs.py); this file only decides when each bucket is captured.
"""

from __future__ import annotations

import time

import structlog
import torch

from services.worker.engine.cuda_graphs import CudaGraphRunner
from services.worker.engine.mixed_graphs import MixedGraphRunner

log = structlog.get_logger("worker.graphs")

# Captured before ready, besides the largest bucket of each kind (captured first: it sizes the memory
# pool every other graph shares, and every step fits it): the batch sizes of light traffic, and the
# token count of one short prompt beside a few decodes.
READY_DECODE_ROWS = (1, 8, 64)
READY_MIXED_TOKENS = (256,)


class GraphMemory:
    """The memory pool of a model's graphs, kept for the next model's: the old graphs hold it (a
    pool lives while a graph captured into it does) until the new ones are captured into it."""

    def __init__(self, pool, graphs: list):
        self.pool = pool
        self._holders = graphs  # never replayed again: their model's weights are gone

    def release(self) -> None:
        self._holders = []


class StagedGraphs:
    """The decode and mixed-step graphs of one engine (as LLMEngine builds them), captured in two
    stages: capture_ready() before serving, capture_next() one bucket at a time afterwards."""

    def __init__(self, engine, memory: GraphMemory | None = None):
        cfg = engine.config
        max_len = min(engine.max_model_len, cfg.max_graph_len)
        self.engine = engine
        self.cuda = engine.device.type == "cuda"
        self.decode = CudaGraphRunner(engine.model, engine.kv_cache, cfg.max_num_seqs, max_len, engine.device)
        self.mixed = (MixedGraphRunner(engine.model, engine.kv_cache, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                       max_len, engine.device) if cfg.mixed_graphs else None)
        self.memory = memory
        self.pool = memory.pool if memory is not None else None
        self.backlog: list[tuple[object, int]] = []  # (runner, bucket) still to capture, in order
        self.ready_seconds = 0.0
        self.later_seconds = 0.0
        self._stream = None

    @property
    def count(self) -> int:
        """Buckets captured so far."""
        return len(self.decode.buckets) + (len(self.mixed.buckets) if self.mixed is not None else 0)

    def capture_ready(self) -> float:
        """The largest bucket of each kind and the READY_* ones; the runner replays them from now on."""
        t0 = time.perf_counter()
        decode, mixed = self.decode, self.mixed
        all_rows = decode.buckets
        decode.buckets = _ready_subset(all_rows, READY_DECODE_ROWS)
        decode.pool = self.pool
        decode.capture()
        self.pool = decode.pool
        # Small buckets first: light traffic gains most from its own graph.
        self.backlog = [(decode, b) for b in all_rows if b not in decode.buckets]
        if mixed is not None:
            all_tokens = mixed.buckets
            mixed.buckets = _ready_subset(all_tokens, READY_MIXED_TOKENS)
            mixed.capture(self.pool)
            self.backlog += [(mixed, t) for t in all_tokens if t not in mixed.buckets]
        if self.memory is not None:  # the new graphs hold the pool now
            self.memory.release()
            self.memory = None
        runner = self.engine.runner
        runner.graphs, runner.mixed_graphs = decode, mixed
        self.ready_seconds = time.perf_counter() - t0
        return self.ready_seconds

    @torch.inference_mode()
    def capture_next(self) -> bool:
        """Capture one more bucket (on the step thread, between two steps); False once none is left.

        The static buffers get the dummy inputs capture() gives them (no KV slot written, one token
        of context); the next step's launch overwrites every part a graph reads.
        """
        if not self.backlog:
            return False
        t0 = time.perf_counter()
        runner, size = self.backlog.pop(0)
        if runner is self.decode:
            runner.dev.zero_()
            runner.d_slots.fill_(-1)
            runner.d_seq_lens.fill_(1)
        else:
            runner.dev.zero_()
            runner.d["slots"].fill_(-1)
            runner.d["tiles"].fill_(-1)
        if self.cuda:
            runner._forward(size)  # compile and warm the kernels outside capture
            runner.graphs[size] = self._capture(runner, size)
        else:
            runner.outputs[size] = runner._forward(size)
            if runner is self.decode:  # the CPU's stand-in replays the forward into the same output
                runner.graphs[size] = _Rerun(runner._forward, size, runner.outputs[size])
        runner.buckets = sorted([*runner.buckets, size])
        self.later_seconds += time.perf_counter() - t0
        if not self.backlog:
            log.info("graphs captured", graphs=self.count, before_ready_s=round(self.ready_seconds, 3),
                     after_ready_s=round(self.later_seconds, 3))
        return bool(self.backlog)

    def _capture(self, runner, size: int):
        """One graph into the shared pool. Not torch.cuda.graph(): that empties the allocator's
        caches (device and pinned host) before each capture, which costs the steps around it; and
        here only this thread's calls may break a capture (the event loop's may touch the device)."""
        current = torch.cuda.current_stream(self.engine.device)
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.engine.device)
        stream = self._stream
        stream.wait_stream(current)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            graph.capture_begin(self.pool, capture_error_mode="thread_local")
            try:
                runner.outputs[size] = runner._forward(size)
            finally:
                graph.capture_end()
        current.wait_stream(stream)
        return graph

    def graph_memory(self) -> GraphMemory | None:
        """What the next model's graphs may reuse, once this engine is dropped."""
        if self.pool is None:
            return None
        graphs = [*self.decode.graphs.values(), *(self.mixed.graphs.values() if self.mixed is not None else ())]
        return GraphMemory(self.pool, [g for g in graphs if isinstance(g, torch.cuda.CUDAGraph)])


def _ready_subset(buckets: list[int], wanted: tuple[int, ...]) -> list[int]:
    return sorted({b for b in buckets if b in wanted} | {buckets[-1]})


class _Rerun:
    """The CPU's stand-in for a captured graph (as cuda_graphs' own): replay reruns the forward."""

    def __init__(self, forward, bucket: int, out: torch.Tensor):
        self.forward, self.bucket, self.out = forward, bucket, out

    def replay(self) -> None:
        self.out.copy_(self.forward(self.bucket))
