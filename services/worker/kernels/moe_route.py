"""The router's rule (which experts see a token, with what weight) as one kernel, and its references:
the softmax top-k of Mixtral, Qwen and OLMoE, and DeepSeek's grouped rule."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.worker.kernels._common import FLOAT_DTYPES, check, check_tensor, pdl_args, pdl_enter


def route_ref(logits: torch.Tensor, top_k: int, renormalize: bool,
              counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] → (weights fp32 [T, top_k], expert ids int32 [T, top_k]).

    Every family served (Mixtral, Qwen2/3-MoE, OLMoE) takes a softmax over all experts in fp32,
    then the top k; Mixtral and norm_topk_prob models renormalise the k to sum to 1 (the same as
    a softmax over the top-k logits). counts (int64 [E]): each expert's tokens are added to it
    (the load statistics of /metrics)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if counts is not None:
        counts.index_add_(0, ids.view(-1), torch.ones_like(ids.view(-1)))
    return weights, ids.to(torch.int32)


def group_route_ref(logits: torch.Tensor, top_k: int, renormalize: bool, scoring: str, bias: torch.Tensor | None,
                    n_group: int, topk_group: int, scaling: float, counts: torch.Tensor | None = None,
                    fused: tuple[int, int] = (0, 0)) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] → (weights fp32 [T, top_k], expert ids int32 [T, top_k]), as transformers'
    DeepseekV2/V3 routers (and Llama 4's: sigmoid, no bias, no groups): scores are softmax (V2) or
    sigmoid (V3) in fp32; the choice adds `bias`
    (V3's e_score_correction_bias) and keeps to the topk_group best of n_group groups (a group
    scored by its best two biased scores with a bias, else by its best score); the weights are the
    unbiased scores of the chosen, renormalised where asked, times `scaling`. counts (int64 [E])
    gets each expert's tokens added. fused (first, n): n more columns, experts first..first + n - 1
    at weight 1 (shared experts fused into the stacked ones). No host sync: CUDA graphs capture it."""
    scores = torch.sigmoid(logits.float()) if scoring == "sigmoid" else torch.softmax(logits.float(), dim=-1)
    choice = scores if bias is None else scores + bias.float()
    if scoring == "sigmoid" and bias is None:
        # Llama 4 picks by the logits: the sigmoids' order, but for logits large enough that fp32
        # rounds their sigmoids to the same 1.0.
        choice = logits.float()
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
    weights, ids = weights * scaling, ids.to(torch.int32)
    first, n = fused
    if n:
        extra = torch.arange(first, first + n, dtype=torch.int32, device=ids.device).expand(ids.shape[0], n)
        ids = torch.cat((ids, extra), dim=1)
        weights = torch.cat((weights, torch.ones(extra.shape, dtype=weights.dtype, device=weights.device)), dim=1)
    return weights, ids


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, counts_ptr, num_experts, stride, scale, fused_first,
                  TOP_K: tl.constexpr, FUSED: tl.constexpr, RENORMALIZE: tl.constexpr, COUNT: tl.constexpr, SIGMOID: tl.constexpr,
                  BIAS: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
                  BLOCK_E: tl.constexpr, PDL: tl.constexpr = False):
    """One token a program: its row's scores (softmax, or sigmoid), the choice (scores plus the
    bias) kept to the TOPK_GROUP best groups, then K rounds of taking the largest choice (the lowest
    index among equals, as torch.topk on distinct values) and masking it out; a chosen expert's
    weight is its unbiased score. A row holds TOP_K + FUSED columns: then the fused shared experts."""
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    valid = cols < num_experts
    x = tl.load(logits_ptr + t * stride + cols, mask=valid, other=-float("inf")).to(tl.float32)
    if SIGMOID:
        p = tl.where(valid, 1.0 / (1.0 + tl.exp(-x)), -1.0)
    else:
        p = tl.exp(x - tl.max(x, axis=0))
        p = tl.where(valid, p / tl.sum(p, axis=0), -1.0)
    choice = p
    if BIAS:
        choice = tl.where(valid, p + tl.load(bias_ptr + cols, mask=valid, other=0.0).to(tl.float32), -float("inf"))
    elif SIGMOID:
        choice = x  # by the logits, as the reference (-inf past the experts)
    if N_GROUP > 1:
        # A group's score: its best two choices with a bias (V3), its best one without (V2).
        group = cols // (num_experts // N_GROUP)
        gcols = tl.arange(0, N_GROUP)
        gscore = tl.zeros([N_GROUP], dtype=tl.float32)
        for g in tl.static_range(N_GROUP):
            mine = tl.where(group == g, choice, -float("inf"))
            first = tl.max(mine, axis=0)
            score = first
            if BIAS:
                score += tl.max(tl.where(cols == tl.argmax(mine, axis=0), -float("inf"), mine), axis=0)
            gscore = tl.where(gcols == g, score, gscore)
        keep = cols < 0
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.argmax(gscore, axis=0)
            keep = keep | (group == best)
            gscore = tl.where(gcols == best, -float("inf"), gscore)
        choice = tl.where(keep & valid, choice, -float("inf"))
    chosen = tl.zeros([BLOCK_E], dtype=tl.float32)
    total = 0.0
    for k in tl.static_range(TOP_K):
        index = tl.argmax(choice, axis=0)
        score = tl.sum(tl.where(cols == index, p, 0.0), axis=0)
        total += score
        tl.store(ids_ptr + t * (TOP_K + FUSED) + k, index.to(tl.int32))
        chosen = tl.where(cols == index, score, chosen)
        choice = tl.where(cols == index, -float("inf"), choice)
        if COUNT:
            tl.atomic_add(counts_ptr + index, 1)
    for k in tl.static_range(TOP_K):
        index = tl.load(ids_ptr + t * (TOP_K + FUSED) + k)
        w = tl.sum(tl.where(cols == index, chosen, 0.0), axis=0)
        if RENORMALIZE:
            w = w / (total + 1e-20) if SIGMOID else w / total
        tl.store(weights_ptr + t * (TOP_K + FUSED) + k, w * scale)
    for j in tl.static_range(FUSED):
        tl.store(ids_ptr + t * (TOP_K + FUSED) + TOP_K + j, (fused_first + j).to(tl.int32))
        tl.store(weights_ptr + t * (TOP_K + FUSED) + TOP_K + j, 1.0)


def route(logits: torch.Tensor, top_k: int, renormalize: bool, counts: torch.Tensor | None = None,
          scoring: str = "softmax", bias: torch.Tensor | None = None, n_group: int = 1, topk_group: int = 1,
          scale: float = 1.0, fused: tuple[int, int] = (0, 0)) -> tuple[torch.Tensor, torch.Tensor]:
    """route_ref's contract (group_route_ref's, given scoring, bias, groups or a scale) in one launch
    (a decode step's router took seven: softmax, top-k, the renormalising sum and division, the id
    cast, the count; DeepSeek's grouped rule in torch takes a dozen)."""
    check_tensor(logits, "logits", ndim=2, dtypes=FLOAT_DTYPES)
    check(logits.stride(1) == 1, "logits' last dimension must be contiguous")
    tokens, experts = logits.shape
    check(0 < top_k <= experts, "top_k must be in [1, {}], got {}", experts, top_k)
    check(scoring in ("softmax", "sigmoid"), "scoring must be softmax or sigmoid, got {}", scoring)
    check(n_group >= 1 and experts % n_group == 0 and n_group & (n_group - 1) == 0,
          "{} experts do not split into {} groups (a power of two)", experts, n_group)
    if bias is not None:
        check_tensor(bias, "bias", ndim=1, dtypes=FLOAT_DTYPES, device=logits.device, contiguous=True)
        check(bias.numel() == experts, "bias must have one entry per expert ({}), got {}", experts, bias.numel())
    if counts is not None:
        check_tensor(counts, "counts", ndim=1, dtypes=(torch.int64,), device=logits.device)
        check(counts.numel() == experts, "counts must have one entry per expert ({}), got {}", experts, counts.numel())
    # One warp a row while it fits: the K rounds of max and argmax are shuffles within it, not trips
    # through shared memory (H200, 128 experts, K = 8: 10.4 us a launch with 4 warps).
    block = triton.next_power_of_2(experts)
    weights = torch.empty((tokens, top_k + fused[1]), dtype=torch.float32, device=logits.device)
    ids = torch.empty((tokens, top_k + fused[1]), dtype=torch.int32, device=logits.device)
    if tokens:
        _route_kernel[(tokens,)](logits, bias if bias is not None else logits, weights, ids,
                                 counts if counts is not None else ids, experts, logits.stride(0), float(scale),
                                 fused[0], TOP_K=top_k, FUSED=fused[1], RENORMALIZE=renormalize,
                                 COUNT=counts is not None, SIGMOID=scoring == "sigmoid", BIAS=bias is not None, N_GROUP=n_group,
                                 TOPK_GROUP=topk_group, BLOCK_E=block, num_warps=1 if block <= 512 else 4,
                                 **pdl_args(logits.device))
    return weights, ids
