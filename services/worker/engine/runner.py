"""Runs one planned step on the device: inputs in, model forward, logits, sampled tokens out."""

from __future__ import annotations

import torch

from services.worker.engine.kv_cache import KVCache
from services.worker.engine.model import DecoderLM
from services.worker.engine.sampler import PendingSample, Sampler
from services.worker.engine.step_inputs import build_step_inputs


class ModelRunner:
    def __init__(self, model: DecoderLM, kv_cache: KVCache, sampler: Sampler, device: torch.device):
        self.model = model
        self.kv_cache = kv_cache
        self.sampler = sampler
        self.device = device
        self.graphs = None  # a CudaGraphRunner, set by the GPU path for decode-only steps
        # The last launched step's sampled ids (on the device) and the requests of its rows: an
        # overlapped step takes its inputs from there before the host has seen them.
        self._last_ids: torch.Tensor | None = None
        self._last_sampling: list = []

    @torch.inference_mode()
    def execute(self, scheduled) -> PendingSample | None:
        """Launch one step; returns its draw still in flight (None when no request samples)."""
        graphs = self.graphs
        decode_only = all(s.num_new_tokens == 1 for s in scheduled)
        last_rows = ({r.request_id: row for row, r in enumerate(self._last_sampling)}
                     if any(s.pending_input for s in scheduled) else None)
        if graphs is not None and decode_only and graphs.covers(scheduled):
            hidden, inputs = graphs.run(scheduled, self._last_ids, last_rows)
        else:
            inputs = build_step_inputs(scheduled, self.kv_cache.block_size, self.device,
                                       self.device.type == "cuda", last_rows)
            if inputs.feed_dst is not None:
                inputs.input_ids.index_copy_(0, inputs.feed_dst, self._last_ids.index_select(0, inputs.feed_src))
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache.layers, inputs.meta)
        sampling = [s.request for s in scheduled if s.samples]
        if not sampling:
            return None
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        pending = self.sampler(logits, sampling)
        self._last_ids, self._last_sampling = pending.token_ids, sampling
        return pending
