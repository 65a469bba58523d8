"""DeepSeek's router rule (sigmoid or softmax scores, a bias that steers the choice, experts chosen
within the best groups, scaled weights): the torch reference, which both backends run."""

from __future__ import annotations

import torch


def group_route_ref(logits: torch.Tensor, top_k: int, renormalize: bool, scoring: str, bias: torch.Tensor | None,
                    n_group: int, topk_group: int, scaling: float,
                    counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] → (weights fp32 [T, top_k], expert ids int32 [T, top_k]), as transformers'
    DeepseekV2/V3 routers: scores are softmax (V2) or sigmoid (V3) in fp32; the choice adds `bias`
    (V3's e_score_correction_bias) and keeps to the topk_group best of n_group groups (a group
    scored by its best two biased scores with a bias, else by its best score); the weights are the
    unbiased scores of the chosen, renormalised where asked, times `scaling`. counts (int64 [E])
    gets each expert's tokens added. No host sync: CUDA graphs capture it."""
    scores = torch.sigmoid(logits.float()) if scoring == "sigmoid" else torch.softmax(logits.float(), dim=-1)
    choice = scores if bias is None else scores + bias.float()
    if n_group > 1:
        t, e = choice.shape
        grouped = choice.view(t, n_group, e // n_group)
        group_score = grouped.topk(2, dim=-1)[0].sum(-1) if bias is not None else grouped.amax(-1)
        keep = torch.zeros_like(group_score).scatter_(1, group_score.topk(topk_group, dim=-1)[1], 1.0)
        choice = choice.masked_fill(~keep.bool().repeat_interleave(e // n_group, dim=1), float("-inf"))
    ids = choice.topk(top_k, dim=-1)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if counts is not None:
        counts.index_add_(0, ids.view(-1), torch.ones_like(ids.view(-1)))
    return weights * scaling, ids.to(torch.int32)
