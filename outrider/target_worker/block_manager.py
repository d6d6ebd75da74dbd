"""The target's paged KV cache bookkeeping: fixed-size blocks, a block table per sequence,
and prefix caching by the hash chain of full blocks.

    cache rows:   | block 0 | block 1 | block 2 | block 3 | ...      (block_size rows each)
    seq 7 table:  [3, 0, 5]   slots 0..15 -> block 3, 16..31 -> block 0, 32..47 -> block 5
    seq 9 table:  [3, 2]      shares block 3 (the same first 16 prompt tokens), refcount 2

A sequence holds blocks for the slots it uses (`KVCache` rows = block * block_size + offset):
its prompt at admission, then `grow` before each round to cover its root and tree (the
tree's rows are scratch: after verification the accepted path is compacted into the slots
after the root and `shrink` hands back the blocks only rejected nodes used). Nothing is
reserved for max_tokens, so a request with a long max_tokens and a short output costs only
what it uses; when blocks run out the engine preempts by recompute (`Engine` admission).

Prefix caching (vLLM's automatic prefix caching): a block whose `block_size` slots hold
committed tokens is *full* and is identified by `hash(parent hash, its tokens)`, so equal
hashes mean equal token prefixes and therefore equal K/V. A new sequence reuses the longest
chain of cached full blocks of its prompt (refcount + 1) and prefills only the rest, always
leaving its last prompt token to compute (its logits start the output). Shared blocks are
never written: a sequence writes only slots at or past its cached length. A block whose last
reference goes keeps its hash and waits in an LRU list, evicted only when a free block is
needed. Hashes are 128-bit blake2b digests, so a collision (which would serve another
prefix's K/V) is out of reach, unlike a 64-bit `hash()`.
"""

from __future__ import annotations

import hashlib
import heapq
from array import array
from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class PrefixCacheStats:
    """vLLM's prefix-cache counters, in tokens: prompt tokens looked up, and those found."""

    queries: int = 0
    hits: int = 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a paged cache needs blocks: got {num_blocks} blocks of {block_size} slots")
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        # Never hashed, or evicted; a heap, taken lowest id first, so a sequence growing alone
        # gets consecutive blocks, which attention reads as one view instead of gathering them.
        self._free: list[int] = list(range(num_blocks))
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}  # block -> its chain hash (full, committed blocks)
        self._cached: dict[bytes, int] = {}  # chain hash -> block
        self._evictable: OrderedDict[int, None] = OrderedDict()  # hashed, unreferenced; oldest first
        self.tables: dict[int, list[int]] = {}  # seq_id -> block table
        self._hashed: dict[int, tuple[int, bytes]] = {}  # seq_id -> (its blocks hashed, last hash)
        self.stats = PrefixCacheStats()

    # ---- capacity ------------------------------------------------------------------------

    def blocks_for(self, num_slots: int) -> int:
        return -(-num_slots // self.block_size)

    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence can take: free ones and unreferenced cached ones."""
        return len(self._free) + len(self._evictable)

    # ---- sequences -----------------------------------------------------------------------

    def allocate(self, seq_id: int, tokens: list[int], num_slots: int, lookup: bool = True) -> int | None:
        """Gives `seq_id` a table covering `num_slots` slots, reusing cached blocks of its
        longest cached prefix of `tokens`; returns how many leading tokens are already cached
        (a multiple of block_size, below len(tokens)), or None (nothing taken) if the blocks
        are not there. `lookup` False: computes every token (its full blocks are cached after)."""
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id} already holds KV blocks")
        hits = self._cached_prefix(tokens) if lookup else []
        need = self.blocks_for(num_slots) - len(hits)
        reusable = sum(1 for block in hits if self._refs[block] == 0)  # counted in num_free_blocks
        if need > self.num_free_blocks - reusable:
            return None
        for block in hits:
            self._ref(block)
        self.tables[seq_id] = hits + [self._take() for _ in range(need)]
        if hits:
            self._hashed[seq_id] = (len(hits), self._hash_of[hits[-1]])
        if self.prefix_caching and lookup:
            self.stats.queries += len(tokens)
            self.stats.hits += len(hits) * self.block_size
        return len(hits) * self.block_size

    def grow(self, seq_id: int, num_slots: int) -> bool:
        """Extends the table to cover `num_slots`; False (nothing taken) if blocks are short."""
        table = self.tables[seq_id]
        need = self.blocks_for(num_slots) - len(table)
        if need > self.num_free_blocks:
            return False
        table.extend(self._take() for _ in range(need))
        return True

    def shrink(self, seq_id: int, num_slots: int) -> None:
        """Hands back the blocks past the first `num_slots` slots (tree scratch)."""
        table = self.tables[seq_id]
        keep = self.blocks_for(num_slots)
        while len(table) > keep:
            self._release(table.pop())

    def free(self, seq_id: int) -> None:
        for block in reversed(self.tables.pop(seq_id)):  # the prefix's tail is evicted first
            self._release(block)
        self._hashed.pop(seq_id, None)

    def commit(self, seq_id: int, tokens: list[int], num_cached: int) -> None:
        """Tokens[:num_cached] have their K/V in place: full blocks among them become cached."""
        if not self.prefix_caching:
            return
        done, parent = self._hashed.get(seq_id, (0, b""))
        table, size = self.tables[seq_id], self.block_size
        full = min(num_cached // size, len(table))
        for i in range(done, full):
            parent = _chain_hash(parent, tokens[i * size : (i + 1) * size])
            block = table[i]
            if parent not in self._cached and block not in self._hash_of:
                self._cached[parent], self._hash_of[block] = block, parent
        if full > done:
            self._hashed[seq_id] = (full, parent)

    # ---- blocks --------------------------------------------------------------------------

    def _cached_prefix(self, tokens: list[int]) -> list[int]:
        """Cached blocks holding tokens' leading full blocks, leaving the last token uncached."""
        if not self.prefix_caching:
            return []
        hits, parent, size = [], b"", self.block_size
        for i in range((len(tokens) - 1) // size):
            parent = _chain_hash(parent, tokens[i * size : (i + 1) * size])
            block = self._cached.get(parent)
            if block is None:
                break
            hits.append(block)
        return hits

    def _ref(self, block: int) -> None:
        if self._refs[block] == 0:
            self._evictable.pop(block, None)
        self._refs[block] += 1

    def _take(self) -> int:
        if self._free:
            block = heapq.heappop(self._free)
        else:  # evict the least recently released cached block
            block, _ = self._evictable.popitem(last=False)
            del self._cached[self._hash_of.pop(block)]
        self._refs[block] = 1
        return block

    def _release(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block]:
            return
        if block in self._hash_of:
            self._evictable[block] = None
        else:
            heapq.heappush(self._free, block)


def _chain_hash(parent: bytes, tokens: list[int]) -> bytes:
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()
