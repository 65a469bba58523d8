"""Runs one planned step on the device: inputs in, model forward, logits, sampled tokens out."""

from __future__ import annotations

import torch

from services.worker.engine.kv_cache import KVCache
from services.worker.engine.model import DecoderLM
from services.worker.engine.sampler import SampleResult, Sampler
from services.worker.engine.step_inputs import build_step_inputs


class ModelRunner:
    def __init__(self, model: DecoderLM, kv_cache: KVCache, sampler: Sampler, device: torch.device):
        self.model = model
        self.kv_cache = kv_cache
        self.sampler = sampler
        self.device = device
        self.graphs = None  # a CudaGraphRunner, set by the GPU path for decode-only steps

    @torch.inference_mode()
    def execute(self, scheduled) -> SampleResult | None:
        graphs = self.graphs
        decode_only = all(s.num_new_tokens == 1 for s in scheduled)
        if graphs is not None and decode_only and graphs.covers(scheduled):
            hidden, inputs = graphs.run(scheduled)
        else:
            inputs = build_step_inputs(scheduled, self.kv_cache.block_size, self.device,
                                       pin=self.device.type == "cuda")
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache.layers, inputs.meta)
        sampling = [s.request for s in scheduled if s.samples]
        if not sampling:
            return None
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        return self.sampler(logits, sampling)
