"""The paged cache's bookkeeping: block tables, growth, prefix sharing, eviction."""

from __future__ import annotations

from outrider.target_worker.block_manager import BlockManager

PROMPT = list(range(100, 110))  # 10 tokens: two full blocks of 4, then 2


def test_blocks_are_taken_as_slots_grow_and_given_back():
    blocks = BlockManager(num_blocks=6, block_size=4, prefix_caching=False)
    assert blocks.allocate(1, PROMPT, len(PROMPT)) == 0
    assert len(blocks.tables[1]) == 3 and blocks.num_free_blocks == 3
    assert blocks.grow(1, 12) and len(blocks.tables[1]) == 3  # still within block 3
    assert blocks.grow(1, 13) and len(blocks.tables[1]) == 4
    assert not blocks.grow(1, 30) and len(blocks.tables[1]) == 4  # all or nothing
    blocks.shrink(1, 9)
    assert len(blocks.tables[1]) == 3 and blocks.num_free_blocks == 3
    assert blocks.allocate(2, PROMPT, 16) is None and 2 not in blocks.tables  # 4 blocks > 3 free
    blocks.free(1)
    assert blocks.num_free_blocks == 6 and not blocks.tables


def test_a_shared_prefix_is_reused_and_never_the_last_token():
    blocks = BlockManager(num_blocks=8, block_size=4)
    blocks.allocate(1, PROMPT, len(PROMPT))
    blocks.commit(1, PROMPT, 10)  # K/V of all 10 tokens written: blocks 0 and 1 are full
    # Same first 8 tokens: both full blocks are shared (refcount 2), the rest computed.
    other = PROMPT[:8] + [7, 7, 7]
    assert blocks.allocate(2, other, len(other)) == 8
    assert blocks.tables[2][:2] == blocks.tables[1][:2]
    assert blocks.tables[2][2] != blocks.tables[1][2]
    # An exact 8-token prompt keeps its last token to compute: only the first block is reused.
    assert blocks.allocate(3, PROMPT[:8], 8) == 4
    assert blocks.stats.queries == 10 + 11 + 8 and blocks.stats.hits == 8 + 4
    # A different first block shares nothing, though the second block's tokens match.
    assert blocks.allocate(4, [0, 0, 0, 0, *PROMPT[4:]], 10) == 0


def test_only_committed_full_blocks_are_cached():
    blocks = BlockManager(num_blocks=8, block_size=4)
    blocks.allocate(1, PROMPT, len(PROMPT))
    blocks.commit(1, PROMPT, 7)  # block 1 is half computed (a prompt chunk stopped at 7)
    assert blocks.allocate(2, PROMPT, len(PROMPT)) == 4


def test_released_cached_blocks_wait_in_lru_order_until_needed():
    blocks = BlockManager(num_blocks=4, block_size=4)
    blocks.allocate(1, PROMPT, len(PROMPT))
    blocks.commit(1, PROMPT, 10)
    first, second, _ = blocks.tables[1]
    blocks.free(1)
    assert blocks.num_free_blocks == 4  # cached blocks count as free
    # Two fresh blocks come from the free list first; the third evicts the prefix's tail.
    blocks.allocate(2, [1] * 9, 9)
    assert blocks.tables[2][2] == second and first not in blocks.tables[2]
    assert blocks.allocate(3, PROMPT, len(PROMPT)) is None  # 3 blocks needed, 1 free
    blocks.free(2)
    assert blocks.allocate(3, PROMPT, len(PROMPT)) == 4  # the tail was evicted, the head kept
    assert blocks.tables[3][0] == first


def test_a_shared_block_outlives_one_owner():
    blocks = BlockManager(num_blocks=4, block_size=4)
    blocks.allocate(1, PROMPT, len(PROMPT))
    blocks.commit(1, PROMPT, 10)
    blocks.allocate(2, PROMPT, len(PROMPT))
    shared = blocks.tables[2][:2]
    assert blocks.num_free_blocks == 0
    blocks.free(1)
    assert blocks.num_free_blocks == 1  # block 1's private third block; the shared two are held
    blocks.grow(2, 16)
    assert blocks.tables[2][:2] == shared


def test_a_sequence_growing_alone_gets_consecutive_blocks():
    # Tree scratch handed back is taken again first, so the table stays one run of blocks
    # (attention then reads the sequence as a view of the cache, without a gather).
    blocks = BlockManager(num_blocks=8, block_size=4, prefix_caching=False)
    blocks.allocate(1, PROMPT, len(PROMPT))
    for slots in (14, 17, 18, 21):
        assert blocks.grow(1, slots + 4)  # root and a tree
        blocks.shrink(1, slots)  # the accepted path stays
    assert blocks.tables[1] == list(range(len(blocks.tables[1])))
