"""MLA's absorbed decode: the Triton kernel (split-KV, several heads a program) vs mla_decode_ref."""

from __future__ import annotations

import pytest
import torch
from kernel_checks import TOL, rel_err

from services.worker.kernels import mla_decode as K


def _case(lens, heads, lora, rope, page, dtype, device, cache_dtype=None, spare_blocks=3):
    """q [B, H, lora + rope] and a latent cache whose blocks are handed out in shuffled order; every
    slot no sequence owns is NaN and unused table entries point past the pool, so a kernel that
    reads one fails."""
    width = lora + rope
    need = [-(-n // page) for n in lens]
    order = torch.randperm(sum(need) + spare_blocks).tolist()
    cache = torch.full((len(order), page, 1, width), float("nan"), dtype=dtype)
    tables = torch.full((len(lens), max(1, max(need))), 1 << 30, dtype=torch.int32)
    for b, n in enumerate(lens):
        ids = torch.tensor([order.pop() for _ in range(need[b])], dtype=torch.long)
        tables[b, : need[b]] = ids.int()
        pos = torch.arange(n)
        cache[ids[pos // page], pos % page, 0] = torch.randn(n, width).to(dtype)
    if cache_dtype is not None:
        cache = cache.to(cache_dtype)  # NaN poison stays NaN in fp8
    q = torch.randn(len(lens), heads, width).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    return q.to(device), cache.to(device), tables.to(device), seq_lens.to(device)


CASES = [
    # lens, heads, lora, rope, page
    ([1, 17, 40], 16, 32, 8, 16),  # H = BLOCK_H
    ([5, 70, 0, 33], 4, 32, 8, 8),  # H < BLOCK_H, a padding row, a sequence over 9 blocks
    ([3, 100], 20, 24, 8, 16),  # H > BLOCK_H (a partial second head block), lora not a power of 2
    ([47], 32, 64, 16, 32),  # two full head blocks
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lens,heads,lora,rope,page", CASES)
def test_triton_matches_reference(dtype, lens, heads, lora, rope, page, device):
    q, cache, tables, seq_lens = _case(lens, heads, lora, rope, page, dtype, device)
    scale = (lora + rope) ** -0.5
    ref = K.mla_decode_ref(q, cache, tables, seq_lens, scale, lora)
    out = K.mla_decode(q, cache, tables, seq_lens, scale, lora, max_seq_len=max(lens))
    assert out.shape == (len(lens), heads, lora) and out.dtype == dtype
    assert rel_err(out, ref) <= TOL[dtype]


@pytest.mark.parametrize("num_splits", [1, 2, 3, 8])
def test_any_split_count_gives_the_same_answer(num_splits, device):
    lens = [1, 20, 75, 129]  # short sequences leave some splits empty
    q, cache, tables, seq_lens = _case(lens, 20, 32, 8, 16, torch.float32, device)
    ref = K.mla_decode_ref(q, cache, tables, seq_lens, 0.125, 32)
    out = K.mla_decode(q, cache, tables, seq_lens, 0.125, 32, max_seq_len=129, num_splits=num_splits)
    assert rel_err(out, ref) <= TOL[torch.float32]


def test_padding_rows_with_no_context_give_zeros(device):
    """A CUDA-graph bucket pads the batch with seq_len 0 rows: exact zeros, not NaN."""
    q, cache, tables, _ = _case([24, 24, 24], 4, 32, 8, 16, torch.float32, device)
    seq_lens = torch.tensor([24, 0, 7], dtype=torch.int32, device=device)
    for splits in (1, 4):
        out = K.mla_decode(q, cache, tables, seq_lens, 0.2, 32, max_seq_len=24, num_splits=splits)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        assert rel_err(out, K.mla_decode_ref(q, cache, tables, seq_lens, 0.2, 32)) <= TOL[torch.float32]


def test_fp8_cache_matches_reference(device):
    """An unscaled e4m3 cache is widened for the dots: the kernel agrees with the reference on the
    same fp8 values, and both stay near attention over the unrounded bf16 values."""
    lens = [5, 70, 0, 33]
    q, cache, tables, seq_lens = _case(lens, 20, 24, 8, 16, torch.bfloat16, device)
    cache8 = cache.to(torch.float8_e4m3fn)
    ref = K.mla_decode_ref(q, cache8, tables, seq_lens, 0.15, 24)
    out = K.mla_decode(q, cache8, tables, seq_lens, 0.15, 24, max_seq_len=70, num_splits=2)
    assert out.dtype == torch.bfloat16 and rel_err(out, ref) <= TOL[torch.bfloat16]
    assert rel_err(ref, K.mla_decode_ref(q, cache, tables, seq_lens, 0.15, 24)) <= 0.08


@pytest.mark.parametrize("num_splits", [1, 3])
def test_writes_into_a_strided_out_and_nothing_else(num_splits, device):
    """out may be a view into a larger buffer (rows and heads strided): only its elements change."""
    lens = [9, 50]
    q, cache, tables, seq_lens = _case(lens, 4, 32, 8, 8, torch.bfloat16, device)
    buf = torch.full((3, 6, 40), 7.0, dtype=torch.bfloat16, device=device)
    view = buf[::2, 1:5, 4:36]  # [2, 4, 32], strides (480, 40, 1)
    got = K.mla_decode(q, cache, tables, seq_lens, 0.2, 32, max_seq_len=50, out=view, num_splits=num_splits)
    assert got.data_ptr() == view.data_ptr()
    assert rel_err(view, K.mla_decode_ref(q, cache, tables, seq_lens, 0.2, 32)) <= TOL[torch.bfloat16]
    untouched = torch.ones_like(buf, dtype=torch.bool)
    untouched[::2, 1:5, 4:36] = False
    assert bool((buf[untouched] == 7.0).all())


def test_cache_is_read_only(device):
    q, cache, tables, seq_lens = _case([18, 33], 4, 32, 8, 16, torch.float32, device)
    before = cache.clone()
    K.mla_decode(q, cache, tables, seq_lens, 0.2, 32, max_seq_len=33, num_splits=2)
    assert torch.equal(cache.nan_to_num(1e9), before.nan_to_num(1e9))


def test_num_splits_choice_is_from_shapes_only():
    """The grid fills one wave of 264 resident programs (2 a SM on 132 SMs) and never passes it."""
    assert K.choose_num_splits(64, 1, 4096) == 4  # 256 programs
    assert K.choose_num_splits(32, 1, 8192) == 8
    assert K.choose_num_splits(256, 1, 1024) == 1
    assert K.choose_num_splits(64, 8, 4096) == 1  # 128 heads: 512 programs already
    assert K.choose_num_splits(1, 1, 4096) == K._MAX_SPLITS
    assert K.choose_num_splits(1, 1, 100) == 1  # too short to split
    assert K.choose_num_splits(4, 8, 0) == 1


def test_rejects_bad_arguments(device):
    q, cache, tables, seq_lens = _case([5, 9], 4, 32, 8, 16, torch.float32, device)
    call = K.mla_decode
    with pytest.raises(ValueError, match="cache"):
        call(q, cache[..., :36], tables, seq_lens, 0.2, 32, 9)  # row width is not lora + rope
    with pytest.raises(ValueError, match="cache"):
        call(q, cache.to(torch.bfloat16), tables, seq_lens, 0.2, 32, 9)  # neither q's dtype nor fp8
    with pytest.raises(ValueError, match="lora_rank"):
        call(q, cache, tables, seq_lens, 0.2, 40, 9)
    with pytest.raises(ValueError, match="block_tables"):
        call(q, cache, tables.long(), seq_lens, 0.2, 32, 9)
    with pytest.raises(ValueError, match="seq_lens"):
        call(q, cache, tables, seq_lens[:1], 0.2, 32, 9)
    with pytest.raises(ValueError, match="q"):
        call(q.to(torch.int32), cache, tables, seq_lens, 0.2, 32, 9)
    with pytest.raises(ValueError, match="out"):
        call(q, cache, tables, seq_lens, 0.2, 32, 9, out=torch.empty(2, 4, 40, device=device))
    with pytest.raises(ValueError, match="out"):
        call(q, cache, tables, seq_lens, 0.2, 32, 9, out=torch.empty(2, 4, 32, dtype=torch.bfloat16, device=device))
