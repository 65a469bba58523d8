"""Sampling: the hash noise, the reference's rules and statistics, Triton vs reference row for row."""

from __future__ import annotations

import pytest
import torch

from services.worker.kernels import sampling as K


@pytest.fixture(params=["rows", "chunks"])
def read_way(request, monkeypatch):
    """The second read both ways, for the tests whose rows reach it: the row program reads the row
    alone (large batches), or the read is split over chunks of the row (small ones,
    sampling_collect.py); which one follows the batch size and the SM count, so both are forced
    here. Rows without filters, greedy rows and chain rows (top-p or min-p without top-k, when the
    rounds run) never reach it, and a test that passes collect_splits picks the chunks itself:
    those run once, the chunked way (the default, _collects)."""
    monkeypatch.setattr(K, "_collects", lambda n_rows, device: request.param == "chunks")
    return request.param


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


def test_gumbel_noise_is_within_its_bound_of_the_exact_one(device):
    # Every u near 1 (where -log u is tiny: the series), near 1/16 below it (the switch) and the rest.
    seeds = torch.cat([_seeds(6, device), torch.tensor([0, -1], device=device)])
    offsets = torch.arange(8, dtype=torch.int64, device=device)
    got = K.gumbel_noise(seeds, offsets, 20_000)
    u = K.uniform_noise_ref(seeds, offsets, 20_000).double()
    want = -torch.log(-torch.log(u))
    assert float((got.double() - want).abs().max()) < 4e-6
    assert float((got.double() - K.gumbel_noise_ref(seeds, offsets, 20_000).double()).abs().max()) < 4e-6


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


def test_top_k_one_is_greedy(read_way, device):
    logits = torch.randn(5, 400, device=device) * 2
    t, k, p, mp = _params(5, device, temperature=1.3, top_k=1)
    seeds, offsets = _seeds(5, device), torch.arange(5, device=device)
    want = logits.argmax(dim=-1)
    assert torch.equal(K.sample_ref(logits, t, k, p, mp, seeds, offsets), want)
    assert torch.equal(K.sample(logits, t, k, p, mp, seeds, offsets), want)


def _mixed_batch(device, n=12, vocab=1000, read_way="chunks"):
    """Twelve rows, every filter and its mixes. The row program's way (read_way "rows") only changes
    the draws of rows that reach the second read, the sampled top-k rows: it takes those alone (the
    same rows as the chunked way's)."""
    logits = torch.randn(n, vocab, device=device) * 2.5
    logits[3, :] = logits[3, :].round()  # many exact ties around every threshold
    logits[5, 100:] = float("-inf")  # masked tokens (logit_bias / min_tokens)
    temperature = torch.tensor([1.0, 0.7, 1.5, 1.0, 0.0, 0.9, 1.0, 2.0, 0.5, 1.0, 1.0, 0.8], device=device)
    top_k = torch.tensor([0, 40, 0, 50, 3, 500, 7, 0, 1000, 999, 2, 0], dtype=torch.int32, device=device)
    top_p = torch.tensor([1.0, 1.0, 0.9, 0.8, 1.0, 0.95, 0.5, 0.3, 0.99, 1.0, 1.0, 0.7], device=device)
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.05, 0.0, 0.0, 0.0, 0.1, 0.0, 0.2, 0.0, 0.01], device=device)
    batch = logits[:n, :vocab], temperature[:n], top_k[:n], top_p[:n], min_p[:n]
    if read_way == "chunks":
        return batch
    top_k_rows = (batch[2] > 0) & (batch[2] < vocab) & (batch[1] > 0)
    return tuple(x[top_k_rows] for x in batch)


@pytest.mark.parametrize("block_v,num_splits", [(None, None), (128, None), (64, 3)])
def test_triton_matches_reference_row_for_row(block_v, num_splits, read_way, device):
    """Default launch, small tiles (multi-tile passes, candidate compaction), a forced vocab split."""
    logits, t, k, p, mp = _mixed_batch(device, read_way=read_way)
    seeds, offsets = _seeds(len(t), device), torch.arange(len(t), device=device)
    want = K.sample_ref(logits, t, k, p, mp, seeds, offsets)
    got = K.sample(logits, t, k, p, mp, seeds, offsets, block_v=block_v, num_splits=num_splits)
    assert got.dtype == torch.int64
    assert torch.equal(got, want), (got, want)


@pytest.mark.parametrize("block_v,num_splits", [(None, None), (64, 3)])
def test_bf16_logits_match_the_reference(block_v, num_splits, read_way, device):
    """The engine's logits are bf16 (the LM head's dtype): 8 bits of mantissa, so ties at nearly
    every threshold. The kernels widen each value as the reference does, so the draws are the same."""
    logits, t, k, p, mp = _mixed_batch(device, read_way=read_way)
    logits = logits.to(torch.bfloat16)
    seeds, offsets = _seeds(len(t), device), torch.arange(len(t), device=device)
    want = K.sample_ref(logits, t, k, p, mp, seeds, offsets)
    assert torch.equal(want, K.sample_ref(logits.float(), t, k, p, mp, seeds, offsets))
    assert torch.equal(K.sample(logits, t, k, p, mp, seeds, offsets, block_v=block_v, num_splits=num_splits), want)


def test_bf16_top_p_chain_in_rounds(device):
    """A flat bf16 row under top-p keeps far more than the buffer: the chunked rounds' chain on
    widened bf16 values, from pass 1's winner (kept: two reads; else a bound, a draw above it, ...)."""
    got, want, (reads,) = _draws(_flat(1024).to(torch.bfloat16), device, 32, 2, [(dict(top_p=0.9), (0, 4))])
    assert torch.equal(got, want)
    assert min(reads) == 2 and 3 not in reads and max(reads) >= 4


@pytest.mark.parametrize("block_v", [None, 16])
def test_triton_kept_set_matches_reference_on_a_tiny_vocab(block_v, read_way, device):
    """Many draws from one row: boundary tokens win often, so a threshold off by one token shows.
    block_v=16 cuts the 24 tokens into two tiles, so the candidate compaction runs too. Each filter
    set's draws are rows of one launch, 48 of them over the launch shapes: 12 for each of top-k's
    four (block_v and the way of the second read), 24 for each of the two of top-p alone and min-p
    alone (chain rows: they never reach the second read, and are drawn the chunked way only)."""
    row = (torch.randn(24, device=device) * 1.5).round()  # ties at the thresholds
    row[[3, 11, 20]] = row.max()  # at least three tokens survive every filter
    shape = [None, 16].index(block_v)
    cases = []  # (top_k, top_p, min_p), offsets: each shape's own share of the 48
    for f in [(5, 1.0, 0.0), (0, 0.6, 0.0), (6, 0.8, 0.0), (0, 1.0, 0.25), (9, 0.9, 0.1)]:
        if f[0] > 0:
            share = 2 * shape + ["rows", "chunks"].index(read_way)
            cases.append((f, range(12 * share, 12 * share + 12)))
        elif read_way == "chunks":
            cases.append((f, range(24 * shape, 24 * shape + 24)))
    t, k, p, mp = (torch.cat(x) for x in zip(*(_params(len(o), device, 1.0, *f) for f, o in cases)))
    seeds = torch.full((len(t),), 77, dtype=torch.int64, device=device)
    offsets = torch.tensor([i for _, o in cases for i in o], device=device)
    logits = row.expand(len(t), -1)
    want = K.sample_ref(logits, t, k, p, mp, seeds, offsets)
    got = K.sample(logits.contiguous(), t, k, p, mp, seeds, offsets, block_v=block_v)
    assert torch.equal(got, want)
    assert all(len(set(draws.tolist())) > 1 for draws in want.split([len(o) for _, o in cases]))


def test_a_row_does_not_depend_on_its_batch(read_way, device):
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


def test_large_vocab_multi_tile(read_way, device):
    """5000 tokens: three 2048 tiles per read, simple rows split over the vocabulary, kept sets both
    small enough for the buffer (top-k 100, top-p on peaked rows) and too large for it (top-k 4500)."""
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


def _draws(row, device, block_v, num_splits, cases, temperature=1.0, chain_rounds=K.CHAIN_ROUNDS, **launch):
    """Draws from one row, kernel and reference, in one launch: per case (filters, offsets), one row
    per offset (one seed: only the noise changes); also how many times the kernel read each row, per
    case. The launch shape is explicit: its default depends on the device's SM count, and a row's
    path depends on it (through pass 1's chunks). chain_rounds 0: top-p's chain runs serially in the
    row program (with its buffer finish), as top-k's does. The offsets are those whose draws take
    the paths a test names (a kept winner, a rejected one, ...): the other draws of the row repeat
    them."""
    rows = [(filters, offset) for filters, offsets in cases for offset in offsets]
    n = len(rows)
    t, k, p, mp = (torch.cat(x) for x in zip(*(_params(1, device, temperature, **f) for f, _ in rows)))
    seeds = torch.full((n,), 77, dtype=torch.int64, device=device)
    offsets = torch.tensor([offset for _, offset in rows], device=device)
    logits = row.to(device).expand(n, -1).contiguous()
    reads = torch.zeros(n, dtype=torch.int32, device=device)
    got = K.sample(logits, t, k, p, mp, seeds, offsets, block_v=block_v, num_splits=num_splits, reads=reads,
                   chain_rounds=chain_rounds, chain_block=min(block_v, 64), **launch)
    per_case = reads.split([len(offsets) for _, offsets in cases])
    return got, K.sample_ref(logits, t, k, p, mp, seeds, offsets), [r.tolist() for r in per_case]


def _peaked(vocab, seed=0):
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 2


def _flat(vocab, seed=0):
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 0.5


@pytest.mark.parametrize("num_splits", [1, 3])
def test_bound_from_pass_one_fits_the_buffer(num_splits, read_way, device):
    """The usual case: the group maxima of pass 1 bound the kept set from below tightly enough that
    one more read puts every token above the bound in the buffer (64 here), where all is exact.
    (Without rounds: with them, top-p rows without top-k take the chain from pass 1's winner.)"""
    filters = [dict(top_k=5), dict(min_p=0.3), dict(top_k=20, top_p=0.8), dict(top_k=5, top_p=0.9, min_p=0.1),
               dict(top_p=0.5, min_p=0.02)]
    got, want, reads = _draws(_peaked(1000), device, 64, num_splits, [(f, (0, 1)) for f in filters], chain_rounds=0)
    assert torch.equal(got, want)
    assert reads == [[2, 2]] * len(filters)


@pytest.mark.parametrize("chain_rounds", [0, K.CHAIN_ROUNDS, 1])
def test_chain_of_gumbel_winners_on_flat_rows(chain_rounds, read_way, device):
    """Flat rows keep far more than the buffer: the bound's set yields its Gumbel winner, accepted
    (3 reads) or rejected, and the next read checks the winner above it (tiles both dense and sparse
    in the set, so noise is drawn in place and through the buffer, with refills). Top-p's links run in
    the row program (chain_rounds 0), in one round and then serially for the rows it left pending,
    or, from pass 1's winner (chain rows, from two rounds on: its first link is a round, so a kept
    one takes two reads), in chunked rounds: the same draws. (Pass 1's four samples a lane bound these
    sets closely enough that most chains end at their first link; top-p 0.9 still needs two, at offset
    4, as do chain rows at offset 4.) Top-k's chain is the same whatever the rounds (they leave it
    to the serial chain): drawn with the default rounds. Chain rows never reach the second read:
    drawn the chunked way only. (Top-p 0.9 as a chain row: test_bf16_top_p_chain_in_rounds.)"""
    if chain_rounds == 0:
        cases = [(dict(top_p=0.9), (0, 4), 4), (dict(top_p=0.3), (0,), 3), (dict(min_p=0.1, top_p=0.3), (0,), 3)]
    elif chain_rounds == 1:  # a kept candidate, and one rejected in the round, which the finish ends
        cases = [(dict(top_p=0.9), (0, 4), 4), (dict(min_p=0.1, top_p=0.3), (0,), 3)]
    else:
        cases = [(dict(top_k=150), (0,), 3)] + (
            [(dict(top_p=0.3), (0, 4), 3), (dict(min_p=0.1, top_p=0.3), (0, 4), 3)] if read_way == "chunks" else [])
    got, want, reads = _draws(_flat(1024), device, 32, 2, [c[:2] for c in cases], chain_rounds=chain_rounds)
    assert torch.equal(got, want)
    for (filters, _, longest), r in zip(cases, reads):
        chain_row = chain_rounds >= 2 and "top_k" not in filters
        assert min(r) == (2 if chain_row else 3) and max(r) >= longest, (filters, r)


_TEN_ABOVE = torch.full((512,), -3.0)
_TEN_ABOVE[1:41] = 1.5
_TEN_ABOVE[0:160:16] = 3.0


def test_chain_ends_in_the_buffer_after_rejections(read_way, device):
    """Ten tokens at +3, all in one lane (pass 1's group maxima see one of them), 38 at +1.5 and the
    rest at -3: top-p 0.4 keeps the ten, but neither bound from pass 1 excludes the 38 (the groups
    hold too little mass; the -3s, not the +1.5s, fall below m + log((1 - p) Z / V)). A winner at +1.5
    (about half of the draws) is rejected, and the ten above it fit: the buffer finishes the row."""
    got, want, (reads,) = _draws(_TEN_ABOVE, device, 16, 1, [(dict(top_p=0.4), (0, 1, 4, 5))], chain_rounds=0)
    assert torch.equal(got, want)
    assert set(want.tolist()) <= set(range(0, 160, 16)) and len(set(want.tolist())) > 3
    assert reads == [3] * 4


def test_chain_of_rounds_needs_no_buffer(device):
    """The row of test_chain_ends_in_the_buffer_after_rejections in chunked rounds: there is no buffer,
    nor a scan: pass 1's winner is kept (2 reads) or leaves a bound, the next round draws above it and
    the one after weighs that winner (4, or 5 after a winner at +1.5): more reads, never a wrong draw."""
    got, want, (reads,) = _draws(_TEN_ABOVE, device, 16, 1, [(dict(top_p=0.4), (0, 6))])
    assert torch.equal(got, want) and set(reads) <= {2, 4, 5} and len(set(reads)) == 2


def test_loose_min_p_is_the_only_filter(read_way, device):
    """min-p alone keeping more than the buffer: its set is exact from the first scan, so that scan's
    Gumbel winner is the draw, with no read to check it."""
    got, want, reads = _draws(_flat(1024), device, 32, 2, [(dict(min_p=0.2), (0, 1))], chain_rounds=0)
    assert torch.equal(got, want)
    assert reads == [[2, 2]]


def test_loose_min_p_as_a_chain_row(device):
    """As a chain row (with rounds), min-p alone: pass 1's winner is the draw where it passes min-p
    (one read), else the first round's winner above it (two)."""
    got, want, (reads,) = _draws(_flat(1024), device, 32, 2, [(dict(min_p=0.2), (0, 1))])
    assert torch.equal(got, want)
    assert set(reads) == {1, 2}


@pytest.mark.parametrize("vocab,block_v", [(1024, 32), (256, 16)])
def test_top_k_with_top_p_beyond_the_bound(vocab, block_v, read_way, device):
    """Top-k and top-p with a top-k set the bounds leave larger than the buffer: 30 tokens just above
    40 others, all in one bin of pass 1's grid, so both bounds lie at or below the 40. t_k by
    bisection over the row, until the set fits (k 30 <= 32 tokens) or exactly (k 30 > 16), then the
    chain for top-p."""
    row = _peaked(vocab) - 8
    at = torch.randperm(vocab, generator=torch.Generator().manual_seed(1))[:70]
    row[at[:30]] = 2.1 + torch.arange(30) * 1e-3
    row[at[30:]] = 2.01
    got, want, (reads,) = _draws(row, device, block_v, 1, [(dict(top_k=30, top_p=0.8), (0, 1))])
    assert torch.equal(got, want)
    assert min(reads) > 3


def _spiked(vocab, spikes, boost, seed=0):
    """The benchmark's rows (bench/gpu_kernels.py): randn * 2 with a few tokens lifted by boost."""
    g = torch.Generator().manual_seed(seed)
    row = torch.randn(vocab, generator=g) * 2
    row[torch.randperm(vocab, generator=g)[:spikes]] += boost
    return row


def test_top_p_set_larger_than_the_buffer_splits_at_hi(read_way, device):
    """Top-p keeping 182 tokens, a buffer of 64: pass 1's grid (8 chunks of 64 lanes, 1,024 samples)
    bounds the threshold within a band of about 32 samples, the scan keeps the band and only draws
    the tokens above it, and their mass tells that every one of them is kept: one scan. So with
    min-p 1e-4 beside it (rows of the same launch)."""
    cases = [(dict(top_p=0.9, min_p=min_p), (0, 2, 3, 4)) for min_p in (0.0, 1e-4)]
    got, want, reads = _draws(_spiked(4096, 8, 6.0), device, 64, 8, cases, temperature=0.8, chain_rounds=0)
    assert torch.equal(got, want)
    assert reads == [[2] * 4] * 2
    assert all(len(set(draws.tolist())) > 3 for draws in want.split(4))


def test_split_below_the_threshold_falls_back_to_the_chain(read_way, device):
    """128 tokens tied at 7.999, two in each lane: the lanes' second ones count in the grid at their
    bin's lower edge, 7.875, so the samples reach p of the mass only far down, and hi falls below
    the tied tokens. The drawn tokens then hold more than p * Z: the scan's winner over the whole set
    starts the chain, and one more read accepts it."""
    row = _peaked(4096)
    lanes = torch.arange(64)
    row[torch.cat([lanes, lanes + 64])] = 7.999
    got, want, reads = _draws(row, device, 64, 8, [(dict(top_p=0.9), (0, 1))], chain_rounds=0)
    assert torch.equal(got, want)
    assert reads == [[3, 3]]


def test_mixed_batch_at_full_vocabulary(device):
    """The benchmark's mixed batch (greedy, top-k 40, top-p 0.9, min-p 0.1 in turn; V = 128,256 with
    64 tokens lifted by 8; 3 chunks per row, as at B = 256 on an H100): every row in two reads at
    most but top-p's (chain rows, as min-p's: two where pass 1's winner is kept), whose kept sets
    outgrow the buffer (2,048) in two rows. Drawn the way serving draws (the chunked second read),
    one row of each kind and the top-p rows with the two largest sets: the batch's other rows take
    the same paths."""
    n, vocab = 16, 128_256
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(n, vocab, generator=g) * 2.0
    logits[:, torch.randperm(vocab, generator=g)[:64]] += 8.0
    mass = torch.softmax(logits[2::4].double() / 0.8, -1).sort(-1, descending=True).values.cumsum(-1)
    assert ((mass < 0.9).sum(-1) + 1).tolist() == [94, 1848, 228, 2958]  # the top-p rows' kept sets
    t, k, p, mp = _params(n, "cpu", temperature=0.8)
    t[0::4] = 0.0
    k[1::4] = 40
    p[2::4] = 0.9
    mp[3::4] = 0.1
    rows = torch.tensor([0, 1, 6, 14, 3])  # greedy, top-k, top-p (1,848 and 2,958 kept), min-p
    args = [x[rows].to(device) for x in (logits, t, k, p, mp, _seeds(n, "cpu"), torch.arange(n))]
    reads = torch.zeros(len(rows), dtype=torch.int32, device=device)
    got = K.sample(*args, num_splits=3, reads=reads)
    assert torch.equal(got, K.sample_ref(*args))
    assert reads.tolist()[:2] == [1, 2]
    assert min(reads.tolist()[2:4]) == 2 and reads[4].item() in (1, 2)  # chain rows: top-p, min-p


@pytest.mark.parametrize("collect_splits", [2, 4])
def test_chunked_read_in_small_regions(collect_splits, device):
    """The chunked read with regions of 32 and 16 tokens (block_v 64): chunks whose part of C outgrows
    their region lower their own cut, draw in place what their far end cannot hold, and the merge
    draws what regions kept above the row's cut; every path of the serial scan's draws is kept.
    The mixed batch's rows that reach that read (top-k; the others end before it or are chain rows)
    on its own logits, on a flat row and on a spiked one."""
    logits, t, k, p, mp = _mixed_batch(device)
    top_k = torch.tensor([1, 3, 5, 6, 9, 10], device=device)
    assert ((k[top_k] > 0) & (k[top_k] < 1000) & (t[top_k] > 0)).all()
    params = [x[top_k] for x in (t, k, p, mp)]
    seeds, offsets = _seeds(len(top_k), device), torch.arange(len(top_k), device=device)
    for x in (logits[top_k], _flat(1000).expand(len(top_k), -1), _spiked(1000, 8, 6.0).expand(len(top_k), -1)):
        x = x.to(device).contiguous()
        got = K.sample(x, *params, seeds, offsets, block_v=64, num_splits=2, collect_splits=collect_splits)
        assert torch.equal(got, K.sample_ref(x, *params, seeds, offsets))


def test_large_buffer_finish(read_way, device):
    """More than 256 tokens in the buffer: the finish runs on the full tile, not the small one."""
    got, want, reads = _draws(_peaked(2048), device, 512, 2, [(dict(top_k=300, top_p=0.95), (0, 1))])
    assert torch.equal(got, want)
    assert reads == [[2, 2]]


def test_ties_and_masked_tokens_in_the_chain(read_way, device):
    """Logits rounded to a few values (ties at every bound: counts and masses are of tokens strictly
    above a winner) and a third of the vocabulary at -inf (never in a set, never drawn). Top-p alone
    (a chain row: drawn the chunked way only) at a draw whose chain is long."""
    row = (_flat(768) * 4).round() / 2
    row[::3] = float("-inf")
    cases = [(dict(top_p=0.5), (0, 5)), (dict(top_k=40), (0,)), (dict(top_k=70, top_p=0.7, min_p=0.05), (0,))]
    cases = [c for c in cases if read_way == "chunks" or "top_k" in c[0]]
    got, want, reads = _draws(row, device, 32, 2, cases)
    assert torch.equal(got, want)
    assert all(max(r) >= 3 for r in reads), reads


def test_batch_of_every_path(read_way, device):
    """Rows taking every path in one launch (plain, greedy, the bound, the chain, the t_k bisection),
    each equal to the reference and to the same row drawn alone."""
    rows = torch.stack([_peaked(1024, 1), _peaked(1024, 2), _flat(1024, 3), _flat(1024, 4), _peaked(1024, 5),
                        _flat(1024, 6)]).to(device)
    t = torch.tensor([1.0, 0.0, 0.7, 1.3, 1.0, 1.0], device=device)
    k = torch.tensor([0, 5, 0, 100, 30, 0], dtype=torch.int32, device=device)
    p = torch.tensor([1.0, 0.5, 0.9, 1.0, 0.8, 1.0], device=device)
    mp = torch.tensor([0.0, 0.1, 0.0, 0.0, 0.0, 0.3], device=device)
    seeds, offsets = _seeds(6, device), torch.arange(6, device=device)
    reads = torch.zeros(6, dtype=torch.int32, device=device)
    got = K.sample(rows, t, k, p, mp, seeds, offsets, block_v=32, num_splits=2, reads=reads)
    assert torch.equal(got, K.sample_ref(rows, t, k, p, mp, seeds, offsets))
    # Row 5 (min-p alone) is a chain row: pass 1's winner is its draw where it passes min-p.
    assert reads[:2].tolist() == [1, 1] and min(reads[2:5].tolist()) >= 2 and reads[4].item() > 3
    assert reads[5].item() in (1, 2)
    # The row program's way differs only for the rows that reach the second read (top-k).
    for i in [i for i in range(6) if read_way == "chunks" or (t[i] > 0 and k[i] > 0)]:
        one = slice(i, i + 1)
        assert torch.equal(K.sample(rows[one], t[one], k[one], p[one], mp[one], seeds[one], offsets[one],
                                    block_v=32, num_splits=2), got[one])


def test_rejects_bad_arguments(device):
    logits = torch.randn(2, 50, device=device)
    t, k, p, mp = _params(2, device)
    seeds, offsets = _seeds(2, device), torch.zeros(2, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="temperature"):
        K.sample(logits, t[:1], k, p, mp, seeds, offsets)
    with pytest.raises(ValueError, match="seeds"):
        K.sample(logits, t, k, p, mp, seeds.int(), offsets)
    with pytest.raises(ValueError, match="reads"):
        K.sample(logits, t, k, p, mp, seeds, offsets, reads=torch.zeros(2, dtype=torch.int64, device=device))


@pytest.mark.parametrize("vocab,block_v", [(128256, None), (49152, None), (1000, 16), (100, None)])
def test_launch_shape_follows_the_vocabulary_not_the_batch(vocab, block_v, monkeypatch):
    """Every batch size launches with the same row-program constants, and they hold its chunks and
    lane-group maxima; warm_row_counts reaches every pass-1 variant (lane-group class) up to max_rows."""
    monkeypatch.setattr(K, "_num_sms", lambda device: 132)  # an H100's spread of chunk counts
    bv = K._block_v(vocab, block_v)
    split_block, block_s, block_u, grid_s = K.launch_constants(vocab, bv)
    classes = set()
    for n in range(1, 1025):
        chunk, ns = K._chunking(vocab, K._num_splits(vocab, n, split_block, torch.device("cpu")), split_block)
        assert chunk % split_block == 0 and ns * chunk >= vocab > (ns - 1) * chunk
        assert ns <= block_s and ns * K._lane_groups(ns, split_block) <= block_u and grid_s <= block_s
        classes.add(K._lane_groups(ns, split_block))
    rows = K.warm_row_counts(vocab, 1024, torch.device("cpu"), block_v)
    assert {K._lane_groups(K._chunking(vocab, K._num_splits(vocab, n, split_block, torch.device("cpu")),
                                       split_block)[1], split_block) for n in rows} == classes
    assert len(rows) == len(classes) <= 8


def test_one_launch_shape_for_every_batch_size(read_way, device):
    """max_splits: the launch shape a caller fixes for a rare input type (fp32 logits widened for
    penalties), so one kernel variant serves every batch size; the draws are those of any shape."""
    logits, t, k, p, mp = _mixed_batch(device, vocab=5000, read_way=read_way)
    seeds, offsets = _seeds(len(t), device), torch.arange(len(t), device=device)
    assert K.max_splits(5000) == 3  # 2,048-token blocks
    want = K.sample_ref(logits, t, k, p, mp, seeds, offsets)
    assert torch.equal(K.sample(logits, t, k, p, mp, seeds, offsets, num_splits=K.max_splits(5000)), want)


def test_estimate_above_the_threshold_reads_again_from_a_sure_bound(device):
    """2,000 tokens at 5.001 and 2,000 tied at 4.99 (the threshold), in neighbouring bins of pass 1's
    grid: the grid weighs the 5.001s at their bin's middle (5.0625), so their mass seems to reach p * Z
    and the band starts at 5.0, above T. The first scan's mass tells, and the row is read again from
    a sure bound, serially in the row program (chain_rounds 0: with rounds, top-p rows without top-k
    are chain rows): after the chunked read, which hands it such rows (the row program's own read, the
    other way, is the same scans). The draws are the reference's: a 5.001 at offset 0, a 4.99 at 3."""
    vocab = 128_256
    g = torch.Generator().manual_seed(0)
    row = torch.full((vocab,), -5.0)
    at = torch.randperm(vocab, generator=g)
    row[at[:8]] = 10.0
    row[at[8:2008]] = 5.001
    row[at[2008:4008]] = 4.99
    row[at[4008:24008]] = torch.rand(20000, generator=g) * 4.8
    z = torch.exp(row.double() - 10).sum().item()
    top_p = (8 + 1.002 * 2000 * torch.exp(torch.tensor(5.001 - 10, dtype=torch.float64)).item()) / z
    got, want, (reads,) = _draws(row, device, 2048, 3, [(dict(top_p=top_p), (0, 3))], chain_rounds=0)
    assert torch.equal(got, want)
    assert min(reads) >= 4  # pass 1, the scan, the read from the bound, a link of the chain at least
    assert set(row[want.cpu()].tolist()) == {torch.tensor(5.001).item(), torch.tensor(4.99).item()}


def test_launches_a_batch_needs():
    """The engine skips the chain's rounds without chain rows (sampled, top-p or min-p, no top-k) and
    the second read without sampled top-k rows; greedy rows need neither."""
    v = 1000
    assert K.launches_needed([1.0, 0.0], [0, 5], [1.0, 0.5], [0.0, 0.1], v) == (False, False)
    assert K.launches_needed([1.0], [0], [0.9], [0.0], v) == (True, False)
    assert K.launches_needed([1.0], [0], [1.0], [0.05], v) == (True, False)
    assert K.launches_needed([1.0], [40], [0.9], [0.0], v) == (False, True)
    assert K.launches_needed([1.0, 0.7], [v, 40], [0.9, 1.0], [0.0, 0.0], v) == (True, True)  # k >= V: no top-k


def test_chain_rows_without_the_second_read(device):
    """A batch of chain rows only (top-p, min-p, both; plain and greedy rows beside them) drawn with the
    second read's launches skipped, as the engine does: the reference's draws."""
    n = 8
    rows = torch.stack([_flat(1024, i) for i in range(n)]).to(device)
    t = torch.tensor([1.0, 0.8, 1.2, 0.0, 1.0, 0.9, 1.0, 0.7], device=device)
    k = torch.zeros(n, dtype=torch.int32, device=device)
    p = torch.tensor([0.9, 1.0, 0.5, 0.9, 1.0, 0.95, 0.3, 1.0], device=device)
    mp = torch.tensor([0.0, 0.2, 0.05, 0.0, 0.0, 0.0, 0.1, 0.5], device=device)
    seeds, offsets = _seeds(n, device), torch.arange(n, device=device)
    assert K.launches_needed(t.tolist(), k.tolist(), p.tolist(), mp.tolist(), 1024) == (True, False)
    got = K.sample(rows, t, k, p, mp, seeds, offsets, block_v=32, num_splits=2, chain_block=32, second_read=False)
    assert torch.equal(got, K.sample_ref(rows, t, k, p, mp, seeds, offsets))


def test_workspace_bytes_bound_what_a_draw_allocates(monkeypatch, device):
    """The KV sizing counts a draw's buffers with workspace_bytes instead of compiling the kernels in its
    dry run: every launch taken (a row of each kind), they stay within it."""
    n, vocab = 4, 5000
    args = [*_params(n, device, temperature=0.8), _seeds(n, device), torch.arange(n, device=device)]
    args[1][1], args[2][2], args[3][3] = 40, 0.9, 0.1  # top-k, top-p (a chain row), min-p
    logits = torch.randn(n, vocab, device=device)
    allocated = []
    empty = torch.empty

    def counting(*size, **kwargs):
        t = empty(*size, **kwargs)
        allocated.append(t.numel() * t.element_size())
        return t

    monkeypatch.setattr(torch, "empty", counting)
    got = K.sample(logits, *args)
    monkeypatch.setattr(torch, "empty", empty)
    assert torch.equal(got, K.sample_ref(logits, *args))
    assert len(allocated) >= 15 and sum(allocated) <= K.workspace_bytes(n, vocab, logits.device)
