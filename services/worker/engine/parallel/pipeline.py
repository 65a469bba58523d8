"""One pipeline stage: its slice of the layers between a receive from the stage before and a
send to the stage after. The first stage embeds the ids; the last applies the final norm."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from services.worker.engine.model import DecoderLM
from services.worker.engine.parallel.layout import ParallelLayout


class PipelineStage(nn.Module):
    """Called like the model; returns the final hidden states on the last stage, None elsewhere.
    Activations go rank to rank (tensor rank i of stage s to tensor rank i of stage s + 1) as
    one [2, T, hidden] tensor: the layer output and the residual stream, so every stage computes
    exactly what one process would."""

    def __init__(self, model: DecoderLM, layout: ParallelLayout, group=None):
        super().__init__()
        self.model = model
        self.layout = layout
        self.group = group
        self.hidden_size = model.cfg.hidden_size

    @property
    def ops(self):
        return self.model.ops

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    def forward(self, input_ids, positions, kv_caches, meta):
        model, layout = self.model, self.layout
        if layout.is_first_stage:
            h, residual = model.embed_tokens(input_ids), None
        else:
            carried = torch.empty((2, input_ids.shape[0], self.hidden_size),
                                  dtype=model.norm.dtype, device=input_ids.device)
            dist.recv(carried, layout.peer(layout.stage - 1), group=self.group)
            h, residual = carried[0], carried[1]
        for layer, kv_cache in zip(model.layers, kv_caches):
            h, residual = layer(h, residual, positions, model.cos_sin, kv_cache, meta, model.ops)
        if layout.is_last_stage:
            h, _ = model.ops.add_rmsnorm(h, residual, model.norm, model.cfg.rms_norm_eps)
            return h
        dist.send(torch.stack((h, residual)), layout.peer(layout.stage + 1), group=self.group)
        return None
