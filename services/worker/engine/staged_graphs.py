"""When the engine's CUDA graphs are captured: a worker that loads a model says it is ready first,
and its step thread captures the graphs afterwards, one bucket per turn between steps.

Measured on the H100 (8B, 2026-11-24): capturing every bucket (32 decode batch sizes and 10 mixed
token counts at the GPU defaults) takes ~2.6 s; six of them before ready (the largest of each kind
and a few small ones) took 0.57–0.61 s of a start whose target is 2.5 s (a load on a running worker)
or 8 s (a process start); the other 36 took 2.0 s after. So by default none is captured before ready:
steps run eagerly until a kind's buckets are all captured (the largest first, which sizes the memory
pool the others share), then replay them. The graphs, their static buffers and their capture order
are the engine's own (cuda_graphs.py, mixed_graphs.py); this file only decides when each bucket is
captured.
"""

from __future__ import annotations

import time

import structlog
import torch

from services.worker.engine.cuda_device import DEVICE_LOCK
from services.worker.engine.cuda_graphs import CudaGraphRunner
from services.worker.engine.mixed_graphs import MixedGraphRunner

log = structlog.get_logger("worker.graphs")
CAPTURE_ATTEMPTS = 3  # tries of one bucket before its kind is left eager


class GraphMemory:
    """The memory pool of a model's graphs, kept for the next model's: the old graphs hold it (a
    pool lives while a graph captured into it does) until a new one is captured into it."""

    def __init__(self, pool, graphs: list):
        self.pool = pool
        self._holders = graphs  # never replayed again: their model's weights are gone

    def release(self) -> None:
        self._holders = []


class StagedGraphs:
    """The decode and mixed-step graphs of one engine (as LLMEngine builds them). capture_ready()
    captures the first `before_ready` buckets of the backlog; capture_next() the next one. A kind's
    runner is handed to the engine once all its buckets are captured (with only some, a small batch
    would replay a large padded graph, slower than running eagerly)."""

    def __init__(self, engine, memory: GraphMemory | None = None, before_ready: int = 0):
        cfg = engine.config
        max_len = min(engine.max_model_len, cfg.max_graph_len)
        self.engine = engine
        self.cuda = engine.device.type == "cuda"
        self.decode = CudaGraphRunner(engine.model, engine.kv_cache, cfg.max_num_seqs, max_len, engine.device)
        self.mixed = (MixedGraphRunner(engine.model, engine.kv_cache, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                       max_len, engine.device, cfg.drafts) if cfg.mixed_graphs else None)
        self.memory = memory
        self.pool = memory.pool if memory is not None else None
        self.before_ready = before_ready
        # Largest first (the pool's size, every step of its kind fits it), then the rest ascending.
        self.backlog: list[tuple[object, int]] = []
        self.total: dict[int, int] = {}
        for runner in (self.decode, self.mixed):
            if runner is not None:
                sizes, runner.buckets = list(runner.buckets), []  # buckets: those captured so far
                self.backlog += [(runner, sizes[-1])] + [(runner, b) for b in sizes[:-1]]
                self.total[id(runner)] = len(sizes)
        self.ready_seconds = 0.0
        self.later_seconds = 0.0
        self._stream = None
        self._failures: dict[tuple[int, int], int] = {}

    @property
    def count(self) -> int:
        """Buckets captured so far."""
        return len(self.decode.buckets) + (len(self.mixed.buckets) if self.mixed is not None else 0)

    def capture_ready(self) -> float:
        t0 = time.perf_counter()
        for _ in range(min(self.before_ready, len(self.backlog))):
            self.capture_next()
        self.ready_seconds, self.later_seconds = time.perf_counter() - t0, 0.0
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
        runner.dev.zero_()
        if runner is self.decode:
            runner.d_slots.fill_(-1)
            runner.d_seq_lens.fill_(1)
        else:
            runner.d["slots"].fill_(-1)
            runner.d["tiles"].fill_(-1)
        try:
            self._capture(runner, size)
        except RuntimeError as e:
            return self._failed(runner, size, e)
        runner.buckets = sorted([*runner.buckets, size])
        if len(runner.buckets) == self.total[id(runner)]:  # complete: its steps replay graphs from now on
            if runner is self.decode:
                self.engine.runner.graphs = runner
            else:
                self.engine.runner.mixed_graphs = runner
        if not self.backlog and self.cuda:
            self.engine.runner.warm_logits(self.engine.config.max_num_seqs)
        self.later_seconds += time.perf_counter() - t0
        if not self.backlog:
            memory = self._memory() if self.cuda else {}
            log.info("graphs captured", graphs=self.count, before_ready=self.before_ready,
                     before_ready_s=round(self.ready_seconds, 3), after_ready_s=round(self.later_seconds, 3),
                     **memory)
        return bool(self.backlog)

    def _failed(self, runner, size: int, error: RuntimeError) -> bool:
        """A capture that broke: the bucket goes back to the front of the backlog (up to
        CAPTURE_ATTEMPTS tries), and its kind's steps run eagerly meanwhile. Seen once in six 4-GPU
        stacks with the kvstore on (2026-11-29): while another thread of the worker set UCX up, a
        capture ended in "operation failed due to a previous error during capture"; dropping the
        bucket left that worker eager for good (4.4x the CPU a token, 0.78x the stack's W2)."""
        if self.cuda:
            torch.cuda.synchronize(self.engine.device)
        key = (id(runner), size)
        self._failures[key] = self._failures.get(key, 0) + 1
        if self._failures[key] < CAPTURE_ATTEMPTS:
            log.warning("graph capture failed, will retry", bucket=size, attempt=self._failures[key],
                        error=str(error).splitlines()[0][:200])
            self.backlog.insert(0, (runner, size))
            return True
        log.error("graph capture failed, this kind runs eagerly", bucket=size, attempts=self._failures[key],
                  error=str(error).splitlines()[0][:200])
        self.backlog = [(r, s) for r, s in self.backlog if r is not runner]
        return bool(self.backlog)

    def _memory(self) -> dict:
        """The device memory left once every graph holds its pool (free, and cached by the allocator
        for the eager steps): what the KV sizing's reserves (gpu_memory.py) left over."""
        device = self.engine.device
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        free = torch.cuda.mem_get_info(device)[0]
        return {"free_gib": round(free / 2**30, 2), "cached_gib": round(cached / 2**30, 2)}

    def _capture(self, runner, size: int) -> None:
        """One graph into the shared pool. Not torch.cuda.graph(): that empties the allocator's
        caches (device, and the pinned host memory the next load's staging would reuse) before each
        capture, which costs the steps around it; and here only this thread's calls may break a
        capture (the event loop's may touch the device)."""
        if not self.cuda:
            runner.outputs[size] = runner._forward(size)
            if runner is self.decode:  # the CPU's stand-in replays the forward into the same output
                runner.graphs[size] = _Rerun(runner._forward, size, runner.outputs[size])
            return
        runner._forward(size)  # compile and warm the kernels outside capture
        current = torch.cuda.current_stream(self.engine.device)
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.engine.device)
        stream = self._stream
        stream.wait_stream(current)
        graph = torch.cuda.CUDAGraph()
        with DEVICE_LOCK, torch.cuda.stream(stream):
            graph.capture_begin(self.pool, capture_error_mode="thread_local")
            try:
                runner.outputs[size] = runner._forward(size)
            finally:
                graph.capture_end()
        current.wait_stream(stream)
        runner.graphs[size] = graph
        if self.pool is None:
            self.pool = graph.pool()
        if self.memory is not None:  # a graph of this engine holds the pool now
            self.memory.release()
            self.memory = None

    def graph_memory(self) -> GraphMemory | None:
        """What the next model's graphs may reuse, once this engine is dropped."""
        if self.pool is None:
            return None
        graphs = [*self.decode.graphs.values(), *(self.mixed.graphs.values() if self.mixed is not None else ())]
        return GraphMemory(self.pool, [g for g in graphs if isinstance(g, torch.cuda.CUDAGraph)])


class _Rerun:
    """The CPU's stand-in for a captured graph (as cuda_graphs' own): replay reruns the forward."""

    def __init__(self, forward, bucket: int, out: torch.Tensor):
        self.forward, self.bucket, self.out = forward, bucket, out

    def replay(self) -> None:
        self.out.copy_(self.forward(self.bucket))
