"""The pool of fixed-size KV blocks: ref counts, an O(1) LRU free list and the prefix-cache map.

A block is free when no request references it (`ref_cnt == 0`). A free block may still hold a
cached full block of some earlier request (it keeps its `block_hash`); it stays findable in the
cache map until the allocator reaches it at the head of the free list, and only then is it
evicted ("lazy eviction"). Freed blocks go to the tail, so the least recently freed cached block
is evicted first.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class KVBlock:
    """One block of `block_size` token slots in every layer's KV tensor."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "token_ids", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Set only while the block is registered in the prefix cache.
        self.block_hash: bytes | None = None
        self.token_ids: tuple[int, ...] | None = None
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) pop-front, append and remove-from-middle.

    The links live in the blocks themselves, so removing a block that a prefix-cache hit revives
    needs no search.
    """

    def __init__(self, blocks: Sequence[KVBlock]) -> None:
        self._head = KVBlock(-1)  # sentinels keep the link updates branch-free
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise RuntimeError(f"{block} is not in the free list")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def popleft(self) -> KVBlock:
        first = self._head.next_free
        if first is None or first is self._tail:
            raise RuntimeError("no free KV blocks")
        self.remove(first)
        return first

    def ids(self) -> list[int]:
        """Block ids from head (next to be allocated) to tail; for tests and debugging."""
        out = []
        node = self._head.next_free
        while node is not None and node is not self._tail:
            out.append(node.block_id)
            node = node.next_free
        return out


class BlockPool:
    """Owns every KV block of one device and the map from block hash to cached block."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVBlock] = {}
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some request (cached free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Take `n` blocks from the head of the free list, evicting their cached content."""
        if n > self.num_free_blocks:
            raise RuntimeError(f"asked for {n} KV blocks, only {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
        block.block_hash = None
        block.token_ids = None
        self.num_evictions += 1

    def get_cached_block(self, block_hash: bytes, token_ids: tuple[int, ...]) -> KVBlock | None:
        """The cached block for `block_hash`, if its stored token ids match too."""
        block = self.cached.get(block_hash)
        if block is None or block.token_ids != token_ids:
            return None
        return block

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Add a reference to each block (prefix-cache hit or sharing), reviving free ones."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def cache_full_block(self, block: KVBlock, block_hash: bytes, token_ids: tuple[int, ...]) -> None:
        """Register a block whose `block_size` slots are all computed, so later prompts can hit it."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:
            # Another block already holds this content (e.g. a request swapped back in); keep one.
            return
        block.block_hash = block_hash
        block.token_ids = token_ids
        self.cached[block_hash] = block

    def free_blocks(self, ordered: Iterable[KVBlock]) -> None:
        """Drop one reference from each block; blocks reaching zero join the free list's tail
        in the given order (callers pass the order in which they should be evicted)."""
        for block in ordered:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; only allowed when no request holds a block."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
            block.token_ids = None
        self.cached.clear()
        return True
