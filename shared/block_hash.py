"""Chained content hashes of KV blocks, identical in every process (worker, scheduler, kvstore)."""

from __future__ import annotations

import hashlib
from array import array

ROOT_HASH = b"\x00" * 16


def block_hash(parent: bytes, token_ids, extra_key: bytes = b"") -> bytes:
    """Hash of one full block: the parent's hash, the block's token ids and an extra key.

    The extra key carries the model identity and the tenant salt, so two models or two tenants
    never share a block even when their tokens agree.
    """
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("i", token_ids).tobytes())
    h.update(extra_key)
    return h.digest()


def prefix_block_hashes(token_ids, block_size: int, extra_key: bytes = b"") -> list[bytes]:
    """Hashes of every full block of `token_ids`, in order (a partial tail block has none)."""
    hashes: list[bytes] = []
    parent = ROOT_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start:start + block_size], extra_key)
        hashes.append(parent)
    return hashes


def request_block_key(model: str, cache_salt: str = "") -> bytes:
    """The extra key of a request's block hashes; the worker and the router must agree on it."""
    return model.encode() + b"\x00" + cache_salt.encode()
