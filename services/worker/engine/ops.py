"""The seam between model math and kernels: torch references on the CPU, Triton on the GPU.

The model calls only these methods, so swapping the backend changes neither the model nor
the batcher nor the KV manager.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.worker.engine.attention_metadata import AttentionMetadata
from services.worker.kernels import (decode_attention, extend_attention, fp8_linear, fused_moe, gemv, mla_decode,
                                     mla_prefill, mla_rope, moe_route, rmsnorm, rope, sampling,
                                     silu_mul)

# Below this many decodes in a mixed step, the decode kernel's extra launches (eager steps pay
# Triton's host cost per launch) outweigh what it saves.
MIN_SPLIT_DECODE_ROWS = 16


class TorchOps:
    """Plain torch: what CI and the CPU demo run, and the reference for the Triton path."""

    name = "torch"

    def rmsnorm(self, x, weight, eps):
        return rmsnorm.rmsnorm_ref(x, weight, eps)

    def add_rmsnorm(self, x, residual, weight, eps):
        return rmsnorm.fused_add_rmsnorm_ref(x, residual, weight, eps)

    def rmsnorm_all_heads(self, x, weight, eps):
        """OLMoE's QK-norm: one RMSNorm over all of a row's heads (split over the ranks of a
        tensor-parallel group, whose ops sum the squares across them)."""
        return self.rmsnorm(x.contiguous(), weight, eps)

    def add_rmsnorm_linear(self, x, residual, weight, eps, proj):
        """(proj(rmsnorm(x + residual)), x + residual): a decoder layer's norm and the projection
        that reads it (`proj`, a model Linear), which the Triton ops fuse at decode sizes."""
        h, residual = self.add_rmsnorm(x, residual, weight, eps)
        return proj(h), residual

    def silu_mul(self, x):
        return silu_mul.silu_mul_ref(x)

    def linear(self, x, weight, bias=None):
        return gemv.linear_ref(x, weight, bias)

    def silu_mul_linear(self, x, weight, bias=None):
        """The MLP's down projection of the [gate | up] output."""
        return gemv.silu_mul_linear_ref(x, weight, bias)

    def linear_fp8(self, x, weight, w_scale, bias=None, silu_mul: bool = False):
        """x (or silu_mul's [gate | up]) times an fp8 weight with per-channel scales: x as it is at
        GEMV sizes (a decode of a few rows streams the weight; nothing to gain from fp8 x), else
        quantized per row for the fp8 tensor cores."""
        if x.shape[0] <= gemv.DISPATCH_MAX_ROWS:
            return (gemv.silu_mul_linear_ref if silu_mul else gemv.linear_ref)(x, weight, bias, w_scale)
        xq, x_scale = (fp8_linear.silu_mul_quantize_rows_ref if silu_mul else fp8_linear.quantize_rows_ref)(x)
        return fp8_linear.linear_fp8_ref(xq, x_scale, weight, w_scale, x.dtype, bias)

    def route(self, logits, top_k: int, renormalize: bool, counts=None):
        """An MoE router's choice: (fp32 weights, int32 expert ids), each [T, top_k]; counts (int64
        [E]) gets each expert's tokens added (kernels/moe_route.py)."""
        return moe_route.route_ref(logits, top_k, renormalize, counts)

    def group_route(self, logits, moe, bias, counts=None, fused=(0, 0)):
        """DeepSeek's router (MoEConfig moe: scoring, groups, scaling; bias: V3's score correction):
        (fp32 weights, int32 expert ids), each [T, top_k + n] (kernels/moe_route.py); fused (first id,
        n): the shared experts fused into the stacked ones, every token's at weight 1."""
        return moe_route.group_route_ref(logits, moe.top_k, moe.renormalize, moe.scoring, bias, moe.n_group,
                                         moe.topk_group, moe.routed_scaling_factor, counts, fused)

    def fused_moe(self, x, w13, w2, topk_weights, topk_ids, first_expert=0, w13_scale=None, w2_scale=None):
        """The experts' part of an MoE layer: each token through its top-k experts held here
        (ids from first_expert), weighted and summed (kernels/fused_moe.py)."""
        return fused_moe.fused_moe_ref(x, w13, w2, topk_weights, topk_ids, first_expert, w13_scale, w2_scale)

    def rope_kv_write(self, q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, interleave: bool = False,
                      norm_eps: float | None = None, q_scale=None):
        """q and k rotated (cos_sin None: not), k and v written at their slots; Llama 4's interleaved
        pairs, QK-norm and query temperature where asked (kernels/rope.py)."""
        return rope.rope_kv_write_ref(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, interleave,
                                      norm_eps, q_scale)

    def attention(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, chunk: int = 0):
        """Causal attention over the paged cache; chunk > 0: within each position's chunk only."""
        return extend_attention.paged_extend_attention_ref(
            q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale, chunk)

    def mla_rope_write(self, q_rot, k_rot, latent, positions, cos_sin, cache, slot_mapping, interleave: bool):
        """MLA: q's rotary part rotated (returned), [latent | rotated k_rot] written at the slots."""
        return mla_rope.mla_rope_write_ref(q_rot, k_rot, latent, positions, cos_sin, cache, slot_mapping, interleave)

    def mla_attention(self, q_nope, q_rot, cache, kv_b, meta: AttentionMetadata, scale: float, v_dim: int):
        """MLA over the latent cache → [T, H, v_dim]: a step of decodes in the absorbed form (the
        latents read as they are), any other in the expanded form (kernels/mla_prefill.py)."""
        if meta.decode_only:
            return self.mla_decode(q_nope, q_rot, cache, kv_b, meta.block_tables, meta.seq_lens, scale,
                                   meta.max_seq_len)
        return mla_prefill.mla_prefill(q_nope, q_rot, cache, kv_b, meta.block_tables, meta.query_start_loc,
                                       meta.seq_lens, meta.max_query_len, meta.max_seq_len, scale, v_dim)

    def mla_decode(self, q_nope, q_rot, cache, kv_b, block_tables, seq_lens, scale: float, max_seq_len: int):
        q = mla_decode.absorb_query(q_nope, q_rot, kv_b)
        o_lat = mla_decode.mla_decode_ref(q, cache, block_tables, seq_lens, scale, kv_b.shape[1])
        return mla_decode.expand_output(o_lat, kv_b, q_nope.shape[-1])

    def sample(self, logits, temperature, top_k, top_p, min_p, seeds, offsets, chain: bool = True,
               second_read: bool = True, one_shape: bool = False):
        """chain / second_read False: the caller knows no row needs the kernels' chunked chain or
        their second read (sampling.launches_needed), whose launches are then skipped; the reference
        has no such work. one_shape: one launch shape whatever the batch size (one kernel variant to
        compile, for a rare input type)."""
        return sampling.sample_ref(logits, temperature, top_k, top_p, min_p, seeds, offsets)

    def sample_warm_rows(self, vocab: int, max_rows: int, device: torch.device) -> list[int]:
        """Batch sizes whose draws compile every variant of sample's kernels (none here)."""
        return []


class TritonOps(TorchOps):
    """Triton kernels for every op of the step; GEMMs of more than a few rows (prefill, large
    decode batches) stay with cuBLAS through torch."""

    name = "triton"

    def rmsnorm(self, x, weight, eps):
        return rmsnorm.rmsnorm(x, weight, eps)

    def add_rmsnorm(self, x, residual, weight, eps):
        return rmsnorm.fused_add_rmsnorm(x, residual, weight, eps)

    def add_rmsnorm_linear(self, x, residual, weight, eps, proj):
        # One GEMV that norms its input on the way in, for the few rows of a decode step and 16-bit
        # weights; else the norm kernel, then the projection.
        if x.shape[0] <= gemv.FUSED_NORM_MAX_ROWS and proj.weight_scale is None:
            return gemv.add_rmsnorm_linear(x, residual, weight, eps, proj.weight, proj.bias)
        return super().add_rmsnorm_linear(x, residual, weight, eps, proj)

    def silu_mul(self, x):
        return silu_mul.silu_mul(x)

    def linear(self, x, weight, bias=None):
        if x.shape[0] <= gemv.DISPATCH_MAX_ROWS:
            return gemv.linear(x, weight, bias)
        return F.linear(x, weight, bias)

    def silu_mul_linear(self, x, weight, bias=None):
        if x.shape[0] <= gemv.FUSED_SILU_MAX_ROWS:
            return gemv.silu_mul_linear(x, weight, bias)
        return self.linear(silu_mul.silu_mul(x), weight, bias)

    def linear_fp8(self, x, weight, w_scale, bias=None, silu_mul: bool = False):
        m = x.shape[0]
        if m <= gemv.FUSED_SILU_MAX_ROWS or (m <= gemv.DISPATCH_MAX_ROWS and not silu_mul):
            return (gemv.silu_mul_linear if silu_mul else gemv.linear)(x, weight, bias, scale=w_scale)
        if m <= gemv.DISPATCH_MAX_ROWS:
            return gemv.linear(self.silu_mul(x), weight, bias, scale=w_scale)
        xq, x_scale = fp8_linear.quantize_rows(x, silu_mul)
        gemm = fp8_linear.linear_fp8 if x.is_cuda else fp8_linear.linear_fp8_ref  # the interpreter: no fp8 GEMM
        return gemm(xq, x_scale, weight, w_scale, x.dtype, bias)

    def route(self, logits, top_k: int, renormalize: bool, counts=None):
        return moe_route.route(logits, top_k, renormalize, counts)

    def group_route(self, logits, moe, bias, counts=None, fused=(0, 0)):
        return moe_route.route(logits, moe.top_k, moe.renormalize, counts, moe.scoring, bias, moe.n_group,
                               moe.topk_group, moe.routed_scaling_factor, fused)

    def mla_rope_write(self, q_rot, k_rot, latent, positions, cos_sin, cache, slot_mapping, interleave: bool):
        return mla_rope.mla_rope_write(q_rot, k_rot, latent, positions, cos_sin, cache, slot_mapping, interleave)

    def mla_attention(self, q_nope, q_rot, cache, kv_b, meta: AttentionMetadata, scale: float, v_dim: int):
        n = meta.decode_rows
        if meta.decode_only or n < MIN_SPLIT_DECODE_ROWS:
            return super().mla_attention(q_nope, q_rot, cache, kv_b, meta, scale, v_dim)
        # A mixed step's decodes in the absorbed form; padding them into the expanded form's
        # [sequences, longest query] grid would cost a prompt's width each.
        out = q_nope.new_empty((q_nope.shape[0], q_nope.shape[1], v_dim))
        out[:n] = self.mla_decode(q_nope[:n], q_rot[:n], cache, kv_b, meta.block_tables[:n], meta.seq_lens[:n], scale,
                                  meta.max_seq_len)
        qsl = meta.query_start_loc[n:] - n
        out[n:] = mla_prefill.mla_prefill(q_nope[n:], q_rot[n:], cache, kv_b, meta.block_tables[n:], qsl,
                                          meta.seq_lens[n:], meta.max_query_len, meta.max_seq_len, scale, v_dim)
        return out

    def mla_decode(self, q_nope, q_rot, cache, kv_b, block_tables, seq_lens, scale: float, max_seq_len: int):
        q = mla_decode.absorb_query(q_nope, q_rot, kv_b)
        o_lat = mla_decode.mla_decode(q, cache, block_tables, seq_lens, scale, kv_b.shape[1], max_seq_len)
        return mla_decode.expand_output(o_lat, kv_b, q_nope.shape[-1])

    def fused_moe(self, x, w13, w2, topk_weights, topk_ids, first_expert=0, w13_scale=None, w2_scale=None):
        return fused_moe.fused_moe(x, w13, w2, topk_weights, topk_ids, first_expert, w13_scale, w2_scale)

    def rope_kv_write(self, q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, interleave: bool = False,
                      norm_eps: float | None = None, q_scale=None):
        return rope.rope_kv_write(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, interleave,
                                  norm_eps, q_scale)

    def attention(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, chunk: int = 0):
        if meta.decode_only:
            return decode_attention.paged_decode_attention(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, max_seq_len=meta.max_seq_len,
                chunk=chunk)
        n = meta.decode_rows
        if n >= MIN_SPLIT_DECODE_ROWS and meta.tiles is not None:
            # A mixed step's decodes to the decode kernel, which reads their KV at the bandwidth
            # roofline; in the extend kernel each took a whole 16-token tile (4 of its 64 rows used).
            out = torch.empty_like(q)
            decode_attention.paged_decode_attention(
                q[:n], k_cache, v_cache, meta.block_tables[:n], meta.seq_lens[:n], scale,
                max_seq_len=meta.max_seq_len, out=out[:n], chunk=chunk)
            return extend_attention.paged_extend_attention(
                q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale,
                max_query_len=meta.max_query_len, tiles=meta.tiles, out=out, tile_start=n, chunk=chunk)
        return extend_attention.paged_extend_attention(
            q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale,
            max_query_len=meta.max_query_len, tiles=meta.tiles, chunk=chunk)

    def sample(self, logits, temperature, top_k, top_p, min_p, seeds, offsets, chain: bool = True,
               second_read: bool = True, one_shape: bool = False):
        return sampling.sample(logits, temperature, top_k, top_p, min_p, seeds, offsets,
                               chain_rounds=sampling.CHAIN_ROUNDS if chain else 0, second_read=second_read,
                               num_splits=sampling.max_splits(logits.shape[1]) if one_shape else None)

    def sample_warm_rows(self, vocab: int, max_rows: int, device: torch.device) -> list[int]:
        if device.type != "cuda":  # the interpreter compiles nothing
            return []
        return sampling.warm_row_counts(vocab, max_rows, device)


def make_ops(backend: str) -> TorchOps:
    if backend == "torch":
        return TorchOps()
    if backend == "triton":
        return TritonOps()
    raise ValueError(f"unknown kernel backend {backend!r} (torch or triton)")
