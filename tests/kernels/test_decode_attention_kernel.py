"""Paged decode attention: reference vs dense attention, Triton (split-KV) vs reference."""

from __future__ import annotations

import pytest
import torch
from kernel_checks import TOL, dense_causal_attention, paged_kv, poison_before_chunks, rel_err

from services.worker.kernels import decode_attention as K


def _case(lens, hkv, group, head_dim, page, dtype, device):
    k_cache, v_cache, tables, dense_k, dense_v = paged_kv(lens, hkv, head_dim, page, dtype, device)
    q = torch.randn(len(lens), hkv * group, head_dim, device=device).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, tables, seq_lens, dense_k, dense_v


@pytest.mark.parametrize("group", [1, 4, 8])
def test_reference_matches_dense_attention(group):
    lens = [1, 16, 29, 50]
    q, kc, vc, tables, seq_lens, dense_k, dense_v = _case(lens, 2, group, 32, 16, torch.float32, "cpu")
    scale = 32 ** -0.5
    ref = K.paged_decode_attention_ref(q, kc, vc, tables, seq_lens, scale)
    for b, n in enumerate(lens):
        want = dense_causal_attention(q[b:b + 1], dense_k[b], dense_v[b], scale)[0]
        assert rel_err(ref[b], want) <= 1e-6


CASES = [
    # lens, kv heads, group, head_dim, page
    ([1, 17, 40], 2, 1, 32, 16),
    ([5, 33, 64, 130], 2, 4, 64, 16),
    ([3, 100], 1, 8, 16, 16),
    ([9, 70], 2, 4, 32, 8),
    ([47], 4, 2, 32, 32),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens,hkv,group,head_dim,page", CASES)
def test_triton_matches_reference(dtype, lens, hkv, group, head_dim, page, device):
    q, kc, vc, tables, seq_lens, _, _ = _case(lens, hkv, group, head_dim, page, dtype, device)
    scale = head_dim ** -0.5
    ref = K.paged_decode_attention_ref(q, kc, vc, tables, seq_lens, scale)
    out = K.paged_decode_attention(q, kc, vc, tables, seq_lens, scale, max_seq_len=max(lens))
    assert out.shape == q.shape and out.dtype == dtype
    assert rel_err(out, ref) <= TOL[dtype]


@pytest.mark.parametrize("num_splits", [1, 2, 3, 8])
def test_any_split_count_gives_the_same_answer(num_splits, device):
    lens = [1, 20, 75, 129]  # short sequences leave some splits empty
    q, kc, vc, tables, seq_lens, _, _ = _case(lens, 2, 4, 32, 16, torch.float32, device)
    ref = K.paged_decode_attention_ref(q, kc, vc, tables, seq_lens, 0.125)
    out = K.paged_decode_attention(q, kc, vc, tables, seq_lens, 0.125, num_splits=num_splits)
    assert rel_err(out, ref) <= TOL[torch.float32]


def test_padding_rows_with_no_context_give_zeros(device):
    """A CUDA-graph bucket pads the batch with seq_len 0 rows: finite zeros, not NaN."""
    q, kc, vc, tables, _, _, _ = _case([24, 24, 24], 2, 2, 32, 16, torch.float32, device)
    seq_lens = torch.tensor([24, 0, 7], dtype=torch.int32, device=device)
    for splits in (1, 4):
        out = K.paged_decode_attention(q, kc, vc, tables, seq_lens, 0.2, num_splits=splits)
        ref = K.paged_decode_attention_ref(q, kc, vc, tables, seq_lens, 0.2)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        assert rel_err(out, ref) <= TOL[torch.float32]


def test_caches_are_read_only(device):
    q, kc, vc, tables, seq_lens, _, _ = _case([18, 33], 2, 4, 32, 16, torch.float32, device)
    kc0, vc0 = kc.clone(), vc.clone()
    K.paged_decode_attention(q, kc, vc, tables, seq_lens, 0.2, num_splits=2)
    assert torch.equal(kc.nan_to_num(1e9), kc0.nan_to_num(1e9))
    assert torch.equal(vc.nan_to_num(1e9), vc0.nan_to_num(1e9))


def test_num_splits_choice_is_from_shapes_only():
    assert K.choose_num_splits(1, 8, 384) == 6
    assert K.choose_num_splits(64, 8, 512) == 1
    assert K.choose_num_splits(256, 8, 512) == 1
    assert K.choose_num_splits(8, 8, 8192) == 5
    assert K.choose_num_splits(1, 8, 1) == 1
    assert 1 <= K.choose_num_splits(1, 1, 10**6) <= 64


def test_rejects_bad_arguments(device):
    q, kc, vc, tables, seq_lens, _, _ = _case([5], 2, 2, 32, 16, torch.float32, device)
    with pytest.raises(ValueError, match="multiple"):
        K.paged_decode_attention(q[:, :3], kc, vc, tables, seq_lens, 0.2)
    with pytest.raises(ValueError, match="block_tables"):
        K.paged_decode_attention(q, kc, vc, tables.long(), seq_lens, 0.2)
    with pytest.raises(ValueError, match="k_cache"):
        K.paged_decode_attention(q, kc.to(torch.bfloat16), vc, tables, seq_lens, 0.2)


@pytest.mark.parametrize("lens,hkv,group,head_dim,page", CASES[:2])
def test_fp8_cache_matches_reference(lens, hkv, group, head_dim, page, device):
    """An fp8 (e4m3) cache is widened to q's dtype: the kernel agrees with the reference on the
    same fp8 values, and both stay near attention over the unrounded bf16 values."""
    q, kc, vc, tables, seq_lens, _, _ = _case(lens, hkv, group, head_dim, page, torch.bfloat16, device)
    kc8, vc8 = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)  # NaN poison stays NaN
    scale = head_dim ** -0.5
    ref = K.paged_decode_attention_ref(q, kc8, vc8, tables, seq_lens, scale)
    out = K.paged_decode_attention(q, kc8, vc8, tables, seq_lens, scale, max_seq_len=max(lens))
    assert out.dtype == torch.bfloat16 and rel_err(out, ref) <= TOL[torch.bfloat16]
    assert rel_err(ref, K.paged_decode_attention_ref(q, kc, vc, tables, seq_lens, scale)) <= 0.08


@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_chunked_decode_reads_only_its_chunk(num_splits, device):
    """Llama 4's chunked local attention: each sequence sees the keys of its last position's chunk
    (a chunk just begun, a full one, one shorter than the context, a padding row), split or not; the
    earlier keys are never read (NaN there stays out)."""
    lens, chunk, page = [33, 48, 17, 0, 5], 16, 8
    q, kc, vc, tables, seq_lens, dense_k, dense_v = _case(lens, 2, 4, 32, page, torch.float32, device)
    ref = K.paged_decode_attention_ref(q, kc, vc, tables, seq_lens, 0.2, chunk=chunk)
    for b, n in enumerate(lens):
        if n:
            want = dense_causal_attention(q[b:b + 1], dense_k[b], dense_v[b], 0.2, chunk)[0]
            assert rel_err(ref[b], want) <= 1e-6
    poison_before_chunks(vc, tables, [max(n - 1, 0) for n in lens], chunk, page)
    out = K.paged_decode_attention(q, kc, vc, tables, seq_lens, 0.2, num_splits=num_splits, max_seq_len=max(lens),
                                   chunk=chunk)
    assert rel_err(out, ref) <= TOL[torch.float32]
