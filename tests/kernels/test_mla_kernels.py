"""Latent attention's pieces: the rotary write of the latent cache (Triton, interpreted, against its
reference), and the absorbed decode against the expanded form on the same cache."""

from __future__ import annotations

import pytest
import torch

from services.worker.engine.ops import TorchOps, TritonOps
from services.worker.kernels._common import FP8_KV
from services.worker.kernels.mla_prefill import mla_prefill
from services.worker.kernels.mla_rope import mla_rope_write, mla_rope_write_ref
from services.worker.kernels.rope import rope_cos_sin_cache

HEADS, NOPE, ROPE, LORA, V = 3, 16, 8, 24, 16  # a latent width that is no power of two
PAGE = 4


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("cache_dtype", [torch.float32, FP8_KV])
def test_rope_write_matches_reference(interleave, cache_dtype):
    g = torch.Generator().manual_seed(0)
    t = 6
    proj = torch.randn(t, HEADS, NOPE + ROPE, generator=g)  # q's rotary part: a strided view, as the layer's
    compressed = torch.randn(t, LORA + ROPE, generator=g)
    latent = torch.randn(t, LORA, generator=g)
    positions = torch.tensor([0, 1, 2, 7, 30, 31])
    slots = torch.tensor([5, 6, -1, 0, 11, 2])  # one padding token
    cos_sin = rope_cos_sin_cache(ROPE, 64, 10000.0)
    caches = [torch.zeros(4, PAGE, 1, LORA + ROPE, dtype=cache_dtype) for _ in range(2)]
    want = mla_rope_write_ref(proj[..., NOPE:], compressed[:, LORA:], latent, positions, cos_sin, caches[0], slots,
                              interleave)
    got = mla_rope_write(proj[..., NOPE:], compressed[:, LORA:], latent, positions, cos_sin, caches[1], slots,
                         interleave)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(caches[1].float(), caches[0].float())
    assert caches[1].view(-1, LORA + ROPE)[2].float().abs().sum() > 0  # slot 2 written by its real token only


def _cache_and_weights(seed: int, seq_lens: list[int], n_blocks: int = 24):
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(n_blocks, PAGE, 1, LORA + ROPE, generator=g)
    kv_b = torch.randn(HEADS * (NOPE + V), LORA, generator=g) * LORA ** -0.5
    width = max(-(-n // PAGE) for n in seq_lens)
    tables = torch.stack([torch.randperm(n_blocks, generator=g)[:width] for _ in seq_lens]).to(torch.int32)
    return g, cache, kv_b, tables


@pytest.mark.parametrize("ops", [TorchOps(), TritonOps()], ids=["reference", "triton"])
def test_absorbed_decode_equals_expanded_form(ops):
    """One query a sequence over ragged contexts (one empty: a padding row) through W_UK and W_UV
    absorbed, against the expanded keys and values of the same latents."""
    seq_lens = [1, 7, 13, 0]
    g, cache, kv_b, tables = _cache_and_weights(1, seq_lens)
    n = len(seq_lens)
    q_nope = torch.randn(n, HEADS, NOPE, generator=g)
    q_rot = torch.randn(n, HEADS, ROPE, generator=g)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    scale = (NOPE + ROPE) ** -0.5
    got = ops.mla_decode(q_nope, q_rot, cache, kv_b, tables, lens, scale, max(seq_lens))
    live = [i for i, s in enumerate(seq_lens) if s]
    ones = torch.tensor([0] + [1] * len(live), dtype=torch.int32).cumsum(0, dtype=torch.int32)
    want = mla_prefill(q_nope[live], q_rot[live], cache, kv_b, tables[live], ones, lens[live], 1, max(seq_lens),
                       scale, V)
    torch.testing.assert_close(got[live], want, rtol=1e-4, atol=1e-5)
    assert not got[3].any()
