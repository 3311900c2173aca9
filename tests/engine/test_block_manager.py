"""Block manager: pure bookkeeping, tested without tensors."""

from __future__ import annotations

import pytest

from specserve.engine.block_manager import BlockManager, NoFreeBlocksError


def test_allocate_free_roundtrip():
    bm = BlockManager(8, 4)
    a = bm.allocate(3)
    b = bm.allocate(5)
    assert len(set(a + b)) == 8 and bm.num_free_blocks == 0
    assert not bm.can_allocate(1)
    bm.free_blocks(a)
    assert bm.num_free_blocks == 3 and bm.can_allocate(3)
    bm.free_blocks(b)
    bm.check_no_leak()


def test_exhaustion_is_a_clear_error():
    bm = BlockManager(2, 4)
    bm.allocate(2)
    with pytest.raises(NoFreeBlocksError, match="asked for 1 KV blocks, 0 free of 2"):
        bm.allocate(1)


def test_double_free_is_detected():
    bm = BlockManager(2, 4)
    a = bm.allocate(1)
    bm.free_blocks(a)
    with pytest.raises(RuntimeError, match="freed more often"):
        bm.free_blocks(a)


def test_ref_counts_share_blocks():
    bm = BlockManager(4, 2)
    a = bm.allocate(2)
    bm.acquire(a)  # a second request shares both blocks
    bm.free_blocks(a)
    assert bm.num_free_blocks == 2  # still held by the second owner
    bm.free_blocks(a)
    bm.check_no_leak()


def test_prefix_cache_hit_after_release_and_lru_eviction():
    bm = BlockManager(3, 2)
    tokens = [1, 2, 3, 4, 5]
    hashes = bm.full_block_hashes(tokens)
    assert len(hashes) == 2  # the fifth token does not fill a block
    blocks = bm.allocate(2)
    for b, h in zip(blocks, hashes):
        bm.cache_block(b, h)
    bm.free_blocks(blocks)
    assert bm.lookup_prefix(hashes) == blocks  # kept after release
    assert bm.lookup_prefix(bm.full_block_hashes([1, 2, 9, 9])) == blocks[:1]
    # Hashes chain over the prefix: the same second block after another first block misses.
    assert bm.lookup_prefix(bm.full_block_hashes([7, 7, 3, 4])) == []
    bm.allocate(2)  # the never-used block first, then the least recently freed cached one
    # A request's blocks are freed tail first, so its tail is evicted before its prefix.
    assert bm.lookup_prefix(hashes) == blocks[:1]
    assert bm.num_free_blocks == 1
    bm.allocate(1)
    assert bm.lookup_prefix(hashes) == []


def test_lookup_has_no_side_effects_and_hit_rate_counts_recorded_lookups():
    bm = BlockManager(4, 2)
    h = bm.full_block_hashes([1, 2])
    [b] = bm.allocate(1)
    bm.cache_block(b, h[0])
    before = bm.num_free_blocks
    assert bm.lookup_prefix(h) == [b]
    assert bm.num_free_blocks == before and bm.prefix_queries == 0
    bm.record_prefix_lookup(2, 1)
    assert bm.prefix_hit_rate == 0.5


def test_prefix_caching_disabled():
    bm = BlockManager(4, 2, enable_prefix_caching=False)
    h = bm.full_block_hashes([1, 2])
    [b] = bm.allocate(1)
    bm.cache_block(b, h[0])
    assert bm.lookup_prefix(h) == []
