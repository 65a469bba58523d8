"""The model's building blocks that hold weights: projections, embeddings and the dense MLP."""

from __future__ import annotations

import torch
from torch import nn

from services.worker.engine.model_config import ModelConfig
from services.worker.engine.ops import TorchOps
from services.worker.kernels.fp8_linear import quantize_weight


class Linear(nn.Module):
    """y = x Wᵀ (+ b) through the ops (a GEMV kernel at decode sizes), with uninitialised
    parameters: the loader fills them. (nn.Linear and nn.Embedding initialise at construction,
    which on the meta device pulls in torch._dynamo: seconds of start-up for nothing.) The ops
    come at construction, not in forward(x): hooks on the module (tensor parallelism's
    all-reduce) see a plain call."""

    def __init__(self, in_features: int, out_features: int, ops: TorchOps, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.weight_scale = None  # fp32 [out] once quantize_fp8() made the weight e4m3
        self.ops = ops

    def quantize_fp8(self) -> None:
        """The weight in e4m3 with one scale per output channel (`--quantization fp8`)."""
        if self.weight_scale is not None:
            return
        q, scale = quantize_weight(self.weight.data)
        self.weight = nn.Parameter(q, requires_grad=False)
        self.weight_scale = scale

    def forward(self, x):
        if self.weight_scale is not None:
            return self.ops.linear_fp8(x, self.weight, self.weight_scale, self.bias)
        return self.ops.linear(x, self.weight, self.bias)


class SiluMulLinear(Linear):
    """The down projection, fed the gate/up projection's [gate | up] output: linear(silu(gate) *
    up), which the ops may fuse into one kernel."""

    def forward(self, x):
        if self.weight_scale is not None:
            return self.ops.linear_fp8(x, self.weight, self.weight_scale, self.bias, silu_mul=True)
        return self.ops.silu_mul_linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim))

    def forward(self, ids):
        return nn.functional.embedding(ids, self.weight)


class MLP(nn.Module):
    """The post-attention norm, gate_up_proj's [gate | up] of its output, then down_proj."""

    def __init__(self, cfg: ModelConfig, ops: TorchOps, intermediate_size: int | None = None):
        super().__init__()
        inter = intermediate_size or cfg.intermediate_size
        # gate and up in one GEMM: rows [gate | up].
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * inter, ops)
        self.down_proj = SiluMulLinear(inter, cfg.hidden_size, ops)

    def forward(self, h, residual, norm, eps, ops: TorchOps):
        # The norm with the projection that reads it: one kernel where the ops fuse them (decode).
        gate_up, residual = ops.add_rmsnorm_linear(h, residual, norm, eps, self.gate_up_proj)
        return self.down_proj(gate_up), residual
