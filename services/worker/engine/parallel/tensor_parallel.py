"""Tensor parallelism from outside the model (Megatron's split, as gpt-fast applies it): which
slice of each checkpoint tensor a rank loads, and the collectives hooked onto the plain modules.

q/k/v and gate/up are split by output rows (each rank's heads and MLP columns; MLA: mla_weights.py;
Llama 4's feed-forward: llama4_weights.py), o_proj and down_proj by input columns, so each layer needs
one all-reduce after attention and one after the MLP; the embedding and the LM head are split by
vocabulary rows. Norms are replicated.
"""

from __future__ import annotations

import structlog
import torch
import torch.distributed as dist
from torch import nn

from services.worker.engine.llama4_weights import llama4_feed_forward
from services.worker.engine.placement import Placement, ShardedTensor, Slice
from services.worker.engine.model import DecoderLM
from services.worker.engine.model_config import ModelConfig
from services.worker.engine.mla_weights import mla_tensors
from services.worker.engine.moe_weights import expert_tensors
from services.worker.engine.parallel.layout import ParallelLayout

log = structlog.get_logger("worker.parallel")


def sharded_tensors(cfg: ModelConfig, layout: ParallelLayout) -> dict[str, ShardedTensor]:
    """Checkpoint tensor name → what this rank loads of it. Tensors of other stages' layers are
    absent; every stage keeps the embedding, final norm and head (small next to the layers, and
    the head of a tied model is the embedding)."""
    local = layout.local_config(cfg)
    h, hd, tp_rank = cfg.hidden_size, cfg.head_dim, layout.tp_rank
    q, kv, inter = local.q_size, local.kv_size, local.intermediate_size
    q0, kv0, i0 = tp_rank * q, layout.kv_head_start(cfg) * hd, tp_rank * inter
    vocab0 = tp_rank * local.vocab_size
    vocab_len = max(0, min(local.vocab_size, cfg.vocab_size - vocab0))

    def rows(start: int, length: int) -> Slice | None:
        return None if layout.tp == 1 else Slice(0, start, length)

    def cols(start: int, length: int) -> Slice | None:
        return None if layout.tp == 1 else Slice(1, start, length)

    out = {
        "model.embed_tokens.weight": ShardedTensor(
            (cfg.vocab_size, h), Placement("embed_tokens.weight", 0, (vocab_len, h)), rows(vocab0, vocab_len)),
        "model.norm.weight": ShardedTensor((h,), Placement("norm", 0, (h,))),
    }
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = ShardedTensor(
            (cfg.vocab_size, h), Placement("lm_head", 0, (vocab_len, h)), rows(vocab0, vocab_len))
    lo, hi = layout.layer_range(cfg.num_hidden_layers)
    for i in range(lo, hi):
        src, dst = f"model.layers.{i}.", f"layers.{i - lo}."
        attn = dst + "self_attn."
        qkv = attn + "qkv_proj."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[src + norm + ".weight"] = ShardedTensor((h,), Placement(dst + norm, 0, (h,)))
        if cfg.llama4 is not None:
            out.update(llama4_feed_forward(cfg, local, i, i - lo, tp_rank))
        elif cfg.is_sparse(i):
            out.update(expert_tensors(cfg, local, i, i - lo, tp_rank))
        else:
            gate_up = dst + "mlp.gate_up_proj.weight"
            out[src + "mlp.gate_proj.weight"] = ShardedTensor(
                (cfg.intermediate_size, h), Placement(gate_up, 0, (inter, h)), rows(i0, inter))
            out[src + "mlp.up_proj.weight"] = ShardedTensor(
                (cfg.intermediate_size, h), Placement(gate_up, inter, (inter, h)), rows(i0, inter))
            out[src + "mlp.down_proj.weight"] = ShardedTensor(
                (h, cfg.intermediate_size), Placement(dst + "mlp.down_proj.weight", 0, (h, inter)), cols(i0, inter))
        if cfg.mla is not None:
            out.update(mla_tensors(cfg, local, src + "self_attn.", attn, tp_rank))
            continue
        out[src + "self_attn.q_proj.weight"] = ShardedTensor(
            (cfg.q_size, h), Placement(qkv + "weight", 0, (q, h)), rows(q0, q))
        out[src + "self_attn.k_proj.weight"] = ShardedTensor(
            (cfg.kv_size, h), Placement(qkv + "weight", q, (kv, h)), rows(kv0, kv))
        out[src + "self_attn.v_proj.weight"] = ShardedTensor(
            (cfg.kv_size, h), Placement(qkv + "weight", q + kv, (kv, h)), rows(kv0, kv))
        if cfg.attention_bias:
            out[src + "self_attn.q_proj.bias"] = ShardedTensor(
                (cfg.q_size,), Placement(qkv + "bias", 0, (q,)), rows(q0, q))
            out[src + "self_attn.k_proj.bias"] = ShardedTensor(
                (cfg.kv_size,), Placement(qkv + "bias", q, (kv,)), rows(kv0, kv))
            out[src + "self_attn.v_proj.bias"] = ShardedTensor(
                (cfg.kv_size,), Placement(qkv + "bias", q + kv, (kv,)), rows(kv0, kv))
        if cfg.qk_norm_whole:  # OLMoE: the norms' weights span all heads, so each rank takes its heads'
            out[src + "self_attn.q_norm.weight"] = ShardedTensor((cfg.q_size,), Placement(attn + "q_norm", 0, (q,)),
                                                                 rows(q0, q))
            out[src + "self_attn.k_norm.weight"] = ShardedTensor((cfg.kv_size,),
                                                                 Placement(attn + "k_norm", 0, (kv,)), rows(kv0, kv))
        elif cfg.qk_norm:
            out[src + "self_attn.q_norm.weight"] = ShardedTensor((hd,), Placement(attn + "q_norm", 0, (hd,)))
            out[src + "self_attn.k_norm.weight"] = ShardedTensor((hd,), Placement(attn + "k_norm", 0, (hd,)))
        out[src + "self_attn.o_proj.weight"] = ShardedTensor(
            (h, cfg.q_size), Placement(attn + "o_proj.weight", 0, (h, q)), cols(q0, q))
    return out


class TensorGroup:
    """The collectives of one stage's tensor-parallel ranks. On GPUs, all-reduces small enough go
    through the one-shot kernel over peer memory (custom_all_reduce.py), set up here when every
    rank can map the others' memory; larger ones, and everything on the CPU, through the group's
    backend (`peer_all_reduce` False: always the backend)."""

    def __init__(self, group, size: int, peer_all_reduce: bool = True, host_group=None, fuse_norm: bool = False):
        """host_group: a gloo group of the same ranks, for the setup's small host messages.
        fuse_norm: the one-shot all-reduce does the decoder's residual add and RMSNorm too."""
        self.group = group
        self.size = size
        self.peer = _setup_peer_all_reduce(group, size, peer_all_reduce, host_group)
        self.fuse_norm = fuse_norm

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.peer is not None and self.peer.serves(x):
            return self.peer.all_reduce(x)
        dist.all_reduce(x, group=self.group)
        return x

    def all_reduce_add_rmsnorm(self, x, residual, weight, eps, ops):
        """ops.add_rmsnorm of the group's sum of x: one kernel where the one-shot all-reduce serves
        it and fuse_norm is on, else the all-reduce and then ops' add_rmsnorm."""
        if self.fuse_norm and self.peer is not None and self.peer.serves_add_rmsnorm(x, residual, weight):
            return self.peer.all_reduce_add_rmsnorm(x, residual, weight, eps)
        return ops.add_rmsnorm(self.all_reduce(x), residual, weight, eps)

    def all_gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """[S, n] on each rank → [S, size × n], rank-major columns."""
        out = torch.empty((self.size * x.shape[0], x.shape[1]), dtype=x.dtype, device=x.device)
        _all_gather_single(out, x.contiguous(), group=self.group)
        return out.view(self.size, x.shape[0], x.shape[1]).transpose(0, 1).reshape(x.shape[0], -1)


def _setup_peer_all_reduce(group, size: int, wanted: bool, host_group=None):
    """Collective over the group (every rank builds its TensorGroup at the same point); None on
    the CPU, for one rank, or when any rank cannot or will not take part."""
    if size < 2 or group is None or dist.get_backend(group) != "nccl":
        return None
    try:
        from services.worker.engine.parallel.custom_all_reduce import CustomAllReduce, PeerMemoryUnavailable
    except ImportError as e:  # no Triton
        log.warning("one-shot all-reduce unavailable", error=str(e))
        wanted = False
    device = torch.device("cuda", torch.cuda.current_device())
    exchange = host_group if host_group is not None else group
    # Setup is collective, so the ranks first agree whether all of them take part.
    agree = torch.tensor([int(bool(wanted))], dtype=torch.int32,
                         device="cpu" if host_group is not None else device)
    dist.all_reduce(agree, op=dist.ReduceOp.MIN, group=exchange)
    if not agree.item():
        return None
    try:
        peer = CustomAllReduce.setup(exchange, device)
    except PeerMemoryUnavailable as e:
        log.warning("one-shot all-reduce unavailable; all-reduces go through NCCL", reason=str(e))
        return None
    log.info("one-shot all-reduce over peer memory", ranks=size, max_bytes=peer.max_bytes)
    return peer


# all_gather_into_tensor was renamed all_gather_single (torch 2.13); the GPU image has 2.11.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class VocabParallelEmbedding(nn.Module):
    """Each rank looks up the ids in its vocabulary rows; the others contribute zeros."""

    def __init__(self, weight: nn.Parameter, start: int, comm: TensorGroup):
        super().__init__()
        self.weight = weight
        self.start, self.rows = start, weight.shape[0]
        self.comm = comm

    def forward(self, ids):
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        return self.comm.all_reduce(out.masked_fill(outside[:, None], 0))


class GatheredLogits:
    """compute_logits of a rank that holds a slice of the vocabulary: local logits, then every
    rank's columns side by side, cut to the real vocabulary (the last slice may be padded)."""

    def __init__(self, local_logits, comm: TensorGroup, vocab_size: int):
        self.local_logits, self.comm, self.vocab_size = local_logits, comm, vocab_size

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.comm.all_gather_columns(self.local_logits(hidden))[:, :self.vocab_size]


class ReducingOps:
    """A tensor-parallel model's ops. The row-parallel projections (o_proj, down_proj) leave each
    rank a partial sum, and every one of those outputs goes straight into an add_rmsnorm (the
    next one of the layer, of the next layer, or the final norm; through a pipeline hand-over
    too, rank i to rank i), so add_rmsnorm all-reduces its input first, and can do both in one
    kernel (TensorGroup.all_reduce_add_rmsnorm). Everything else is the wrapped ops'."""

    def __init__(self, ops, comm: TensorGroup):
        self._ops, self._comm = ops, comm

    def __getattr__(self, name):
        return getattr(self._ops, name)

    def add_rmsnorm(self, x, residual, weight, eps):
        return self._comm.all_reduce_add_rmsnorm(x, residual, weight, eps, self._ops)

    def rmsnorm_all_heads(self, x, weight, eps):
        """The mean square over every rank's heads: each rank's sum of squares, all-reduced."""
        squares = x.float().pow(2).sum(dim=-1, keepdim=True)
        mean = self._comm.all_reduce(squares) / (x.shape[-1] * self._comm.size)
        return (x.float() * torch.rsqrt(mean + eps)).to(x.dtype) * weight

    def add_rmsnorm_linear(self, x, residual, weight, eps, proj):
        """The all-reduce first (the wrapped ops' fused form would skip it), then the projection."""
        h, residual = self.add_rmsnorm(x, residual, weight, eps)
        return proj(h), residual


def apply_tensor_parallel(model: DecoderLM, cfg: ModelConfig, layout: ParallelLayout, comm: TensorGroup) -> None:
    """Put the collectives into a model built with layout.local_config(cfg) (loaded or not)."""
    if layout.tp == 1:
        return
    model.ops = ReducingOps(model.ops, comm)
    rows = layout.vocab_rows(cfg)
    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens.weight, layout.tp_rank * rows, comm)
    # An instance attribute shadows the method: the model file stays unaware of the split.
    model.compute_logits = GatheredLogits(model.compute_logits, comm, cfg.vocab_size)
