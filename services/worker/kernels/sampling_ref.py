"""The sampling semantics in torch: the sort-based reference the kernels of sampling.py match row for
row (the rules are in that module's docstring), and the counter-based noise both use."""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
_C1 = 0x7FEB352D  # lowbias32 (Chris Wellons' hash prospector)
_C2 = 0x846CA68B
_GOLDEN = 0x9E3779B9  # 2^32 / golden ratio


# --- the noise, in torch (int64 holding uint32 values) -------------------------------------

def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 without int64 overflow: the high half is reduced before its shift."""
    return ((x & 0xFFFF) * c + (((x >> 16) * c) & 0xFFFF) * 65536) & _M32


def _lowbias32_ref(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, _C1)
    x = x ^ (x >> 15)
    x = _mul32(x, _C2)
    return x ^ (x >> 16)


def _row_keys_ref(seeds: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    seeds = seeds.long()
    lo = seeds & _M32
    hi = (seeds >> 32) & _M32
    key = _lowbias32_ref(lo ^ _lowbias32_ref(hi))
    return _lowbias32_ref(key ^ _lowbias32_ref(offsets.long() & _M32))


def uniform_noise_ref(seeds: torch.Tensor, offsets: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, V] float32 in (0, 1): u = ((h >> 9) + 0.5) * 2^-23, h = lowbias32(key ^ index * golden),
    key = lowbias32(lowbias32(lo ^ lowbias32(hi)) ^ lowbias32(offset)) for seed = hi:lo.

    23 bits, not 24: (2^24 - 1) + 0.5 rounds up to 2^24 in fp32, which would give u == 1.
    """
    keys = _row_keys_ref(seeds, offsets)
    idx = torch.arange(vocab, dtype=torch.int64, device=seeds.device)
    h = _lowbias32_ref(keys[:, None] ^ _mul32(idx, _GOLDEN)[None, :])
    return ((h >> 9).to(torch.float32) + 0.5) * (2.0 ** -23)


def gumbel_noise_ref(seeds: torch.Tensor, offsets: torch.Tensor, vocab: int) -> torch.Tensor:
    return -torch.log(-torch.log(uniform_noise_ref(seeds, offsets, vocab)))


# --- the reference -------------------------------------------------------------------------

def sample_ref(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
    min_p: torch.Tensor, seeds: torch.Tensor, offsets: torch.Tensor,
) -> torch.Tensor:
    """logits [B, V] -> [B] int64 token ids (see the module docstring for the exact rules)."""
    x = logits.float()
    n_rows, vocab = x.shape
    greedy_ids = x.argmax(dim=-1)
    if n_rows == 0:
        return greedy_ids
    greedy = temperature <= 0
    if bool(greedy.all()):
        return greedy_ids
    inv_t = 1.0 / torch.where(greedy, torch.ones_like(temperature), temperature).float()
    l = x * inv_t[:, None]
    m = l.max(dim=-1, keepdim=True).values
    keep = torch.ones_like(l, dtype=torch.bool)

    k = top_k.long()
    use_k = (k > 0) & (k < vocab)
    if bool(use_k.any()):
        k_eff = torch.where(use_k, k, 1)
        t_k = l.topk(int(k_eff.max()), dim=-1).values.gather(1, (k_eff - 1)[:, None])
        keep &= ~use_k[:, None] | (l >= t_k)

    e = torch.exp(l - m)
    use_p = top_p < 1.0
    if bool(use_p.any()):
        l_sorted, order = torch.where(keep, l, float("-inf")).sort(dim=-1, descending=True)
        e_sorted = torch.where(l_sorted > float("-inf"), e.gather(1, order), 0.0)
        mass = e_sorted.double().cumsum(dim=-1)
        target = top_p.double()[:, None] * mass[:, -1:]
        n = (mass < target).sum(dim=-1, keepdim=True).clamp(max=vocab - 1)
        s_p = l_sorted.gather(1, n)
        keep &= ~use_p[:, None] | (l >= s_p)

    use_min_p = min_p > 0.0
    if bool(use_min_p.any()):
        keep &= ~use_min_p[:, None] | (e >= min_p.float()[:, None])

    scores = torch.where(keep, l + gumbel_noise_ref(seeds, offsets, vocab), float("-inf"))
    return torch.where(greedy, greedy_ids, scores.argmax(dim=-1))
