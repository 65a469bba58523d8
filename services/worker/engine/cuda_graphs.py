"""CUDA graphs of the decode step, one per batch-size bucket, replayed with static inputs.

A decode step for the 8B shape is ~400 small kernels; launched one by one from Python they cost
more than the GPU work at small batch. Replaying a captured graph costs one launch.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from itertools import chain
from operator import attrgetter

import numpy as np
import torch

from services.worker.engine.attention_metadata import AttentionMetadata
from services.worker.engine.cuda_device import DEVICE_LOCK
from shared.progress import progress

_REQUEST = attrgetter("request")
_START = attrgetter("start")
_PENDING = attrgetter("pending_input")
_RID = attrgetter("request_id")
_NUM_NEW = attrgetter("num_new_tokens")


def graph_buckets(max_num_seqs: int) -> list[int]:
    # Past 256 rows a step is long enough that padding by up to 63 rows costs less than the
    # capture time and graph memory of finer buckets.
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16)) + list(range(320, max_num_seqs + 64, 64))
    out = sorted({s for s in sizes if s < max_num_seqs} | {max_num_seqs})
    return out


def capture_buckets(buckets, forward, graphs: dict, outputs: dict, pool, cuda: bool):
    """One graph per bucket, largest first (the smaller ones reuse its memory pool); returns the
    pool. On the CPU there is nothing to capture: outputs holds one eager forward per bucket.
    On a GPU the capture's progress goes out (a plain line every few seconds into the worker's log)."""
    shown = progress("capturing CUDA graphs", len(buckets), "graphs") if cuda else None
    for b in reversed(buckets):
        if not cuda:
            outputs[b] = forward(b)
            continue
        forward(b)  # compile and warm the kernels outside capture
        graph = torch.cuda.CUDAGraph()
        with DEVICE_LOCK, torch.cuda.graph(graph, pool=pool):
            outputs[b] = forward(b)
        if pool is None:
            pool = graph.pool()
        graphs[b] = graph
        shown.advance(1, note=f"{b} rows")
    if cuda:
        torch.cuda.synchronize()
        shown.close()
    return pool


class _HostStage:
    """One pinned copy of the static inputs. There are two, used in turn: while one is being
    copied to the device for a step in flight, the next step is written into the other."""

    def __init__(self, nbytes: int, n64: int, B: int, W: int, pin: bool):
        self.host = torch.zeros(nbytes, dtype=torch.uint8)
        if pin:
            self.host = self.host.pin_memory()
        h64 = self.host[:8 * n64].numpy().view(np.int64)
        h32 = self.host[8 * n64:].numpy().view(np.int32)
        self.tokens, self.pos, self.slots = h64[:B], h64[B:2 * B], h64[2 * B:3 * B]
        self.feed_dst, self.feed_src = h64[3 * B:4 * B], h64[4 * B:]
        self.seq_lens, self.tables = h32[:B], h32[B:].reshape(B, W)


class CudaGraphRunner:
    """Static device buffers shared by every bucket's graph, filled by one host→device copy.

    Layout of the static buffer (bytes): int64 [tokens | positions | slots | feed dst | feed src]
    × B_max, then int32 [seq_lens × B_max | block_tables B_max × width]. A bucket of size B uses
    the first B rows. Rows whose token the previous step is still sampling get it by a gather on
    the device ("feed") before the replay.
    """

    def __init__(self, model, kv_cache, max_num_seqs: int, max_graph_len: int, device: torch.device,
                 num_stages: int = 2):
        """`num_stages`: host stages used in turn, one more than the steps a caller queues ahead (a
        drafter queues a proposal's steps; the engine one step in flight)."""
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.block_size = kv_cache.block_size
        self.buckets = graph_buckets(max_num_seqs)
        self.max_seqs = self.buckets[-1]
        self.width = math.ceil(max_graph_len / self.block_size)
        self.max_graph_len = self.width * self.block_size
        B, W = self.max_seqs, self.width
        n64, n32 = 5 * B, B + B * W
        self.nbytes = 8 * n64 + 4 * n32
        self.cuda = device.type == "cuda"
        self.stages = [_HostStage(self.nbytes, n64, B, W, pin=self.cuda) for _ in range(num_stages)]
        self.turn = 0
        self.dev = torch.zeros(self.nbytes, dtype=torch.uint8, device=device)
        d64 = self.dev[:8 * n64].view(torch.int64)
        d32 = self.dev[8 * n64:].view(torch.int32)
        self.d_tokens, self.d_pos, self.d_slots = d64[:B], d64[B:2 * B], d64[2 * B:3 * B]
        self.d_feed_dst, self.d_feed_src = d64[3 * B:4 * B], d64[4 * B:]
        self.d_seq_lens, self.d_tables = d32[:B], d32[B:].view(B, W)
        self.d_qsl = torch.arange(B + 1, dtype=torch.int32, device=device)
        self.rows = torch.arange(B, dtype=torch.int64, device=device)
        self.row_ids = np.arange(B, dtype=np.int64)
        self.graphs: dict[int, torch.cuda.CUDAGraph | _EagerReplay] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.aux: dict[int, torch.Tensor | None] = {}
        self.pool = None
        self.capture_seconds = 0.0

    def _next_stage(self) -> _HostStage:
        stage = self.stages[self.turn]
        self.turn = (self.turn + 1) % len(self.stages)
        return stage

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(slot_mapping=self.d_slots[:b], block_tables=self.d_tables[:b],
                                 seq_lens=self.d_seq_lens[:b], query_start_loc=self.d_qsl[:b + 1],
                                 max_query_len=1, max_seq_len=self.max_graph_len)

    def _forward(self, b: int) -> torch.Tensor:
        hidden = self.model(self.d_tokens[:b], self.d_pos[:b], self.kv_cache.layers, self._meta(b))
        self.aux[b] = self.model.aux_hidden  # a side output: a target's states for EAGLE-3, a drafter's ids
        return hidden

    @torch.inference_mode()
    def capture(self) -> float:
        t0 = time.perf_counter()
        # Dummy step: every row writes slot -1 (skipped) and attends to one token of block 0.
        stage = self.stages[0]
        stage.slots[:] = -1
        stage.seq_lens[:] = 1
        stage.tables[:] = 0
        self.dev.copy_(stage.host)
        if self.cuda:
            torch.cuda.synchronize()
        self.pool = capture_buckets(self.buckets, self._forward, self.graphs, self.outputs, self.pool, self.cuda)
        if not self.cuda:
            self.graphs = {b: _EagerReplay(self._forward, b, self.outputs[b]) for b in self.buckets}
        self.capture_seconds = time.perf_counter() - t0
        return self.capture_seconds

    def covers(self, scheduled, rows: int | None = None) -> bool:
        """`rows`: the step's tokens when some request checks a draft (a row for each, see stage)."""
        if (rows or len(scheduled)) > self.max_seqs:
            return False
        if not scheduled:
            return True
        ends = map(_START, scheduled) if rows is None else (s.start + s.num_new_tokens - 1 for s in scheduled)
        return max(ends) + 1 <= self.max_graph_len

    def run(self, scheduled, last_ids: torch.Tensor | None = None, last_rows: dict[str, int] | None = None):
        return self.launch(self.stage(scheduled, last_rows), last_ids)

    def stage(self, scheduled, last_rows: dict[str, int] | None = None, block_tables=None) -> GraphStep:
        """Write a decode step's static inputs into the next host stage. block_tables: the block
        manager's BlockTables, from which the rows' tables are gathered (else the lists are read).
        Per row only C-level maps; the arithmetic is numpy's (a thousand rows a step)."""
        if any(s.num_new_tokens != 1 for s in scheduled):
            return self._stage_checks(scheduled, last_rows, block_tables)
        n = len(scheduled)
        b = next(x for x in self.buckets if x >= n)
        bs = self.block_size
        stage = self._next_stage()
        reqs = list(map(_REQUEST, scheduled))
        pos = np.fromiter(map(_START, scheduled), dtype=np.int64, count=n)
        fed = np.fromiter(map(_PENDING, scheduled), dtype=bool, count=n)
        k = int(fed.sum())
        if k == n:  # overlapped decode: every input is the token in flight
            stage.tokens[:n] = 0
            stage.feed_dst[:n] = self.row_ids[:n]
            stage.feed_src[:n] = list(map(last_rows.__getitem__, map(_RID, reqs)))
        else:
            stage.tokens[:n] = [0 if f else r.all_token_ids[p] for r, p, f in zip(reqs, pos.tolist(), fed.tolist())]
            if k:
                dst = np.flatnonzero(fed)
                stage.feed_dst[:k] = dst
                stage.feed_src[:k] = [last_rows[reqs[i].request_id] for i in dst.tolist()]
        stage.pos[:n] = pos
        stage.seq_lens[:n] = pos + 1
        # The rows' tables as far as this step reads them (a row's blocks past its position are not
        # read, so what the stage held there before may stay).
        width = min(int(pos.max()) // bs + 1, stage.tables.shape[1]) if n else 0
        tables = stage.tables
        rows = block_tables.rows(reqs) if block_tables is not None else None
        if rows is not None and (n == 0 or rows.min() >= 0) and width <= block_tables.ids.shape[1]:
            tables[:n, :width] = block_tables.ids[rows, :width]
        else:
            for i, r in enumerate(reqs):
                tables[i, :len(r.block_ids)] = r.block_ids
        stage.slots[:n] = tables[self.row_ids[:n], pos // bs] * bs + pos % bs
        return GraphStep(stage, n, b, k)

    def _stage_checks(self, scheduled, last_rows, block_tables) -> GraphStep:
        """A step in which some request checks a draft of k tokens (speculation, jump-forward): each of
        its k + 1 tokens is a row of its own, as if a request of its own whose context ends at that
        token, with the request's block table. Every layer writes the step's KV before it attends,
        so row j sees the draft up to j: causal attention over the draft, by the decode kernel. A
        draft check then costs a decode step of k + 1 rows (one read of the weights) in the decode
        graphs, not a mixed step (whose extend kernel gives one short query one program per head and
        reads the whole context serially: an 8B check of 5 tokens cost 1.43 x a decode step)."""
        counts = np.fromiter(map(_NUM_NEW, scheduled), dtype=np.int64, count=len(scheduled))
        first = np.cumsum(counts) - counts  # each request's first row
        n = int(counts.sum())
        b = next(x for x in self.buckets if x >= n)
        bs = self.block_size
        stage = self._next_stage()
        reqs = list(map(_REQUEST, scheduled))
        pos = np.repeat(np.fromiter(map(_START, scheduled), dtype=np.int64, count=len(reqs)) - first, counts) \
            + self.row_ids[:n]
        stage.tokens[:n] = list(chain.from_iterable(
            (0, *r.all_token_ids[s.start + 1:s.start + s.num_new_tokens]) if s.pending_input
            else r.all_token_ids[s.start:s.start + s.num_new_tokens] for s, r in zip(scheduled, reqs)))
        fed = [i for i, s in enumerate(scheduled) if s.pending_input]
        k = len(fed)
        if k:
            stage.feed_dst[:k] = first[fed]
            stage.feed_src[:k] = [last_rows[reqs[i].request_id] for i in fed]
        stage.pos[:n] = pos
        stage.seq_lens[:n] = pos + 1
        width = min(int(pos.max()) // bs + 1, stage.tables.shape[1])
        rows = block_tables.rows(reqs) if block_tables is not None else None
        if rows is not None and rows.min() >= 0 and width <= block_tables.ids.shape[1]:
            stage.tables[:n, :width] = block_tables.ids[np.repeat(rows, counts), :width]
        else:
            for i, (r, c) in enumerate(zip(reqs, counts.tolist())):
                stage.tables[first[i]:first[i] + c, :len(r.block_ids)] = r.block_ids
        stage.slots[:n] = stage.tables[self.row_ids[:n], pos // bs] * bs + pos % bs
        return GraphStep(stage, n, b, k)

    def launch(self, step: GraphStep, last_ids: torch.Tensor | None = None):
        stage, n, b, k = step.stage, step.n, step.bucket, step.num_fed
        stage.slots[n:b] = -1
        stage.seq_lens[n:b] = 1
        self.dev.copy_(stage.host, non_blocking=True)
        if k:
            self.d_tokens.index_copy_(0, self.d_feed_dst[:k], last_ids.index_select(0, self.d_feed_src[:k]))
        self.graphs[b].replay()
        self.model.aux_hidden = self.aux[b]
        return self.outputs[b][:n], _Indices(self.rows[:n])

    # -- the same step on the other ranks of a parallel group ----------------------------------
    def message(self, step: GraphStep, width: int) -> tuple[list[int], np.ndarray]:
        """The staged rows as one int64 array (tables cut to the `width` blocks in use)."""
        s, n, k = step.stage, step.n, step.num_fed
        parts = (s.tokens[:n], s.pos[:n], s.slots[:n], s.feed_dst[:k], s.feed_src[:k],
                 s.seq_lens[:n], s.tables[:n, :width].reshape(-1))
        return [n, step.bucket, k, width], np.concatenate([p.astype(np.int64, copy=False) for p in parts])

    def from_message(self, fields, payload: np.ndarray) -> GraphStep:
        n, b, k, width = (int(x) for x in fields[:4])
        stage = self._next_stage()
        offs = np.cumsum((0, n, n, n, k, k, n, n * width))
        stage.tokens[:n], stage.pos[:n], stage.slots[:n] = (payload[offs[i]:offs[i + 1]] for i in range(3))
        stage.feed_dst[:k], stage.feed_src[:k] = payload[offs[3]:offs[4]], payload[offs[4]:offs[5]]
        stage.seq_lens[:n] = payload[offs[5]:offs[6]]
        stage.tables[:n, :width] = payload[offs[6]:offs[7]].reshape(n, width)
        return GraphStep(stage, n, b, k)


@dataclass(slots=True)
class GraphStep:
    """A decode step staged for replay: `n` rows padded to bucket `bucket`, `num_fed` of them
    fed from the previous step's draw on the device."""

    stage: _HostStage
    n: int
    bucket: int
    num_fed: int


class _EagerReplay:
    """The CPU's stand-in for a captured graph: replay runs the forward again on the static
    buffers into the same output tensor. It lets the CPU tests drive every line of the static
    input path (staging, row tables, fed-back tokens, padding rows) that the GPU replays."""

    def __init__(self, forward, bucket: int, out: torch.Tensor):
        self.forward, self.bucket, self.out = forward, bucket, out

    def replay(self) -> None:
        self.out.copy_(self.forward(self.bucket))


class _Indices:
    """Quacks like StepInputs for the runner: every graph row samples."""

    __slots__ = ("logits_indices",)

    def __init__(self, rows: torch.Tensor):
        self.logits_indices = rows
