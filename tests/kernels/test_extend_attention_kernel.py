"""Paged extend (prefill) attention: reference vs dense causal attention, Triton vs reference."""

from __future__ import annotations

import pytest
import torch
from kernel_checks import TOL, dense_causal_attention, paged_kv, poison_before_chunks, rel_err

from services.worker.kernels import decode_attention
from services.worker.kernels import extend_attention as K


def _case(lens, q_lens, hkv, group, head_dim, page, dtype, device):
    """Sequence b has lens[b] tokens of context, the last q_lens[b] of which are new."""
    k_cache, v_cache, tables, dense_k, dense_v = paged_kv(lens, hkv, head_dim, page, dtype, device)
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    q = torch.randn(qsl[-1], hkv * group, head_dim, device=device).to(dtype)
    return (q, k_cache, v_cache, tables, torch.tensor(qsl, dtype=torch.int32, device=device),
            torch.tensor(lens, dtype=torch.int32, device=device), dense_k, dense_v, qsl)


@pytest.mark.parametrize("group", [1, 4, 8])
def test_reference_matches_dense_causal_attention(group):
    lens, q_lens = [12, 40, 7, 33], [12, 9, 1, 33]  # full prefill, chunk on a prefix, decode
    q, kc, vc, tables, qsl_t, lens_t, dense_k, dense_v, qsl = _case(lens, q_lens, 2, group, 32, 16,
                                                                     torch.float32, "cpu")
    scale = 32 ** -0.5
    ref = K.paged_extend_attention_ref(q, kc, vc, tables, qsl_t, lens_t, scale)
    for b in range(len(lens)):
        want = dense_causal_attention(q[qsl[b]:qsl[b + 1]], dense_k[b], dense_v[b], scale)
        assert rel_err(ref[qsl[b]:qsl[b + 1]], want) <= 1e-6


def test_reference_matches_sdpa_for_a_plain_prefill():
    lens = [29]
    q, kc, vc, tables, qsl_t, lens_t, dense_k, dense_v, _ = _case(lens, lens, 2, 2, 32, 16, torch.float32, "cpu")
    ref = K.paged_extend_attention_ref(q, kc, vc, tables, qsl_t, lens_t, 0.3)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), dense_k[0].repeat_interleave(2, 1).transpose(0, 1),
        dense_v[0].repeat_interleave(2, 1).transpose(0, 1), is_causal=True, scale=0.3).transpose(0, 1)
    assert rel_err(ref, want) <= 1e-6


def test_all_decode_batch_matches_decode_reference():
    lens = [5, 16, 41]
    q, kc, vc, tables, qsl_t, lens_t, dense_k, dense_v, _ = _case(lens, [1, 1, 1], 2, 4, 32, 16,
                                                                   torch.float32, "cpu")
    got = K.paged_extend_attention_ref(q, kc, vc, tables, qsl_t, lens_t, 0.2)
    for b in range(3):
        want = dense_causal_attention(q[b:b + 1], dense_k[b], dense_v[b], 0.2)
        assert rel_err(got[b:b + 1], want) <= 1e-6
    assert torch.equal(got, decode_attention.paged_decode_attention_ref(q, kc, vc, tables, lens_t, 0.2))


CASES = [
    # lens, q_lens, kv heads, group, head_dim, page
    ([20, 37], [20, 5], 2, 1, 32, 16),  # prefill + chunk over a cached prefix
    ([70, 16, 9], [70, 1, 9], 1, 4, 32, 16),  # two query tiles, a decode, a short prefill
    ([45, 128], [17, 3], 1, 8, 16, 8),
    ([33], [33], 2, 2, 64, 16),
    ([1, 2], [1, 2], 2, 4, 32, 4),
    ([25, 40], [25, 6], 2, 3, 32, 16),  # a group of 3 heads, padded to 4 rows per token
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens,q_lens,hkv,group,head_dim,page", CASES)
def test_triton_matches_reference(dtype, lens, q_lens, hkv, group, head_dim, page, device):
    q, kc, vc, tables, qsl_t, lens_t, _, _, _ = _case(lens, q_lens, hkv, group, head_dim, page, dtype, device)
    scale = head_dim ** -0.5
    ref = K.paged_extend_attention_ref(q, kc, vc, tables, qsl_t, lens_t, scale)
    out = K.paged_extend_attention(q, kc, vc, tables, qsl_t, lens_t, scale, max_query_len=max(q_lens))
    assert out.shape == q.shape and out.dtype == dtype
    assert rel_err(out, ref) <= TOL[dtype]


@pytest.mark.parametrize("lens,q_lens,hkv,group,head_dim,page", CASES[:3] + CASES[5:])
def test_tiled_launch_matches_reference(lens, q_lens, hkv, group, head_dim, page, device):
    """The work-list grid a CUDA graph of a mixed step uses: padded with sequence -1 programs,
    and the same output whatever max_query_len the graph was captured with."""
    dtype = torch.bfloat16
    q, kc, vc, tables, qsl_t, lens_t, _, _, _ = _case(lens, q_lens, hkv, group, head_dim, page, dtype, device)
    scale = head_dim ** -0.5
    ref = K.paged_extend_attention_ref(q, kc, vc, tables, qsl_t, lens_t, scale)
    tiles = torch.from_numpy(K.query_tiles(q_lens, pad_to=20)).to(device=device, dtype=torch.int32)
    out = K.paged_extend_attention(q, kc, vc, tables, qsl_t, lens_t, scale, max_query_len=512, tiles=tiles)
    assert rel_err(out, ref) <= TOL[dtype]


def test_query_tiles_lists_each_sequences_token_tiles():
    tiles = K.query_tiles([20, 1, 0, 33], pad_to=9)
    assert tiles.tolist() == [[0, 0, 1, 3, 3, 3, -1, -1, -1], [0, 1, 0, 0, 1, 2, -1, -1, -1]]


def test_decode_only_batch_and_empty_sequences(device):
    """q_len 1 for every sequence works, and a sequence with no new tokens is skipped."""
    lens, q_lens = [7, 30, 16, 50], [1, 1, 0, 1]
    q, kc, vc, tables, qsl_t, lens_t, _, _, _ = _case(lens, q_lens, 2, 4, 32, 16, torch.float32, device)
    ref = K.paged_extend_attention_ref(q, kc, vc, tables, qsl_t, lens_t, 0.2)
    out = K.paged_extend_attention(q, kc, vc, tables, qsl_t, lens_t, 0.2, max_query_len=1)
    assert rel_err(out, ref) <= TOL[torch.float32]


def test_strided_q_from_fused_qkv(device):
    lens = [24, 40]
    q, kc, vc, tables, qsl_t, lens_t, _, _, _ = _case(lens, [24, 8], 2, 2, 32, 16, torch.float32, device)
    fused = torch.randn(q.shape[0], q.shape[1] * 32 + 2 * 2 * 32, device=device)
    fused[:, : q.shape[1] * 32] = q.reshape(q.shape[0], -1)
    q_view = fused[:, : q.shape[1] * 32].view(q.shape)
    assert not q_view.is_contiguous()
    out = K.paged_extend_attention(q_view, kc, vc, tables, qsl_t, lens_t, 0.2, max_query_len=24)
    assert rel_err(out, K.paged_extend_attention_ref(q, kc, vc, tables, qsl_t, lens_t, 0.2)) <= 1e-5


def test_rejects_bad_arguments(device):
    q, kc, vc, tables, qsl_t, lens_t, _, _, _ = _case([5], [5], 2, 2, 32, 16, torch.float32, device)
    with pytest.raises(ValueError, match="query_start_loc"):
        K.paged_extend_attention(q, kc, vc, tables, qsl_t[:1], lens_t, 0.2, max_query_len=5)
    with pytest.raises(ValueError, match="seq_lens"):
        K.paged_extend_attention(q, kc, vc, tables, qsl_t, lens_t.long(), 0.2, max_query_len=5)


def test_mixed_step_with_leading_decodes_split_over_both_kernels(device):
    """TritonOps.attention gives a mixed step's leading one-token rows to the decode kernel and
    the rest (a decode after a prefill chunk included) to the extend kernel: one output, as the
    reference computes it."""
    from services.worker.engine.attention_metadata import AttentionMetadata
    from services.worker.engine.ops import MIN_SPLIT_DECODE_ROWS, TritonOps

    n_dec = MIN_SPLIT_DECODE_ROWS + 2
    lens = [5 + 7 * i for i in range(n_dec)] + [40, 23, 18]
    q_lens = [1] * n_dec + [17, 23, 1]
    q, kc, vc, tables, qsl_t, lens_t, _, _, _ = _case(lens, q_lens, 2, 4, 32, 16, torch.bfloat16, device)
    tiles = torch.from_numpy(K.query_tiles(q_lens)).to(device=device, dtype=torch.int32)
    meta = AttentionMetadata(slot_mapping=torch.zeros(0), block_tables=tables, seq_lens=lens_t,
                             query_start_loc=qsl_t, max_query_len=23, max_seq_len=max(lens), tiles=tiles,
                             decode_rows=n_dec)
    out = TritonOps().attention(q, kc, vc, meta, 0.2)
    assert rel_err(out, K.paged_extend_attention_ref(q, kc, vc, tables, qsl_t, lens_t, 0.2)) <= TOL[torch.bfloat16]


@pytest.mark.parametrize("lens,q_lens,hkv,group,head_dim,page", CASES[:2])
def test_fp8_cache_matches_reference(lens, q_lens, hkv, group, head_dim, page, device):
    q, kc, vc, tables, qsl_t, lens_t, _, _, _ = _case(lens, q_lens, hkv, group, head_dim, page, torch.bfloat16, device)
    kc8, vc8 = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
    scale = head_dim ** -0.5
    ref = K.paged_extend_attention_ref(q, kc8, vc8, tables, qsl_t, lens_t, scale)
    tiles = torch.from_numpy(K.query_tiles(q_lens)).to(device=device, dtype=torch.int32)
    out = K.paged_extend_attention(q, kc8, vc8, tables, qsl_t, lens_t, scale, max_query_len=max(q_lens), tiles=tiles)
    assert out.dtype == torch.bfloat16 and rel_err(out, ref) <= TOL[torch.bfloat16]
    assert rel_err(ref, K.paged_extend_attention_ref(q, kc, vc, tables, qsl_t, lens_t, scale)) <= 0.08


CHUNK_CASES = [
    # lens, q_lens, kv heads, group, head_dim, page, chunk: prompts over several chunks, a chunk on a
    # cached prefix that starts mid-chunk, a decode, a chunk longer than some contexts
    ([45, 37, 20], [45, 10, 1], 2, 2, 32, 8, 16),
    ([70, 9], [30, 9], 1, 4, 16, 16, 24),
]


def test_chunked_reference_matches_dense_chunked_attention():
    lens, q_lens, hkv, group, head_dim, page, chunk = CHUNK_CASES[0]
    q, kc, vc, tables, qsl_t, lens_t, dense_k, dense_v, qsl = _case(lens, q_lens, hkv, group, head_dim, page,
                                                                     torch.float32, "cpu")
    ref = K.paged_extend_attention_ref(q, kc, vc, tables, qsl_t, lens_t, 0.2, chunk=chunk)
    for b in range(len(lens)):
        want = dense_causal_attention(q[qsl[b]:qsl[b + 1]], dense_k[b], dense_v[b], 0.2, chunk)
        assert rel_err(ref[qsl[b]:qsl[b + 1]], want) <= 1e-6
    assert rel_err(ref, K.paged_extend_attention_ref(q, kc, vc, tables, qsl_t, lens_t, 0.2)) > 0.1


@pytest.mark.parametrize("tiled", [False, True], ids=["grid", "tiled"])
@pytest.mark.parametrize("lens,q_lens,hkv,group,head_dim,page,chunk", CHUNK_CASES)
def test_chunked_triton_matches_reference_and_skips_earlier_keys(lens, q_lens, hkv, group, head_dim, page, chunk,
                                                                 tiled, device):
    """Llama 4's chunked local attention: each row within its chunk (tiles straddling a chunk's
    border included); the keys before the first query's chunk are never read (NaN there stays out)."""
    dtype = torch.bfloat16 if tiled else torch.float32
    q, kc, vc, tables, qsl_t, lens_t, _, _, _ = _case(lens, q_lens, hkv, group, head_dim, page, dtype, device)
    ref = K.paged_extend_attention_ref(q, kc, vc, tables, qsl_t, lens_t, 0.2, chunk=chunk)
    poison_before_chunks(vc, tables, [n - m for n, m in zip(lens, q_lens)], chunk, page)
    tiles = torch.from_numpy(K.query_tiles(q_lens)).to(device=device, dtype=torch.int32) if tiled else None
    out = K.paged_extend_attention(q, kc, vc, tables, qsl_t, lens_t, 0.2, max_query_len=max(q_lens), tiles=tiles,
                                   chunk=chunk)
    assert rel_err(out, ref) <= TOL[dtype]
