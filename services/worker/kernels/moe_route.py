"""The router's rule (which experts see a token, with what weight) as one kernel, and its reference."""

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


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, counts_ptr, num_experts, stride,
                  TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, COUNT: tl.constexpr,
                  BLOCK_E: tl.constexpr, PDL: tl.constexpr = False):
    """One token a program: the softmax of its row, then K rounds of taking the largest (the
    lowest index among equals, as torch.topk on distinct values) and masking it out."""
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    valid = cols < num_experts
    x = tl.load(logits_ptr + t * stride + cols, mask=valid, other=-float("inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = tl.where(valid, p / tl.sum(p, axis=0), -1.0)
    chosen = tl.zeros([BLOCK_E], dtype=tl.float32)
    total = 0.0
    for k in tl.static_range(TOP_K):
        best = tl.max(p, axis=0)
        index = tl.argmax(p, axis=0)
        total += best
        tl.store(ids_ptr + t * TOP_K + k, index.to(tl.int32))
        chosen = tl.where(cols == index, best, chosen)
        p = tl.where(cols == index, -1.0, p)
        if COUNT:
            tl.atomic_add(counts_ptr + index, 1)
    for k in tl.static_range(TOP_K):
        index = tl.load(ids_ptr + t * TOP_K + k)
        w = tl.sum(tl.where(cols == index, chosen, 0.0), axis=0)
        if RENORMALIZE:
            w = w / total
        tl.store(weights_ptr + t * TOP_K + k, w)


def route(logits: torch.Tensor, top_k: int, renormalize: bool,
          counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """route_ref's contract in one launch (a decode step's router took seven: softmax, top-k,
    the renormalising sum and division, the id cast, the count)."""
    check_tensor(logits, "logits", ndim=2, dtypes=FLOAT_DTYPES)
    check(logits.stride(1) == 1, "logits' last dimension must be contiguous")
    tokens, experts = logits.shape
    check(0 < top_k <= experts, "top_k must be in [1, {}], got {}", experts, top_k)
    if counts is not None:
        check_tensor(counts, "counts", ndim=1, dtypes=(torch.int64,), device=logits.device)
        check(counts.numel() == experts, "counts must have one entry per expert ({}), got {}", experts, counts.numel())
    # One warp a row while it fits: the K rounds of max and argmax are shuffles within it, not trips
    # through shared memory (H200, 128 experts, K = 8: 10.4 us a launch with 4 warps).
    block = triton.next_power_of_2(experts)
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int32, device=logits.device)
    if tokens:
        _route_kernel[(tokens,)](logits, weights, ids, counts if counts is not None else ids, experts,
                                 logits.stride(0), TOP_K=top_k, RENORMALIZE=renormalize, COUNT=counts is not None,
                                 BLOCK_E=block, num_warps=1 if block <= 512 else 4, **pdl_args(logits.device))
    return weights, ids
