"""The scheduler's view of each worker's prefix cache: block hashes from KvEvents, and prefix matching."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from shared.block_hash import ROOT_HASH, block_hash
from shared.messages import KvEvents
from shared.wire import unpack_ids_array

# A worker reports removals, so its index tracks its block pool; this bound only protects the
# scheduler's memory from a worker whose removals never arrive (≈ 32 M tokens at 16 per block).
MAX_BLOCKS_PER_WORKER = 1 << 21
_NATIVE_IS_WIRE = sys.byteorder == "little"  # shared.wire packs ids as little-endian int32


class KvIndex:
    """The block hashes one worker holds in its prefix cache, kept in step by KvEvents' seq.

    A gap in seq (a lost report, or a restarted worker) clears the index: a missing block only
    costs routing quality, while a stale "cached" claim would steer requests wrongly for as long
    as it stays.
    """

    __slots__ = ("blocks", "seq", "updated", "resets", "complete")

    def __init__(self, now: float = 0.0):
        self.blocks: set[bytes] = set()
        self.seq: int | None = None  # last applied KvEvents.seq; None: no event yet
        self.updated = now  # monotonic time of the last event
        self.resets = 0  # clears forced by gaps, restarts or the size bound
        # Every report since a `cleared` one applied in order: the index is the holder's whole cache,
        # so a block missing here is missing there too (else it may only be unreported).
        self.complete = False

    def __len__(self) -> int:
        return len(self.blocks)

    def clear(self) -> None:
        self.blocks.clear()
        self.seq = None
        self.complete = False

    def load(self, seq: int, blocks: set[bytes], now: float) -> bool:
        """A snapshot of the holder's whole cache as of report `seq` (KvSnapshot): taken when this
        index is behind it (a scheduler that started late), so the reports after it apply in order."""
        if self.seq is not None and self.seq >= seq:
            return False
        self.blocks = blocks
        self.seq = seq
        self.complete = True
        self.updated = now
        return True

    def apply(self, ev: KvEvents, now: float) -> bool:
        """Apply one report; False when a seq gap forced a reset first."""
        in_order = self.seq is None or ev.seq == self.seq + 1
        if not in_order:
            self.blocks.clear()
            self.resets += 1
            self.complete = False
        elif ev.cleared:
            self.blocks.clear()
            self.complete = True
        self.blocks.update(ev.stored)
        self.blocks.difference_update(ev.removed)
        if len(self.blocks) > MAX_BLOCKS_PER_WORKER:
            self.blocks.clear()
            self.resets += 1
            self.complete = False
        self.seq = ev.seq
        self.updated = now
        return in_order


def match_prefixes(prompt_ids: bytes, block_size: int, extra_key: bytes,
                   indexes: Sequence[KvIndex | None]) -> list[int]:
    """For each index, how many leading full blocks of the prompt (packed ids) it holds.

    The chain is hashed lazily, block by block, and stops at the first block no index holds, so a
    cold prompt costs one hash and a warm one O(matched blocks × workers still matching). The hashes
    are exactly those of shared.block_hash.prefix_block_hashes (and of the worker's block manager).
    """
    depth = [0] * len(indexes)
    active = [(i, index.blocks) for i, index in enumerate(indexes) if index is not None and index.blocks]
    if not active:
        return depth
    # block_hash() packs a block's ids as native int32 bytes (array("i", bytes) copies them as they
    # are), and on a little-endian machine those are the wire's packed bytes: slicing the packed
    # prompt skips unpacking it.
    data = bytes(prompt_ids) if _NATIVE_IS_WIRE else unpack_ids_array(prompt_ids)
    step = block_size * 4 if _NATIVE_IS_WIRE else block_size
    num_blocks = len(prompt_ids) // 4 // block_size
    parent = ROOT_HASH
    for b in range(num_blocks):
        parent = block_hash(parent, data[b * step:(b + 1) * step], extra_key)
        still = [pair for pair in active if parent in pair[1]]
        if len(still) != len(active):
            for i, blocks in active:
                if parent not in blocks:
                    depth[i] = b
            active = still
            if not active:
                return depth
    for i, _ in active:
        depth[i] = num_blocks
    return depth
