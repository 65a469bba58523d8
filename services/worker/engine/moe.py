"""The mixture-of-experts MLP: router, the experts' stacked weights, an optional shared expert."""

from __future__ import annotations

import torch
from torch import nn

from services.worker.engine.layers import MLP, Linear
from services.worker.engine.model_config import ModelConfig
from services.worker.engine.ops import TorchOps
from services.worker.kernels.fp8_linear import quantize_weight


class MoE(nn.Module):
    """Takes a decoder layer's place of MLP. Each expert is a SiLU-gated MLP; their weights are
    stacked, w13 [E, 2I, H] (rows [gate | up] per expert, as the dense MLP's gate_up_proj) and
    w2 [E, H, I], so one grouped GEMM serves every expert (ops.fused_moe).

    Parallelism wraps it from outside by the shape it is built with (ParallelLayout.local_config):
    tensor parallelism gives each rank every expert's slice of I; expert parallelism gives each
    rank whole experts [first_expert, first_expert + E_local). Either way a rank's output is a
    partial sum that the next add_rmsnorm all-reduces, as after a dense down_proj. The router is
    replicated: every rank routes every token the same way."""

    def __init__(self, cfg: ModelConfig, ops: TorchOps):
        super().__init__()
        moe = cfg.moe
        h, inter = cfg.hidden_size, moe.intermediate_size
        self.moe = moe
        self.top_k, self.renormalize = moe.top_k, moe.renormalize
        self.first_expert = moe.first_expert
        self.gate = Linear(h, moe.num_experts, ops)
        # DeepSeek's shared experts (no gate, each token's at weight 1) join the stacked experts after
        # loading (fuse_shared_experts) as n_fused more, each token routed to them too: one grouped
        # launch does both, where the shared MLP took three more a layer (two GEMVs and the add).
        shared = moe.shared_intermediate_size
        self.n_fused = shared // inter if shared and not moe.shared_gate and shared % inter == 0 else 0
        self.w13 = nn.Parameter(torch.empty(moe.held_experts + self.n_fused, 2 * inter, h))
        self.w2 = nn.Parameter(torch.empty(moe.held_experts + self.n_fused, h, inter))
        self.fused_ids = (0, 0)  # (first id, n) of the fused shared experts, once fused: the router adds them
        self.w13_scale = self.w2_scale = None  # fp32 [E, rows] once quantize_fp8() made the experts e4m3
        self.shared_expert = MLP(cfg, ops, moe.shared_intermediate_size) if moe.shared_intermediate_size else None
        self.shared_expert_gate = Linear(h, 1, ops) if moe.shared_intermediate_size and moe.shared_gate else None
        # DeepSeek's routers (scoring, groups, scaling) and V3's score correction bias (fp32, as trained).
        self.grouped = moe.scoring != "softmax" or moe.n_group > 1 or moe.routed_scaling_factor != 1.0
        self.score_bias = nn.Parameter(torch.empty(moe.num_experts, dtype=torch.float32)) if moe.score_bias else None
        # Tokens routed to each expert (all of them, from the replicated router) since the start:
        # the load statistics of /metrics. Counted on the device, read when metrics are scraped.
        self.register_buffer("routed", torch.zeros(moe.num_experts, dtype=torch.int64), persistent=False)

    def fuse_shared_experts(self) -> None:
        """Once loaded: the shared MLP's [gate | up] rows and down columns, cut into n_fused experts of
        the routed experts' width, copied into the stacked weights' last slots; the MLP goes."""
        if not self.n_fused or self.shared_expert is None:
            return
        n, inter, h = self.n_fused, self.w2.shape[-1], self.w2.shape[1]
        gate_up = self.shared_expert.gate_up_proj.weight.data.view(2, n, inter, h)  # [gate | up] × n × I rows
        held = self.w13.shape[0] - n
        self.w13.data[held:].copy_(gate_up.transpose(0, 1).reshape(n, 2 * inter, h))
        self.w2.data[held:].copy_(self.shared_expert.down_proj.weight.data.view(h, n, inter).transpose(0, 1))
        self.shared_expert = None
        self.fused_ids = (self.first_expert + held, n)

    def quantize_fp8(self) -> None:
        """The experts' weights in e4m3 with a scale per output row of each expert; the router stays."""
        if self.w13_scale is not None:
            return
        for name in ("w13", "w2"):
            w = getattr(self, name).data
            q, scale = quantize_weight(w.reshape(-1, w.shape[-1]))
            setattr(self, name, nn.Parameter(q.view(w.shape), requires_grad=False))
            setattr(self, name + "_scale", scale.view(w.shape[0], w.shape[1]))
        if self.shared_expert is not None:
            self.shared_expert.gate_up_proj.quantize_fp8()
            self.shared_expert.down_proj.quantize_fp8()

    def forward(self, h, residual, norm, eps, ops: TorchOps):
        x, residual = ops.add_rmsnorm(h, residual, norm, eps)
        if self.grouped or self.fused_ids[1]:  # (the grouped rule is the plain one without groups or scaling)
            weights, ids = ops.group_route(self.gate(x), self.moe, self.score_bias, self.routed, self.fused_ids)
        else:
            weights, ids = ops.route(self.gate(x), self.top_k, self.renormalize, self.routed)
        if self.moe.scale_inputs:
            out = self._experts_of_scaled_inputs(x, weights, ids, ops)
        else:
            out = ops.fused_moe(x, self.w13, self.w2, weights, ids, self.first_expert, self.w13_scale, self.w2_scale)
        if self.shared_expert is not None:
            shared = self.shared_expert.down_proj(self.shared_expert.gate_up_proj(x))
            gate = self.shared_expert_gate
            out = out + (shared if gate is None else torch.sigmoid(gate(x)) * shared)
        return out, residual

    def _experts_of_scaled_inputs(self, x, weights, ids, ops: TorchOps):
        """Llama 4 (transformers' Llama4TextMoe): each chosen expert sees the token times its router
        weight (rounded to x's dtype first, as there) and its output is summed unweighted. A SiLU-gated
        expert is not linear, f(w·x) ≠ w·f(x), so the weight cannot ride on the output as fused_moe
        applies it: each (token, choice) becomes a row of its own with weight 1 (top-1, Llama 4's
        choice: x itself, scaled). A shared expert fused into the stacked ones comes at weight 1: x as it is."""
        t, k = ids.shape
        rows = (x[:, None, :] * weights.to(x.dtype)[:, :, None]).reshape(t * k, x.shape[-1])
        ones = torch.ones((t * k, 1), dtype=weights.dtype, device=weights.device)
        out = ops.fused_moe(rows, self.w13, self.w2, ones, ids.reshape(t * k, 1), self.first_expert,
                            self.w13_scale, self.w2_scale)
        return out if k == 1 else out.view(t, k, -1).sum(dim=1)
