"""BlockPool: exact block ids, ref counts, O(1) LRU free list and lazy eviction order."""

import pytest

from wllm.engine.block_pool import BlockPool


def ids(blocks):
    return [b.block_id for b in blocks]


def test_allocates_from_head_and_frees_to_tail_in_given_order():
    pool = BlockPool(5)
    a = pool.get_new_blocks(3)
    assert ids(a) == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in a)
    assert pool.free_queue.ids() == [3, 4]
    pool.free_blocks(reversed(a))
    assert pool.free_queue.ids() == [3, 4, 2, 1, 0]
    assert ids(pool.get_new_blocks(2)) == [3, 4]
    assert pool.num_free_blocks == 3


def test_shared_block_returns_to_free_list_only_at_zero_refs():
    pool = BlockPool(3)
    (b,) = pool.get_new_blocks(1)
    pool.touch([b])
    assert b.ref_cnt == 2
    pool.free_blocks([b])
    assert pool.free_queue.ids() == [1, 2]
    pool.free_blocks([b])
    assert pool.free_queue.ids() == [1, 2, 0]
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks([b])


def test_over_allocation_raises_without_taking_blocks():
    pool = BlockPool(2)
    with pytest.raises(RuntimeError, match="only 2 free"):
        pool.get_new_blocks(3)
    assert pool.num_free_blocks == 2


def test_cached_free_block_is_revived_from_the_middle_of_the_free_list():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    pool.cache_full_block(blocks[1], b"h1", (1, 2))
    pool.free_blocks(blocks)
    assert pool.free_queue.ids() == [0, 1, 2, 3]
    hit = pool.get_cached_block(b"h1", (1, 2))
    assert hit is blocks[1]
    assert pool.get_cached_block(b"h1", (1, 3)) is None  # same hash, other tokens: no hit
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert pool.free_queue.ids() == [0, 2, 3]
    assert pool.num_evictions == 0


def test_lazy_eviction_is_least_recently_freed_first():
    pool = BlockPool(3)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_full_block(a, b"ha", (1,))
    pool.cache_full_block(b, b"hb", (2,))
    pool.cache_full_block(c, b"hc", (3,))
    pool.free_blocks([b])  # freed first -> evicted first
    pool.free_blocks([c])
    pool.free_blocks([a])
    assert pool.free_queue.ids() == [1, 2, 0]
    assert set(pool.cached) == {b"ha", b"hb", b"hc"}  # still findable while free
    (x,) = pool.get_new_blocks(1)
    assert x is b and x.block_hash is None
    assert set(pool.cached) == {b"ha", b"hc"}
    assert pool.num_evictions == 1
    (y,) = pool.get_new_blocks(1)
    assert y is c
    assert pool.num_evictions == 2
    assert pool.get_cached_block(b"ha", (1,)) is a


def test_duplicate_hash_keeps_the_first_block_and_reset_needs_all_free():
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, b"h", (5,))
    pool.cache_full_block(b, b"h", (5,))
    assert pool.cached[b"h"] is a and b.block_hash is None
    assert not pool.reset_prefix_cache()
    pool.free_blocks([a, b])
    assert pool.reset_prefix_cache()
    assert pool.cached == {} and a.block_hash is None


def test_caching_disabled_registers_nothing():
    pool = BlockPool(2, enable_caching=False)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_block(a, b"h", (1,))
    assert pool.cached == {}
