"""Multi-head latent attention of a prefill (or any step) in the expanded form: the context's latents
are up-projected to every head's key and value, then ordinary causal attention. Torch, on both
backends: SDPA's fused kernels do the attention; the expansion is one GEMM.

The expanded form costs (nope + rope + v) multiply-adds per head and key against the absorbed
form's (2 × kv_lora_rank + rope): 3.4 × fewer at DeepSeek's shapes, which pays once a query meets
many keys (a prompt); a decode, one query a sequence, reads the latents as they are (mla_decode).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def mla_prefill(q_nope: torch.Tensor, q_rot: torch.Tensor, cache: torch.Tensor, kv_b: torch.Tensor,
                block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                max_query_len: int, max_seq_len: int, scale: float, v_dim: int) -> torch.Tensor:
    """q_nope [T, H, nope], q_rot [T, H, rope] (rotated): the step's tokens, sequence after sequence
    (query_start_loc), each the last of its sequence's seq_lens tokens; cache [N, block_size, 1,
    lora + rope]; kv_b [H * (nope + v), lora] (kv_b_proj's weight). Returns [T, H, v] in q's dtype.
    Sequences are padded to the step's longest (max_query_len queries, max_seq_len keys): no host
    sync, so CUDA graphs capture it."""
    t, heads, nope = q_nope.shape
    n, page, width = seq_lens.shape[0], cache.shape[1], cache.shape[3]
    lora = kv_b.shape[1]
    dtype = q_nope.dtype
    pos = torch.arange(max_seq_len, device=q_nope.device)
    # Table entries past a sequence's end may hold anything: never follow them.
    blocks = torch.where(pos[None, :] < seq_lens[:, None], block_tables[:, pos // page].long(), 0)
    rows = cache[blocks, pos % page, 0].to(dtype)  # [B, S, lora + rope]
    kv = F.linear(rows[..., :lora], kv_b).view(n, max_seq_len, heads, -1)
    k = torch.cat((kv[..., :nope], rows[..., None, lora:].expand(-1, -1, heads, -1)), dim=-1)
    v = kv[..., nope:]
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    seq = torch.repeat_interleave(torch.arange(n, device=q_nope.device), q_lens, output_size=t)
    row = torch.arange(t, device=q_nope.device) - query_start_loc[seq].long()
    q = q_nope.new_zeros((n, max_query_len, heads, nope + q_rot.shape[-1]))
    q[seq, row] = torch.cat((q_nope, q_rot), dim=-1)
    # Query i of sequence b sits at position seq_len - q_len + i and sees the keys up to it.
    q_pos = (seq_lens - q_lens)[:, None] + torch.arange(max_query_len, device=q_nope.device)[None, :]
    mask = pos[None, None, :] <= q_pos[:, :, None]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask[:, None], scale=scale)
    return out.transpose(1, 2)[seq, row]
