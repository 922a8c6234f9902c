"""The physical blocks of one device: reference counts, the free queue, and the prefix
cache's index of full blocks by content hash.

A block whose last reference is dropped goes back to the free queue but keeps its
contents and, if it was full, its place in the cache: a later request with the same
prefix takes it back out of the queue instead of recomputing it. Allocation takes the
block at the head of the queue (least recently freed) and evicts it from the cache.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


class NoFreeBlocksError(RuntimeError):
    pass


@dataclass(frozen=True)
class BlockKey:
    """What a full block holds: its tokens, and through `parent_hash` every token before them."""

    parent_hash: int | None
    token_ids: tuple[int, ...]
    # Computed once: a key is hashed when cached, looked up, evicted and as the next
    # block's parent.
    hash: int = field(init=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "hash", content_hash(self.parent_hash, self.token_ids))


def content_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent_hash, token_ids))


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    # Set while the block is in the prefix cache. A cached block is immutable: a sequence
    # that must write into it copies it first.
    key: BlockKey | None = None


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Block ids with no reference, in eviction order (head first).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cache: dict[int, Block] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        """Blocks with no reference, cached ones included (they are evicted on demand)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    def allocate(self) -> Block:
        if not self._free:
            raise NoFreeBlocksError("the KV cache has no free block")
        block = self.blocks[self._free.popitem(last=False)[0]]
        self._uncache(block)
        block.ref_count = 1
        return block

    def incref(self, block: Block) -> None:
        if block.ref_count == 0:
            del self._free[block.block_id]
        block.ref_count += 1

    def decref(self, block: Block) -> None:
        if block.ref_count <= 0:
            raise ValueError(f"block {block.block_id} freed more times than it was referenced")
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block.block_id] = None
            if block.key is None:
                # Nothing worth keeping: reuse it before any cached block.
                self._free.move_to_end(block.block_id, last=False)

    def lookup(self, key: BlockKey) -> Block | None:
        """The cached block holding exactly `key`'s contents. Comparing the keys, not just
        their hashes, means a hash collision is a miss rather than wrong attention."""
        block = self._cache.get(key.hash)
        return block if block is not None and block.key == key else None

    def cache(self, block: Block, key: BlockKey) -> None:
        """Index a block that has just become full. If another block already holds the same
        contents, this one stays unindexed (and mutable)."""
        if block.key is None and key.hash not in self._cache:
            block.key = key
            self._cache[key.hash] = block

    def _uncache(self, block: Block) -> None:
        if block.key is not None:
            del self._cache[block.key.hash]
            block.key = None

    def check_invariants(self) -> None:
        """Raises AssertionError if the free queue, reference counts and cache disagree."""
        for block in self.blocks:
            assert block.ref_count >= 0, f"block {block.block_id} has a negative reference count"
            assert (block.ref_count == 0) == (block.block_id in self._free), (
                f"block {block.block_id}: ref_count {block.ref_count} but in free queue: {block.block_id in self._free}"
            )
            if block.key is not None:
                assert self._cache.get(block.key.hash) is block, f"block {block.block_id} is keyed but not indexed"
        assert all(b.key is not None for b in self._cache.values())
