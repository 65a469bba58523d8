"""Runs one planned step on the device: inputs in, model forward, logits, sampled tokens out.

In a parallel group the driver's runner also sends each step's host inputs to the other ranks,
whose runners `follow` it: the same upload, the same forward (collectives inside), no draw.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from operator import attrgetter

import torch

from services.worker.engine.cuda_graphs import GraphStep
from services.worker.engine.kv_cache import KVCache
from services.worker.engine.model import DecoderLM
from services.worker.engine.sampler import PendingSample, Sampler
from services.worker.engine.step_inputs import NUM_FIELDS, HostStep, align_up, pack_step_inputs, upload_step_inputs
from services.worker.kernels.gemv import DISPATCH_MAX_ROWS

_NUM_NEW = attrgetter("num_new_tokens")
_PENDING = attrgetter("pending_input")
_RID = attrgetter("request_id")


@dataclass(slots=True)
class DeferredDraw:
    """A launched step's logits whose draw waits for its grammars' matchers (ModelRunner.draw)."""

    logits: torch.Tensor
    sampling: list
    plain: bool
    constrained: bool
    logits_ready: object = None  # a timing CUDA event after the logits (the grammar's wait), or None
    draft_rows: list | None = None  # BatchPlan.draft_rows


def logits_rows(m: int) -> int:
    """Rows the LM head computes for m sampled rows: m itself while the GEMV takes them (it has no
    shape to plan), then a power of two up to 64, then a multiple of 64 (at most 63 padded rows,
    ~6 % at a thousand)."""
    if m <= DISPATCH_MAX_ROWS:
        return m
    if m <= 64:
        return 1 << (m - 1).bit_length()
    return align_up(m, 64)


class ModelRunner:
    def __init__(self, model: DecoderLM, kv_cache: KVCache, sampler: Sampler, device: torch.device,
                 group=None):
        self.model = model
        self.kv_cache = kv_cache
        self.sampler = sampler
        self.device = device
        self.block_tables = None  # the block manager's BlockTables, set by the engine
        self.graphs = None  # a CudaGraphRunner, set by the GPU path for decode-only steps
        self.mixed_graphs = None  # a MixedGraphRunner, for steps with prefill chunks up to its tokens
        self.group = group  # a RankGroup when the model is split over several processes
        self.share_ids = False  # overlapped steps in a group: the driver sends its draw to the ranks
        # The last launched step's sampled ids (on the device) and the requests of its rows: an
        # overlapped step takes its inputs from there before the host has seen them.
        self._last_ids: torch.Tensor | None = None
        self._last_sampling: list = []
        # An eager step launched behind another eager step in flight (a prompt step of thousands of
        # tokens, ~400 launches, 170 ms on an H100 for the 8B shape) filled the driver's launch queue,
        # and the step thread spun in cudaLaunchKernel until the first step drained: W2's prompt phase
        # spent ~0.5 s of CPU there (py-spy, H100, 2026-11-28). It now sleeps on the first step's
        # blocking event instead, then launches: the GPU waits only for the first kernel (tens of µs),
        # since the launches outrun the kernels. INFERNO_EAGER_WAIT=0 turns it off (A/B runs). Not in a
        # parallel group: a pipeline's micro-batches are meant to be in flight together.
        self.wait_before_eager = group is None and os.environ.get("INFERNO_EAGER_WAIT", "1") != "0"
        self._eager_done: torch.cuda.Event | None = None  # after the last eager forward's kernels

    @torch.inference_mode()
    def execute(self, scheduled, sampling: list | None = None, plain: bool = False, constrained: bool = False,
                defer: bool = False, draft_rows: list | None = None) -> PendingSample | DeferredDraw | None:
        """Launch one step; returns its draw still in flight (None when no request samples).
        `sampling`: the requests of the rows that sample (BatchPlan.sampling); `plain`: every one
        is greedy with nothing else to do (the draw is one argmax); `constrained`: some hold a
        grammar's matcher. `defer`: launch the forward only and return its logits, for draw() once
        the matchers have taken the tokens of the step still in flight. `draft_rows`: the draw's
        rows when some request checks a jump-forward draft (BatchPlan.draft_rows)."""
        graphs = self.graphs
        tokens = sum(map(_NUM_NEW, scheduled))
        decode_only = tokens == len(scheduled)
        # A step of decodes and draft checks only (every token is drawn after) runs in the decode
        # graphs too, a row per token (CudaGraphRunner._stage_checks).
        checks = (not decode_only and draft_rows is not None and len(draft_rows) == tokens
                  and all(s.samples and s.num_logits == s.num_new_tokens for s in scheduled))
        last_rows = (dict(zip(map(_RID, self._last_sampling), range(len(self._last_sampling))))
                     if any(map(_PENDING, scheduled)) else None)
        if graphs is not None and (decode_only or checks) and graphs.covers(scheduled, tokens if checks else None):
            step = graphs.stage(scheduled, last_rows, self.block_tables)
        else:
            step = pack_step_inputs(scheduled, self.kv_cache.block_size, last_rows, self.block_tables,
                                    draft_rows is not None)
        if sampling is None:
            sampling = [s.request for s in scheduled if s.samples]
        if self.group is not None:
            self._send(step, scheduled, len(draft_rows) if draft_rows is not None else len(sampling))  # rows drawn
        hidden, rows = self._forward(step)
        if not sampling:
            return None
        logits = self._logits(hidden, rows)
        ready = None
        if constrained and self.sampler.grammar_timing and logits.is_cuda:
            ready = torch.cuda.Event(enable_timing=True)
            ready.record()
        draw = DeferredDraw(logits, sampling, plain, constrained, ready, draft_rows)
        return draw if defer else self.draw(draw)

    @torch.inference_mode()
    def draw(self, d: DeferredDraw) -> PendingSample:
        """The step's tokens, queued on the device after its logits."""
        pending = self.sampler(d.logits, d.sampling, d.plain, d.constrained, d.logits_ready, d.draft_rows)
        if self.share_ids:
            self.group.broadcast_ids(pending.token_ids)
        rows = d.sampling if d.draft_rows is None else [r for r, _ in d.draft_rows]
        self._last_ids, self._last_sampling = pending.token_ids, rows
        return pending

    def _logits(self, hidden: torch.Tensor, rows) -> torch.Tensor:
        """The LM head over the sampled rows, padded to a few row counts: its output is the
        step's largest tensor ([rows, vocab]), and a new row count every step (a batch that grows
        or shrinks by one) made the allocator map fresh memory and cuBLAS plan a fresh shape on
        the step thread, ~10 ms a step until every count had been seen once (W2 on a new worker)."""
        h = hidden[rows]
        m = h.shape[0]
        b = logits_rows(m)
        if b != m:
            h = torch.nn.functional.pad(h, (0, 0, 0, b - m))
        return self.model.compute_logits(h)[:m]

    @torch.inference_mode()
    def warm_logits(self, max_rows: int) -> int:
        """Run the LM head once at every row count _logits pads to, largest first; returns how many.
        The first step at each count otherwise pays for it on the step thread (a cuBLAS plan, fresh
        memory): W2 on a new worker spent 19 % of its step thread inside the head's GEMM, against
        2 % on a warm one (H100, 2026-11-24). Largest first: the smaller outputs fit its freed block.
        The GEMV's counts (up to DISPATCH_MAX_ROWS) too: the head runs outside the decode graphs, so
        no capture compiles its variants, and W2 on a new worker compiled two of them mid-run (0.9 s
        of the step thread, 4.5 µs of CPU per token, a 0.5 s stall; H100, 2026-11-27)."""
        counts = sorted({logits_rows(m) for m in range(1, max_rows + 1)}, reverse=True)
        if not counts or self.group is not None:  # in a group the head is a collective: the ranks go together
            return 0
        hidden = torch.zeros(counts[0], self.model.cfg.hidden_size, dtype=self.model.norm.dtype, device=self.device)
        for m in counts:
            self.model.compute_logits(hidden[:m])
        return len(counts)

    def _forward(self, step: GraphStep | HostStep):
        """The model on this rank: (hidden states, the rows to sample); hidden is None on a
        pipeline stage before the last."""
        if isinstance(step, GraphStep):
            hidden, rows = self.graphs.launch(step, self._last_ids)
            return hidden, rows.logits_indices
        mixed = self.mixed_graphs
        if mixed is not None and mixed.covers(step):
            return mixed.launch(step, self._last_ids)
        inputs = upload_step_inputs(step, self.device, self.device.type == "cuda")
        if inputs.feed_dst is not None:
            inputs.input_ids.index_copy_(0, inputs.feed_dst, self._last_ids.index_select(0, inputs.feed_src))
        wait = self.wait_before_eager and self.device.type == "cuda"
        if wait and self._eager_done is not None:
            self._eager_done.synchronize()  # a blocking event: the thread sleeps
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache.layers, inputs.meta)
        if wait:
            self._eager_done = torch.cuda.Event(blocking=True)
            self._eager_done.record()
        return hidden, inputs.logits_indices

    # -- parallel groups ---------------------------------------------------------------------
    def _send(self, step, scheduled, num_logits: int) -> None:
        from services.worker.engine.parallel.step_channel import KIND_EAGER, KIND_GRAPH, OP_STEP, StepMessage
        if isinstance(step, GraphStep):
            width = max(len(s.request.block_ids) for s in scheduled)
            fields, payload = self.graphs.message(step, width)
            message = StepMessage(OP_STEP, KIND_GRAPH, num_logits, self.share_ids, tuple(fields), payload)
        else:
            message = StepMessage(OP_STEP, KIND_EAGER, num_logits, self.share_ids, tuple(step.fields()), step.flat)
        self.group.channel.send(message)

    @torch.inference_mode()
    def follow(self, message) -> None:
        """A non-driver rank's step: the driver's inputs, this rank's share of the model, its part
        in the logits gather, and the driver's draw when the next step feeds it back."""
        from services.worker.engine.parallel.step_channel import KIND_GRAPH
        if message.kind == KIND_GRAPH:
            step = self.graphs.from_message(message.fields, message.payload)
        else:
            step = HostStep.from_fields(message.fields[:NUM_FIELDS], message.payload)
        hidden, rows = self._forward(step)
        n = message.num_logits
        if n and hidden is not None:
            self._logits(hidden, rows)
        if message.share_ids and n:
            ids = torch.empty(n, dtype=torch.int64, device=self.device)
            self._last_ids = self.group.broadcast_ids(ids)
