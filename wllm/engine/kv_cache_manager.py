"""Per-sequence block tables on top of the `BlockPool`, plus automatic prefix caching.

A full block's key is a keyed BLAKE2b digest of (parent key, its token ids, LoRA id, cache_salt).
The key is random per process, so nobody can craft prompts that collide with another tenant's
cached blocks; a lookup also compares the stored token ids. A hit never covers the last prompt
token, because that token's logits are needed to sample the first output token.
"""

from __future__ import annotations

import hashlib
import os
from array import array

from wllm.engine.block_pool import BlockPool, KVBlock
from wllm.engine.request import Sequence

_HASH_KEY = os.urandom(32)


def hash_block(parent: bytes | None, token_ids: tuple[int, ...], extra: bytes) -> bytes:
    """Prefix-cache key of one full block, chained on its parent's key."""
    h = hashlib.blake2b(key=_HASH_KEY, digest_size=16)
    h.update(parent or b"\x00" * 16)
    h.update(array("q", token_ids).tobytes())
    h.update(extra)
    return h.digest()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Gives sequences KV blocks, shares cached prefixes, and counts prefix-cache traffic."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which served from the cache

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def _update_hashes(self, seq: Sequence) -> None:
        bs = self.block_size
        hashes = seq.block_hashes
        extra = seq.group.extra_hash_key
        for i in range(len(hashes), seq.num_tokens // bs):
            hashes.append(hash_block(hashes[-1] if hashes else None, seq.block_token_ids(i, bs), extra))

    def get_computed_blocks(self, seq: Sequence) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of `seq` (whole blocks), never including its last token."""
        if not self.enable_caching or seq.group.wants_prompt_logprobs:
            # Prompt logprobs need logits at every prompt position, so nothing may be skipped.
            return [], 0
        self._update_hashes(seq)
        bs = self.block_size
        max_blocks = (seq.num_tokens - 1) // bs
        hits: list[KVBlock] = []
        for i in range(max_blocks):
            block = self.pool.get_cached_block(seq.block_hashes[i], seq.block_token_ids(i, bs))
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * bs

    def allocate_slots(
        self,
        seq: Sequence,
        num_new_tokens: int,
        computed_blocks: list[KVBlock] | None = None,
    ) -> bool:
        """Make room for `num_new_tokens` more tokens of `seq`; False (and no change) if the pool
        is short. `computed_blocks` are prefix-cache hits for a sequence with no blocks yet."""
        if not computed_blocks:
            # Fast path of a decode step: usually the last block still has a free slot.
            need = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size) - len(seq.blocks)
            if need <= 0:
                return True
            if need > self.pool.num_free_blocks:
                return False
            seq.blocks.extend(self.pool.get_new_blocks(need))
            return True
        num_hit_tokens = len(computed_blocks) * self.block_size
        total = seq.num_computed_tokens + num_hit_tokens + num_new_tokens
        need = cdiv(total, self.block_size) - len(seq.blocks) - len(computed_blocks)
        # Hits that sit in the free list stop being free once we take them.
        revived = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if need > self.pool.num_free_blocks - revived:
            return False
        self.pool.touch(computed_blocks)
        seq.blocks.extend(computed_blocks)
        seq.num_registered_blocks = len(seq.blocks)
        if need > 0:
            seq.blocks.extend(self.pool.get_new_blocks(need))
        return True

    def record_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_query_tokens
        self.prefix_hits += num_hit_tokens

    def cache_computed_blocks(self, seq: Sequence, num_computed: int | None = None) -> None:
        """Offer the sequence's blocks whose slots are all computed to the prefix cache.
        `num_computed` (default: the sequence's own count) lets the scheduler register, before a
        launched step is applied, the blocks that step completes (see `Scheduler.schedule`, in flight);
        their token ids are on the host already."""
        if not self.enable_caching:
            return
        if num_computed is None:
            num_computed = seq.num_computed_tokens
        num_full = min(num_computed // self.block_size, len(seq.blocks))
        if num_full <= seq.num_registered_blocks:
            return
        self._update_hashes(seq)
        bs = self.block_size
        for i in range(seq.num_registered_blocks, num_full):
            self.pool.cache_full_block(seq.blocks[i], seq.block_hashes[i], seq.block_token_ids(i, bs))
        seq.num_registered_blocks = num_full

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks; its last blocks become the first to be evicted."""
        self.pool.free_blocks(reversed(seq.blocks))
        seq.blocks = []
        seq.num_registered_blocks = 0

    def uncache(self, seq: Sequence) -> None:
        """Drop the sequence's blocks from the prefix cache (their content may be wrong after a
        failed step)."""
        for block in seq.blocks:
            if block.block_hash is not None and self.pool.cached.get(block.block_hash) is block:
                del self.pool.cached[block.block_hash]
            block.block_hash = None
            block.token_ids = None

    def uncache_ids(self, block_ids: list[int]) -> None:
        """Drop the blocks with these ids from the prefix cache, whoever holds them now (the blocks a
        failed step wrote, including those of a sequence that already gave them back)."""
        for i in block_ids:
            block = self.pool.blocks[i]
            if block.block_hash is not None and self.pool.cached.get(block.block_hash) is block:
                del self.pool.cached[block.block_hash]
            block.block_hash = None
            block.token_ids = None

    def fork(self, parent: Sequence, child: Sequence) -> tuple[int, int] | None | bool:
        """Give `child` the parent's KV: shared full blocks plus a private copy of a partial last
        block. Returns the (src, dst) block copy to perform, None if no copy is needed, or False
        if the pool has no block for the copy (nothing is changed then)."""
        bs = self.block_size
        num_full = parent.num_computed_tokens // bs
        partial = parent.num_computed_tokens % bs != 0
        if partial and self.pool.num_free_blocks < 1:
            return False
        shared = parent.blocks[:num_full]
        self.pool.touch(shared)
        child.blocks = list(shared)
        child.num_registered_blocks = min(parent.num_registered_blocks, num_full)
        child.block_hashes = list(parent.block_hashes[:num_full])
        child.num_computed_tokens = parent.num_computed_tokens
        if not partial:
            return None
        (dst,) = self.pool.get_new_blocks(1)
        child.blocks.append(dst)
        return parent.blocks[num_full].block_id, dst.block_id
