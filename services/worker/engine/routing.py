"""The routers' rule: which experts see a token, and with what weight."""

from __future__ import annotations

import torch


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] → (weights fp32 [T, top_k], expert ids int32 [T, top_k]).

    Every family served here (Mixtral, Qwen2/3-MoE, OLMoE) takes a softmax over all experts in
    fp32, then the top k; Mixtral and norm_topk_prob models renormalise the k to sum to 1 (the
    same as a softmax over the top-k logits). Fixed shapes, no host read: graph-capturable."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)
