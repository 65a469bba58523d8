"""Fused MoE: the alignment's exact layout, the Triton grouped GEMMs vs the reference, and the
reference vs HF's Qwen2MoeExperts."""

from __future__ import annotations

import pytest
import torch
from kernel_checks import TOL, rel_err

from services.worker.kernels import fused_moe as moe
from services.worker.kernels.fp8_linear import quantize_weight

E, H, I = 4, 48, 40  # H and I not multiples of the tiles: partial N and K steps


def _weights(num_experts, dtype, device):
    w13 = (torch.randn(num_experts, 2 * I, H, device=device) * 0.2).to(dtype)
    w2 = (torch.randn(num_experts, H, I, device=device) * 0.2).to(dtype)
    return w13, w2


def _routed(tokens, num_experts, top_k, device):
    probs = torch.softmax(torch.randn(tokens, num_experts, device=device), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    return weights, ids.to(torch.int32)


def _check(x, w13, w2, weights, ids, first_expert=0, **kwargs):
    out = moe.fused_moe(x, w13, w2, weights, ids, first_expert, **kwargs)
    ref = moe.fused_moe_ref(x, w13, w2, weights, ids, first_expert,
                            kwargs.get("w13_scale"), kwargs.get("w2_scale"))
    assert out.shape == x.shape and out.dtype == x.dtype and torch.isfinite(out).all()
    assert rel_err(out, ref) <= TOL[x.dtype]
    return out


@pytest.mark.parametrize("align", [moe.moe_align, moe.moe_align_ref])
def test_moe_align_exact_layout(align, device):
    s = 10  # T*K: the sentinel
    ids = torch.tensor([[3, 1], [1, 0], [3, 3], [2, 5], [1, 1]], dtype=torch.int32, device=device)
    sorted_ids, block_expert, used = align(ids, num_experts=4, first_expert=0, block_m=4)
    # Runs in token order, each padded to 4; expert 5 lives on another rank and is dropped.
    want = [3, s, s, s, 1, 2, 8, 9, 6, s, s, s, 0, 4, 5, s] + [s] * 8
    assert sorted_ids.tolist() == want and sorted_ids.dtype == torch.int32
    assert block_expert.tolist() == [0, 1, 2, 3, -1, -1] and block_expert.dtype == torch.int32
    assert used.tolist() == [16] and used.dtype == torch.int32


@pytest.mark.parametrize("tokens,top_k,num_experts,first_expert,block_m", [
    (1, 2, 4, 0, 16),     # decode
    (5, 2, 4, 0, 4),
    (5, 2, 4, 2, 4),      # expert parallelism: ids 2..5 local, 0..1 and 6..7 dropped
    (70, 3, 300, 0, 16),  # several chunks of assignments (E_BLOCK 512: 16 a chunk)
])
def test_moe_align_places_every_local_assignment_once(tokens, top_k, num_experts, first_expert, block_m, device):
    ids = torch.randint(0, 2 * num_experts, (tokens, top_k), device=device)
    sorted_ids, block_expert, used = moe.moe_align(ids, num_experts, first_expert, block_m)
    for got, want in zip((sorted_ids, block_expert, used), moe.moe_align_ref(ids, num_experts, first_expert, block_m)):
        assert torch.equal(got, want)
    n = tokens * top_k
    size = moe.max_padded(n, num_experts, block_m)
    assert sorted_ids.shape == (size,) and block_expert.shape == (size // block_m,)
    local = ids.flatten().cpu() - first_expert
    is_local = (local >= 0) & (local < num_experts)
    counts = torch.bincount(local[is_local], minlength=num_experts)
    assert used.item() == int(((counts + block_m - 1) // block_m * block_m).sum())
    placed = sorted_ids.cpu()[sorted_ids.cpu() != n]
    assert placed.sort().values.tolist() == torch.nonzero(is_local).flatten().tolist()
    for b, e in enumerate(block_expert.tolist()):
        block = sorted_ids[b * block_m:(b + 1) * block_m].cpu()
        real = block[block != n].long()
        if b * block_m >= used.item():
            assert e == -1 and real.numel() == 0
        else:
            assert 0 <= e < num_experts and real.numel() > 0 and (local[real] == e).all()


def test_block_config_follows_the_batch():
    assert moe.moe_config(1, E).block_m == 16
    assert moe.moe_config(20, E).block_m == 64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 20])  # the decode and the prefill block configs
def test_fused_moe_matches_reference(dtype, tokens, device):
    x = torch.randn(tokens, H, device=device).to(dtype)
    w13, w2 = _weights(E, dtype, device)
    _check(x, w13, w2, *_routed(tokens, E, 2, device))


def test_every_token_to_one_expert(device):
    """One expert's run spans several blocks (a small config), two experts get none."""
    tokens = 40
    x = torch.randn(tokens, H, device=device)
    w13, w2 = _weights(E, torch.float32, device)
    weights, _ = _routed(tokens, E, 2, device)
    ids = torch.tensor([[2, 0]], dtype=torch.int32, device=device).expand(tokens, 2).contiguous()
    config = moe.MoeConfig(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=2)
    _check(x, w13, w2, weights, ids, config=config)


def test_tokens_spread_evenly(device):
    tokens, top_k = 6, 2
    x = torch.randn(tokens, H, device=device).to(torch.bfloat16)
    w13, w2 = _weights(E, torch.bfloat16, device)
    weights, _ = _routed(tokens, E, top_k, device)
    ids = (torch.arange(tokens * top_k, device=device) % E).view(tokens, top_k).to(torch.int32)
    _check(x, w13, w2, weights, ids)


def test_expert_parallel_halves_sum_to_the_whole(device):
    """Each rank holds half the experts; a token routed only to the other rank's gets exact zeros
    (its rows are never written, and torch.empty is poisoned here)."""
    tokens, half = 7, E // 2
    x = torch.randn(tokens, H, device=device)
    w13, w2 = _weights(E, torch.float32, device)
    weights, ids = _routed(tokens, E, 2, device)
    ids[0] = torch.tensor([0, 1])  # all on rank 0
    ids = ids.to(torch.int64)  # the other index dtype
    rank0 = _check(x, w13[:half], w2[:half], weights, ids, first_expert=0)
    rank1 = _check(x, w13[half:], w2[half:], weights, ids, first_expert=half)
    assert (rank1[0] == 0).all()
    whole = moe.fused_moe_ref(x, w13, w2, weights, ids)
    assert rel_err(rank0 + rank1, whole) <= TOL[torch.float32]


def test_fp8_weights_with_per_row_scales(device):
    tokens = 5
    x = torch.randn(tokens, H, device=device).to(torch.bfloat16)
    w13, w2 = _weights(E, torch.bfloat16, device)
    q13, s13 = (torch.stack(t) for t in zip(*map(quantize_weight, w13)))
    q2, s2 = (torch.stack(t) for t in zip(*map(quantize_weight, w2)))
    weights, ids = _routed(tokens, E, 2, device)
    out = _check(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2)
    # ... and near the 16-bit layer the fp8 weights stand for.
    assert rel_err(out, moe.fused_moe_ref(x, w13, w2, weights, ids)) <= 0.1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_equals_hf_experts(dtype):
    from transformers.models.qwen2_moe.configuration_qwen2_moe import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeExperts

    tokens, top_k = 9, 2
    hf = Qwen2MoeExperts(Qwen2MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E,
                                        hidden_act="silu")).to(dtype)
    w13, w2 = _weights(E, dtype, "cpu")
    with torch.no_grad():
        hf.gate_up_proj.copy_(w13)
        hf.down_proj.copy_(w2)
        x = torch.randn(tokens, H).to(dtype)
        weights, ids = _routed(tokens, E, top_k, "cpu")
        want = hf(x, ids.long(), weights.to(dtype))  # HF's router hands weights in x.dtype
    assert torch.equal(moe.fused_moe_ref(x, w13, w2, weights, ids), want)


def test_rejects_bad_arguments(device):
    x = torch.randn(3, H, device=device)
    w13, w2 = _weights(E, torch.float32, device)
    weights, ids = _routed(3, E, 2, device)
    with pytest.raises(ValueError, match="w13 has shape"):
        moe.fused_moe(x, w13[:, :-1].contiguous(), w2, weights, ids)
    with pytest.raises(ValueError, match="contiguous"):
        moe.fused_moe(x, w13[:, :, :-1], w2[:, :-1], weights, ids)
    with pytest.raises(ValueError, match="w2 has dtype"):
        moe.fused_moe(x, w13, w2.to(torch.bfloat16), weights, ids)
    with pytest.raises(ValueError, match="topk_weights has shape"):
        moe.fused_moe(x, w13, w2, weights[:2], ids)
    with pytest.raises(ValueError, match="topk_ids has dtype"):
        moe.fused_moe(x, w13, w2, weights, ids.float())
    with pytest.raises(ValueError, match="come together"):
        moe.fused_moe(x, w13, w2, weights, ids, w13_scale=torch.ones(E, 2 * I, device=device))


def test_no_tokens(device):
    w13, w2 = _weights(E, torch.float32, device)
    weights, ids = _routed(0, E, 2, device)
    assert moe.fused_moe(torch.randn(0, H, device=device), w13, w2, weights, ids).shape == (0, H)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3])
def test_decode_sizes_take_the_gemv_path(dtype, tokens, device):
    """Up to moe_gemv.MAX_TOKENS tokens: no sorting, one program per (assignment, N tile), the
    down launch summing the token's experts; an expert held by the other rank contributes zero."""
    from services.worker.kernels import moe_gemv

    assert tokens <= moe_gemv.MAX_TOKENS
    x = torch.randn(tokens, H, device=device).to(dtype)
    w13, w2 = _weights(E, dtype, device)
    weights, ids = _routed(tokens, E, 3, device)
    _check(x, w13, w2, weights, ids)
    half = E // 2
    rank1 = _check(x, w13[half:], w2[half:], weights, ids, first_expert=half)
    rank0 = _check(x, w13[:half], w2[:half], weights, ids)
    assert rel_err(rank0 + rank1, moe.fused_moe_ref(x, w13, w2, weights, ids)) <= TOL[dtype]
    q13, s13 = (torch.stack(t) for t in zip(*map(quantize_weight, w13)))
    q2, s2 = (torch.stack(t) for t in zip(*map(quantize_weight, w2)))
    if dtype == torch.bfloat16:
        _check(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2)


def test_one_token_through_the_grouped_gemms(device):
    x = torch.randn(1, H, device=device).to(torch.bfloat16)
    w13, w2 = _weights(E, torch.bfloat16, device)
    _check(x, w13, w2, *_routed(1, E, 2, device), config=moe.moe_config(1, E))


@pytest.mark.parametrize("top_k,renormalize", [(2, True), (3, False)])
def test_route_kernel_matches_reference(top_k, renormalize, device):
    from services.worker.kernels import moe_route

    logits = torch.randn(5, 6, device=device).to(torch.bfloat16)  # 6 experts: a masked tail
    counts, counts_ref = (torch.zeros(6, dtype=torch.int64, device=device) for _ in range(2))
    weights, ids = moe_route.route(logits, top_k, renormalize, counts)
    want_w, want_ids = moe_route.route_ref(logits, top_k, renormalize, counts_ref)
    assert torch.equal(ids, want_ids) and ids.dtype == torch.int32
    assert torch.allclose(weights, want_w, rtol=1e-6, atol=1e-7)
    assert torch.equal(counts, counts_ref) and counts.sum() == 5 * top_k


@pytest.mark.parametrize("scoring,bias,n_group,topk_group", [
    ("sigmoid", True, 4, 2),  # DeepSeek-V3: groups scored by their best two biased scores
    ("sigmoid", True, 1, 1),  # Kimi K2, Moonlight: one group
    ("softmax", False, 4, 3),  # DeepSeek-V2: groups scored by their best
], ids=["v3", "one-group", "v2"])
def test_grouped_route_kernel_matches_reference(scoring, bias, n_group, topk_group, device):
    from services.worker.kernels import moe_route

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(7, 16, generator=g).to(device)
    b = (torch.randn(16, generator=g) * 0.5).to(device) if bias else None
    counts, counts_ref = (torch.zeros(16, dtype=torch.int64, device=device) for _ in range(2))
    weights, ids = moe_route.route(logits, 3, scoring == "sigmoid", counts, scoring, b, n_group, topk_group, 2.5)
    want_w, want_ids = moe_route.group_route_ref(logits, 3, scoring == "sigmoid", scoring, b, n_group, topk_group,
                                                 2.5, counts_ref)
    assert torch.equal(ids, want_ids)
    assert torch.allclose(weights, want_w, rtol=1e-6, atol=1e-7)
    assert torch.equal(counts, counts_ref)
    if n_group > 1:  # every choice within the kept groups
        assert all(len({int(e) // 4 for e in row}) <= topk_group for row in ids)


def test_llama4_route_picks_by_logits_and_weighs_by_sigmoid(device):
    """Llama 4's router (sigmoid, no bias, top-1) as transformers': the largest logit, even where fp32's
    sigmoid rounds two of them to 1.0 (row 0: experts 1 and 4); the weight is its sigmoid."""
    from services.worker.kernels import moe_route

    logits = torch.randn(6, 5, device=device)
    logits[0, 1], logits[0, 4] = 40.0, 50.0
    weights, ids = moe_route.route(logits, 1, False, None, "sigmoid")
    want_w, want_ids = moe_route.group_route_ref(logits, 1, False, "sigmoid", None, 1, 1, 1.0)
    assert torch.equal(ids, want_ids) and torch.equal(want_ids[:, 0].long(), logits.argmax(-1))
    assert int(ids[0, 0]) == 4
    assert torch.allclose(weights, want_w, rtol=1e-6, atol=1e-7)
    assert torch.equal(want_w[:, 0], torch.sigmoid(logits.max(-1).values))
