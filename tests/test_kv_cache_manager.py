"""KVCacheManager: block tables, prefix-cache hits (never the last token), salts, fork, eviction."""

from wllm.engine.kv_cache_manager import KVCacheManager, hash_block
from wllm.engine.request import RequestGroup
from wllm.sampling_params import SamplingParams


def seq_for(tokens, salt=None, lora=0, **params):
    return RequestGroup("r", tokens, SamplingParams(**params), cache_salt=salt, lora_id=lora).seqs[0]


def ids(blocks):
    return [b.block_id for b in blocks]


def run_prefill(kv, seq, hits=None):
    """What the scheduler and a finished step do for a whole prompt."""
    hit_blocks, n_hit = hits if hits is not None else ([], 0)
    assert kv.allocate_slots(seq, seq.num_tokens - n_hit, hit_blocks)
    seq.num_computed_tokens = seq.num_tokens
    kv.cache_computed_blocks(seq)


def test_allocation_and_block_table():
    kv = KVCacheManager(8, 4)
    s = seq_for(list(range(10)))
    assert kv.allocate_slots(s, 10)
    assert ids(s.blocks) == [0, 1, 2]
    s.num_computed_tokens = 10
    s.append_token(99)
    assert kv.allocate_slots(s, 1)  # slot 10 fits in block 2
    assert ids(s.blocks) == [0, 1, 2]
    s.num_computed_tokens = 11
    s.append_token(98)
    assert kv.allocate_slots(s, 1)
    assert ids(s.blocks) == [0, 1, 2]
    s.num_computed_tokens = 12
    s.append_token(97)
    assert kv.allocate_slots(s, 1)  # slot 12 needs a fourth block
    assert ids(s.blocks) == [0, 1, 2, 3]
    kv.free(s)
    assert kv.num_free_blocks == 8
    assert kv.pool.free_queue.ids() == [4, 5, 6, 7, 3, 2, 1, 0]


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(2, 4)
    s = seq_for(list(range(9)))
    assert not kv.allocate_slots(s, 9)
    assert s.blocks == [] and kv.num_free_blocks == 2


def test_prefix_hit_shares_full_blocks_but_never_the_last_token():
    kv = KVCacheManager(8, 4)
    a = seq_for(list(range(10)))
    run_prefill(kv, a)
    assert len(kv.pool.cached) == 2  # blocks 0 and 1 are full; block 2 holds 2 tokens
    b = seq_for(list(range(10)) + [50, 51])
    hits, n = kv.get_computed_blocks(b)
    assert ids(hits) == [0, 1] and n == 8
    run_prefill(kv, b, (hits, n))
    assert ids(b.blocks) == [0, 1, 3]
    assert kv.pool.blocks[0].ref_cnt == 2
    # A prompt of exactly two full blocks may only reuse the first: the last token must be computed.
    c = seq_for(list(range(8)))
    hits, n = kv.get_computed_blocks(c)
    assert ids(hits) == [0] and n == 4


def test_salt_and_lora_separate_cache_entries_and_prompt_logprobs_skip_the_cache():
    kv = KVCacheManager(8, 4)
    run_prefill(kv, seq_for(list(range(9)), salt="alice"))
    assert kv.get_computed_blocks(seq_for(list(range(9)), salt="bob"))[1] == 0
    assert kv.get_computed_blocks(seq_for(list(range(9))))[1] == 0
    assert kv.get_computed_blocks(seq_for(list(range(9)), lora=1, salt="alice"))[1] == 0
    assert kv.get_computed_blocks(seq_for(list(range(9)), salt="alice"))[1] == 8
    assert kv.get_computed_blocks(seq_for(list(range(9)), salt="alice", prompt_logprobs=1))[1] == 0


def test_hash_chains_on_parent():
    extra = b""
    h0 = hash_block(None, (1, 2), extra)
    assert hash_block(h0, (3, 4), extra) != hash_block(hash_block(None, (9, 9), extra), (3, 4), extra)
    assert hash_block(None, (1, 2), extra) == h0


def test_freed_cached_blocks_hit_until_evicted_in_lru_order():
    kv = KVCacheManager(4, 2)
    a = seq_for([1, 2, 3, 4, 5])
    run_prefill(kv, a)  # blocks 0,1 full and cached, block 2 partial
    kv.free(a)
    assert kv.pool.free_queue.ids() == [3, 2, 1, 0]
    # Revive: a hit on blocks that sit in the free list takes them out of it.
    b = seq_for([1, 2, 3, 4, 9])
    hits, n = kv.get_computed_blocks(b)
    assert ids(hits) == [0, 1] and n == 4
    run_prefill(kv, b, (hits, n))
    assert ids(b.blocks) == [0, 1, 3]
    assert kv.pool.free_queue.ids() == [2]
    kv.free(b)
    # Fill the pool with unrelated tokens: the tail blocks of b go first, then 1, then 0.
    c = seq_for([7] * 7)
    assert kv.allocate_slots(c, 7)
    assert ids(c.blocks) == [2, 3, 1, 0]
    assert kv.pool.num_evictions == 2
    assert kv.get_computed_blocks(seq_for([1, 2, 3, 4, 5]))[1] == 0


def test_allocation_counts_revived_hits_against_free_blocks():
    kv = KVCacheManager(3, 2)
    a = seq_for([1, 2, 3, 4, 5])
    run_prefill(kv, a)
    kv.free(a)
    b = seq_for([1, 2, 3, 4, 6, 7, 8])  # hits 2 blocks; needs 2 more; only 1 block is not a hit
    hits, n = kv.get_computed_blocks(b)
    assert n == 4
    assert not kv.allocate_slots(b, 3, hits)
    assert kv.num_free_blocks == 3 and all(blk.ref_cnt == 0 for blk in hits)


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    kv = KVCacheManager(8, 4)
    group = RequestGroup("r", list(range(6)), SamplingParams(n=2))
    parent = group.seqs[0]
    run_prefill(kv, parent)
    from wllm.engine.request import Sequence

    child = Sequence(group, 1)
    copy = kv.fork(parent, child)
    assert copy == (1, 2)
    assert ids(child.blocks) == [0, 2]
    assert child.num_computed_tokens == 6
    assert kv.pool.blocks[0].ref_cnt == 2 and kv.pool.blocks[1].ref_cnt == 1
    kv.free(parent)
    kv.free(child)
    assert kv.num_free_blocks == 8


def test_fork_without_a_free_block_reports_false():
    kv = KVCacheManager(2, 4)
    group = RequestGroup("r", list(range(6)), SamplingParams(n=2))
    parent = group.seqs[0]
    run_prefill(kv, parent)
    from wllm.engine.request import Sequence

    child = Sequence(group, 1)
    assert kv.fork(parent, child) is False
    assert child.blocks == [] and kv.pool.blocks[0].ref_cnt == 1
