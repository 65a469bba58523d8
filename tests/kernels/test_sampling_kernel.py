"""Sampling: the hash noise, the reference's rules and statistics, Triton vs reference row for row."""

from __future__ import annotations

import pytest
import torch

from services.worker.kernels import sampling as K


def _params(n, device, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    f32 = dict(dtype=torch.float32, device=device)
    return (torch.full((n,), temperature, **f32), torch.full((n,), top_k, dtype=torch.int32, device=device),
            torch.full((n,), top_p, **f32), torch.full((n,), min_p, **f32))


def _seeds(n, device):
    return torch.randint(-(2**63), 2**63 - 1, (n,), dtype=torch.int64, device=device)


def test_noise_is_bit_identical_in_triton_and_torch(device):
    seeds = torch.cat([_seeds(5, device), torch.tensor([0, -1, 2**63 - 1], device=device)])
    offsets = torch.tensor([0, 1, 7, 2**31, 123456, 0, 5, 9], dtype=torch.int64, device=device)
    got = K.uniform_noise(seeds, offsets, 1500)
    want = K.uniform_noise_ref(seeds, offsets, 1500)
    assert torch.equal(got, want)
    assert bool((want > 0).all()) and bool((want < 1).all())


def test_noise_is_uniform_and_decorrelated():
    u = K.uniform_noise_ref(torch.tensor([42, 43]), torch.tensor([0, 0]), 200_000)
    assert abs(u.mean().item() - 0.5) < 0.005
    assert abs(u.var().item() - 1 / 12) < 0.002
    hist = torch.histc(u[0], bins=10, min=0, max=1)
    assert (hist - 20_000).abs().max().item() < 800
    assert abs(torch.corrcoef(u)[0, 1].item()) < 0.01  # neighbouring seeds
    assert abs(torch.corrcoef(torch.stack([u[0, :-1], u[0, 1:]]))[0, 1].item()) < 0.01  # neighbouring tokens


def test_noise_depends_on_seed_and_offset_only():
    a = K.uniform_noise_ref(torch.tensor([7, 7, 8]), torch.tensor([3, 4, 3]), 64)
    b = K.uniform_noise_ref(torch.tensor([7]), torch.tensor([3]), 64)
    assert torch.equal(a[0], b[0])
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[0], a[2])


def test_greedy_rows_are_exact_argmax(device):
    logits = torch.randn(6, 300, device=device)
    logits[2, 17] = logits[2, 250] = logits[2].max() + 1.0  # a tie goes to the lower index
    t, k, p, mp = _params(6, device, temperature=0.0, top_k=5, top_p=0.5, min_p=0.1)
    seeds, offsets = _seeds(6, device), torch.arange(6, device=device)
    want = logits.argmax(dim=-1)
    assert want[2].item() == 17
    assert torch.equal(K.sample_ref(logits, t, k, p, mp, seeds, offsets), want)
    assert torch.equal(K.sample(logits, t, k, p, mp, seeds, offsets), want)


def test_top_k_one_is_greedy(device):
    logits = torch.randn(5, 400, device=device) * 2
    t, k, p, mp = _params(5, device, temperature=1.3, top_k=1)
    seeds, offsets = _seeds(5, device), torch.arange(5, device=device)
    want = logits.argmax(dim=-1)
    assert torch.equal(K.sample_ref(logits, t, k, p, mp, seeds, offsets), want)
    assert torch.equal(K.sample(logits, t, k, p, mp, seeds, offsets), want)


def _mixed_batch(device, n=12, vocab=1000):
    logits = torch.randn(n, vocab, device=device) * 2.5
    logits[3, :] = logits[3, :].round()  # many exact ties around every threshold
    logits[5, 100:] = float("-inf")  # masked tokens (logit_bias / min_tokens)
    temperature = torch.tensor([1.0, 0.7, 1.5, 1.0, 0.0, 0.9, 1.0, 2.0, 0.5, 1.0, 1.0, 0.8], device=device)
    top_k = torch.tensor([0, 40, 0, 50, 3, 500, 7, 0, 1000, 999, 2, 0], dtype=torch.int32, device=device)
    top_p = torch.tensor([1.0, 1.0, 0.9, 0.8, 1.0, 0.95, 0.5, 0.3, 0.99, 1.0, 1.0, 0.7], device=device)
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.05, 0.0, 0.0, 0.0, 0.1, 0.0, 0.2, 0.0, 0.01], device=device)
    return logits[:n, :vocab], temperature[:n], top_k[:n], top_p[:n], min_p[:n]


@pytest.mark.parametrize("block_v,num_splits", [(None, None), (128, None), (64, 3)])
def test_triton_matches_reference_row_for_row(block_v, num_splits, device):
    """Default launch, small tiles (multi-tile passes, candidate compaction), a forced vocab split."""
    logits, t, k, p, mp = _mixed_batch(device)
    seeds = _seeds(len(t), device)
    for step in range(2):
        offsets = torch.full((len(t),), step, dtype=torch.int64, device=device) + torch.arange(len(t), device=device)
        want = K.sample_ref(logits, t, k, p, mp, seeds, offsets)
        got = K.sample(logits, t, k, p, mp, seeds, offsets, block_v=block_v, num_splits=num_splits)
        assert got.dtype == torch.int64
        assert torch.equal(got, want), (step, got, want)


@pytest.mark.parametrize("block_v", [None, 16])
@pytest.mark.parametrize("top_k,top_p,min_p", [(5, 1.0, 0.0), (0, 0.6, 0.0), (6, 0.8, 0.0), (0, 1.0, 0.25),
                                                 (9, 0.9, 0.1)])
def test_triton_kept_set_matches_reference_on_a_tiny_vocab(top_k, top_p, min_p, block_v, device):
    """Many draws from one row: boundary tokens win often, so a threshold off by one token shows.
    block_v=16 cuts the 24 tokens into two tiles, so the candidate compaction runs too."""
    n = 48
    row = (torch.randn(24, device=device) * 1.5).round()  # ties at the thresholds
    row[[3, 11, 20]] = row.max()  # at least three tokens survive every filter
    t, k, p, mp = _params(n, device, temperature=1.0, top_k=top_k, top_p=top_p, min_p=min_p)
    seeds = torch.full((n,), 77, dtype=torch.int64, device=device)
    offsets = torch.arange(n, device=device)
    want = K.sample_ref(row.expand(n, -1), t, k, p, mp, seeds, offsets)
    got = K.sample(row.expand(n, -1).contiguous(), t, k, p, mp, seeds, offsets, block_v=block_v)
    assert torch.equal(got, want)
    assert len(set(want.tolist())) > 1


def test_a_row_does_not_depend_on_its_batch(device):
    logits, t, k, p, mp = _mixed_batch(device)
    seeds = _seeds(len(t), device)
    offsets = torch.randint(0, 10_000, (len(t),), device=device)
    full = K.sample(logits, t, k, p, mp, seeds, offsets)
    for rows in ([3], [7, 0], [11, 5, 2]):
        idx = torch.tensor(rows, device=device)
        alone = K.sample(logits[idx], t[idx], k[idx], p[idx], mp[idx], seeds[idx], offsets[idx])
        assert torch.equal(alone, full[idx])
        assert torch.equal(K.sample_ref(logits[idx], t[idx], k[idx], p[idx], mp[idx], seeds[idx], offsets[idx]),
                           full[idx])


def test_reference_kept_sets_follow_the_rules():
    """With the noise cancelled out (many offsets), the tokens ever drawn are exactly the kept set."""
    logits = torch.tensor([[3.0, 2.0, 2.0, 1.0, 0.0, -1.0, -5.0, 2.5]])
    n = 4000

    def drawn(**kw):
        t, k, p, mp = _params(n, "cpu", **kw)
        out = K.sample_ref(logits.expand(n, -1), t, k, p, mp, torch.full((n,), 11), torch.arange(n))
        return set(out.tolist())

    assert drawn(top_k=2) == {0, 7}
    assert drawn(top_k=3) == {0, 7, 1, 2}  # ties at the k-th value are kept
    probs = torch.softmax(logits[0], -1)
    # top-p 0.5: token 0 alone has < 0.5 of the mass, tokens 0 and 7 have more.
    assert probs[0] < 0.5 < probs[0] + probs[7]
    assert drawn(top_p=0.5) == {0, 7}
    assert drawn(min_p=0.4) == {0, 7}  # p >= 0.4 * p_max  <=>  l >= 3 + log(0.4) = 2.08
    assert drawn(min_p=0.3) == {0, 7, 1, 2}  # l >= 3 + log(0.3) = 1.80
    assert drawn(top_k=4, top_p=0.99) == {0, 7, 1, 2}


def test_reference_frequencies_follow_softmax():
    logits = torch.tensor([[1.0, 0.0, -0.5, 2.0, 0.3]])
    draws = 20_000
    t, k, p, mp = _params(draws, "cpu", temperature=0.8)
    out = K.sample_ref(logits.expand(draws, -1), t, k, p, mp, torch.full((draws,), 1234), torch.arange(draws))
    freq = torch.bincount(out, minlength=5).float() / draws
    want = torch.softmax(logits[0] / 0.8, -1)
    assert (freq - want).abs().max().item() < 0.015


def test_reference_top_p_frequencies_are_renormalised():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    draws = 20_000
    t, k, p, mp = _params(draws, "cpu", top_p=0.9)
    out = K.sample_ref(logits.expand(draws, -1), t, k, p, mp, torch.full((draws,), 99), torch.arange(draws))
    freq = torch.bincount(out, minlength=4).float() / draws
    probs = torch.softmax(logits[0], -1)  # [0.64, 0.24, 0.09, 0.03]: 0.9 needs tokens 0..2
    want = torch.zeros(4)
    want[:3] = probs[:3] / probs[:3].sum()
    assert (freq - want).abs().max().item() < 0.015


def test_large_vocab_multi_tile(device):
    """5000 tokens: two 4096 tiles per pass, simple rows split over the vocabulary, kept sets both
    small enough to compact (top-k 100, top-p on peaked rows) and too large to (top-k 4500)."""
    logits = torch.randn(6, 5000, device=device) * 4
    t = torch.tensor([1.0, 0.6, 1.0, 0.0, 1.2, 1.0], device=device)
    k = torch.tensor([0, 100, 20, 0, 0, 4500], dtype=torch.int32, device=device)
    p = torch.tensor([0.9, 1.0, 0.7, 1.0, 1.0, 0.999], device=device)
    mp = torch.tensor([0.0, 0.02, 0.0, 0.0, 0.0, 0.0], device=device)
    seeds, offsets = _seeds(6, device), torch.tensor([5, 6, 7, 8, 9, 10], device=device)
    want = K.sample_ref(logits, t, k, p, mp, seeds, offsets)
    assert want[3].item() == logits[3].argmax().item()
    assert torch.equal(K.sample(logits, t, k, p, mp, seeds, offsets), want)
    assert torch.equal(K.sample(logits, t, k, p, mp, seeds, offsets, num_splits=1), want)


def test_rejects_bad_arguments(device):
    logits = torch.randn(2, 50, device=device)
    t, k, p, mp = _params(2, device)
    seeds, offsets = _seeds(2, device), torch.zeros(2, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="temperature"):
        K.sample(logits, t[:1], k, p, mp, seeds, offsets)
    with pytest.raises(ValueError, match="seeds"):
        K.sample(logits, t, k, p, mp, seeds.int(), offsets)
