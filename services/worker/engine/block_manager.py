"""The paged KV cache's bookkeeping: ref-counted blocks, an LRU free queue and prefix caching."""

from __future__ import annotations

from collections import OrderedDict

from services.worker.engine.block_tables import BlockTables
from services.worker.engine.request import Request
from shared.block_hash import ROOT_HASH, block_hash


class BlockManager:
    """Hands out KV blocks to requests and finds blocks that already hold a prompt's prefix.

    A block is an int in [0, num_blocks). Each has a ref count (how many requests hold it) and,
    once it is full and computed, the chained hash of its content. Blocks with ref count 0 sit in
    the free queue, least recently freed first; a free block that still has a hash stays findable
    by prefix lookups until it is popped for reuse, which evicts its hash. So the cache is simply
    the free queue's LRU order, with no separate eviction pass.
    """

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True,
                 extra_key: bytes = b""):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self._num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.extra_key = extra_key  # the model's identity; requests append their cache_salt

        self._ref_counts = [0] * num_blocks
        self._block_hashes: list[bytes | None] = [None] * num_blocks
        # Insertion order is the LRU order: pop from the front, free onto the back.
        self._free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash_to_block: dict[bytes, int] = {}
        # Per running request: how many of its leading blocks cache_full_blocks has handled.
        self._num_handled_blocks: dict[str, int] = {}
        # KV events since take_events(): hash -> True (stored) / False (removed); last one wins.
        self._events: dict[bytes, bool] = {}

        # Every request's block ids again, as rows of one array: what a step's block table gathers.
        self.tables = BlockTables()

        # Prefix-cache counters in tokens, as vLLM's prefix_cache_queries / prefix_cache_hits.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ------------------------------------------------------------------ state

    @property
    def num_total_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds, cached or not."""
        return len(self._free_queue)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks findable by a prefix lookup, in use or free."""
        return len(self._hash_to_block)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free_queue) / self._num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def take_events(self) -> tuple[list[bytes], list[bytes]]:
        """(stored, removed) block hashes since the last call, for the router's prefix index.

        Only each hash's last change is reported, so the two lists are disjoint and may be
        applied in either order: a block stored and then evicted within one window shows up as
        removed only.
        """
        stored = [h for h, present in self._events.items() if present]
        removed = [h for h, present in self._events.items() if not present]
        self._events.clear()
        return stored, removed

    # ------------------------------------------------------------------ prefix lookup

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest run of cached blocks holding the request's leading tokens, and their
        token count. At least one token is always left to compute, since the engine needs the
        last token's logits to sample, so a full hit drops its last block (as vLLM does)."""
        if not self.enable_prefix_caching:
            return [], 0
        self._update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[int] = []
        for h in request.block_hashes[:max_blocks]:
            block_id = self._hash_to_block.get(h)
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks, len(blocks) * self.block_size

    # ------------------------------------------------------------------ allocation

    def allocate_slots(self, request: Request, num_new_tokens: int, new_computed_blocks=(),
                       num_new_computed_tokens: int = 0) -> bool:
        """Grow request.block_ids to cover num_computed_tokens + num_new_computed_tokens +
        num_new_tokens tokens, the prefix-hit blocks first. Return False and change nothing when
        the free blocks do not suffice (hit blocks sitting in the free queue count as used)."""
        num_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_needed = (-(-num_tokens // self.block_size) - len(request.block_ids)
                      - len(new_computed_blocks))
        num_revived = sum(1 for b in new_computed_blocks if self._ref_counts[b] == 0)
        if num_needed > len(self._free_queue) - num_revived:
            return False

        if not request.block_ids and request.num_computed_tokens == 0 and self.enable_prefix_caching:
            # First allocation after a lookup: count it here rather than in the lookup, which
            # the batcher repeats while the request waits for blocks.
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_new_computed_tokens
        start = len(request.block_ids)
        for block_id in new_computed_blocks:
            if self._ref_counts[block_id] == 0:
                del self._free_queue[block_id]
            self._ref_counts[block_id] += 1
            request.block_ids.append(block_id)
        for _ in range(num_needed):
            request.block_ids.append(self._pop_free_block())
        self.tables.write(request, start)
        return True

    def _pop_free_block(self) -> int:
        block_id, _ = self._free_queue.popitem(last=False)
        evicted = self._block_hashes[block_id]
        if evicted is not None:
            del self._hash_to_block[evicted]
            self._block_hashes[block_id] = None
            self._events[evicted] = False
        self._ref_counts[block_id] = 1
        return block_id

    def free(self, request: Request) -> None:
        """Release the request's blocks. They join the free queue tail first, so a shared
        prefix's head blocks are the last of them to be evicted."""
        for block_id in reversed(request.block_ids):
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free_queue[block_id] = None
        self.tables.release(request)
        request.block_ids.clear()
        self._num_handled_blocks.pop(request.request_id, None)

    # ------------------------------------------------------------------ caching

    def cache_full_blocks(self, request: Request) -> None:
        """Register every block that is now full and computed, so later requests can hit it.

        When the same content was computed concurrently into another block, the first block
        keeps the hash and this one stays uncached (it is freed like any other block).
        """
        if not self.enable_prefix_caching:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_ids))
        first = self._num_handled_blocks.get(request.request_id, 0)
        if num_full <= first:
            return
        self._update_block_hashes(request)
        for index in range(first, num_full):
            block_id = request.block_ids[index]
            h = request.block_hashes[index]
            if self._block_hashes[block_id] is None and h not in self._hash_to_block:
                self._block_hashes[block_id] = h
                self._hash_to_block[h] = block_id
                self._events[h] = True
        self._num_handled_blocks[request.request_id] = num_full

    def insert_cached(self, hashes: list[bytes]) -> list[tuple[int, int]]:
        """Blocks for pages fetched from elsewhere (the cluster KV store), as (index in hashes,
        block id): each hash not cached here takes a free block (evicting the least recently used
        one), becomes findable, and stays free at the recently-used end of the queue."""
        if not self.enable_prefix_caching:
            return []
        placed = []
        for i, h in enumerate(hashes):
            if h in self._hash_to_block:
                continue
            if not self._free_queue:
                break
            block_id = self._pop_free_block()
            self._ref_counts[block_id] = 0
            self._block_hashes[block_id] = h
            self._hash_to_block[h] = block_id
            self._events[h] = True
            self._free_queue[block_id] = None
            placed.append((i, block_id))
        return placed

    def num_cached_prefix(self, hashes: list[bytes]) -> int:
        """How many leading hashes are cached here. Only dict reads: other threads may ask (a racy
        answer is a routing hint, never used for allocation)."""
        n = 0
        for h in hashes:
            if h not in self._hash_to_block:
                break
            n += 1
        return n

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (False) while any block is in use, since running
        requests' blocks would silently stop being shareable halfway through (vLLM does so)."""
        if len(self._free_queue) != self._num_blocks:
            return False
        for h in self._hash_to_block:
            self._events[h] = False
        self._hash_to_block.clear()
        self._block_hashes = [None] * self._num_blocks
        return True

    def _update_block_hashes(self, request: Request) -> None:
        """Extend request.block_hashes to every full block of its known tokens."""
        hashes = request.block_hashes
        num_full = request.num_tokens // self.block_size
        if len(hashes) >= num_full:
            return
        key = self.extra_key + request.cache_salt
        parent = hashes[-1] if hashes else ROOT_HASH
        tokens = request.all_token_ids
        for index in range(len(hashes), num_full):
            start = index * self.block_size
            parent = block_hash(parent, tokens[start:start + self.block_size], key)
            hashes.append(parent)
