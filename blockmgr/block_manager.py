"""Bookkeeping for the paged KV cache: which physical blocks each sequence reads and writes.

Like an OS page table: a sequence's block table lists, in order, the physical blocks that
hold its tokens (token `p` lives in block `table[p // block_size]` at row
`p % block_size`). Blocks are reference counted, so one physical block can sit in many
tables:

- prefix caching: a full block is indexed by its contents (its tokens and, through its
  parent's hash, every token before them); a new sequence starting with the same tokens
  takes the cached blocks instead of recomputing them;
- fork (parallel sampling): a child sequence starts with its parent's table;
- copy-on-write: before a step writes into a block that is shared, or cached (immutable),
  the writer gets a private copy; the device copies are returned to the caller, which
  runs them before the step's forward pass;
- swap: a preempted sequence's blocks are copied to CPU blocks and back.

Pure Python: no tensors, no model. Every mutation returns the device copies it needs.

Each sequence holding device blocks also holds a *row*: a small integer, stable while it
holds them, by which the model runner keeps its table in a persistent array. Rows whose
table changed since the runner last looked are handed over by `take_changed_rows()`, so
the runner copies only the differences (a decode step changes a row once per block).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

from blockmgr.block_pool import Block, BlockKey, BlockPool, NoFreeBlocksError

# (source block id, destination block id) pairs for the model runner to copy.
BlockCopies = list[tuple[int, int]]
# Whatever names a sequence: the engine uses its sequences' integer uids, tests strings.
SeqId = Hashable


@dataclass
class PrefixHit:
    """Cached blocks covering a prompt's first tokens."""

    blocks: list[Block] = field(default_factory=list)
    keys: list[BlockKey] = field(default_factory=list)
    # Tokens whose KV the blocks provide. At least one token is always left to compute, so
    # a fully cached prompt still produces the logits of its last token.
    num_tokens: int = 0


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up at admission
    hits: int = 0  # of those, tokens found in the cache


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        watermark: float = 0.01,
        enable_prefix_caching: bool = True,
        num_cpu_blocks: int = 0,
    ):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.gpu = BlockPool(num_blocks)
        self.cpu = BlockPool(num_cpu_blocks)
        self._watermark_blocks = int(watermark * num_blocks)
        self._tables: dict[SeqId, list[Block]] = {}
        self._swapped: dict[SeqId, list[Block]] = {}
        # Per sequence, the keys of its leading full blocks, so each is hashed once.
        self._keys: dict[SeqId, list[BlockKey]] = {}
        self.prefix_stats = PrefixCacheStats()
        self._rows: dict[SeqId, int] = {}
        self._free_rows: list[int] = []
        self._num_rows = 0
        # Row -> its sequence's table, for rows changed since take_changed_rows().
        self._changed: dict[int, list[Block]] = {}
        # Per sequence, the position up to which its table's blocks are allocated, private
        # and uncached: a write below it needs nothing (the scheduler's decode fast path).
        self.writable: dict[SeqId, int] = {}

    # --- queries ----------------------------------------------------------------------

    @property
    def num_total_blocks(self) -> int:
        return self.gpu.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.gpu.num_free

    @property
    def num_swapped_blocks(self) -> int:
        return self.cpu.num_blocks - self.cpu.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_total_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, seq_id: SeqId) -> list[int]:
        return [block.block_id for block in self._tables.get(seq_id, ())]

    def owners(self) -> dict[SeqId, list[int]]:
        """Every sequence's device blocks (for invariant checks and tests)."""
        return {seq_id: self.block_table(seq_id) for seq_id in self._tables}

    # --- rows: where the runner keeps each table -------------------------------------

    @property
    def num_rows(self) -> int:
        """Rows handed out so far: every row is below this."""
        return self._num_rows

    def row(self, seq_id: SeqId) -> int:
        return self._rows[seq_id]

    @property
    def rows(self) -> dict[SeqId, int]:
        """Every table's row by sequence (read it, never change it): one lookup per
        scheduled sequence and step, without a call."""
        return self._rows

    def take_changed_rows(self) -> list[tuple[int, list[int]]]:
        """(row, block ids) of every table that changed since the last call."""
        changed, self._changed = self._changed, {}
        return [(row, [block.block_id for block in table]) for row, table in changed.items()]

    def _open_table(self, seq_id: SeqId, table: list[Block]) -> None:
        self._tables[seq_id] = table
        if self._free_rows:
            row = self._free_rows.pop()
        else:
            row = self._num_rows
            self._num_rows += 1
        self._rows[seq_id] = row
        self._changed[row] = table

    def _close_table(self, seq_id: SeqId) -> list[Block]:
        self.writable.pop(seq_id, None)
        table = self._tables.pop(seq_id, [])
        row = self._rows.pop(seq_id, None)
        if row is not None:
            self._changed.pop(row, None)
            self._free_rows.append(row)
        return table

    # --- admission of a sequence that holds no blocks ---------------------------------

    def find_prefix(self, token_ids: list[int]) -> PrefixHit:
        """The longest run of cached full blocks that starts `token_ids`. Changes nothing."""
        hit = PrefixHit()
        if not self.enable_prefix_caching:
            return hit
        bs = self.block_size
        parent: int | None = None
        for start in range(0, len(token_ids) - bs + 1, bs):
            key = BlockKey(parent, tuple(token_ids[start : start + bs]))
            block = self.gpu.lookup(key)
            if block is None:
                break
            hit.blocks.append(block)
            hit.keys.append(key)
            parent = key.hash
        hit.num_tokens = min(len(hit.blocks) * bs, len(token_ids) - 1)
        return hit

    def blocks_to_admit(self, hit: PrefixHit, num_tokens: int) -> int:
        """Free blocks that `admit(..., hit, num_tokens)` would take."""
        # Cached blocks nobody references sit in the free queue until taken.
        revived = sum(1 for block in hit.blocks if block.ref_count == 0)
        return revived + self._blocks_to_write(hit.blocks, hit.num_tokens, num_tokens)

    def can_admit(self, hit: PrefixHit, num_tokens: int, *, use_watermark: bool = True) -> bool:
        """Whether a sequence may start with `num_tokens` slots. The watermark keeps a few
        blocks back so the sequences already running can grow for a while before anyone
        has to be preempted."""
        reserve = self._watermark_blocks if use_watermark else 0
        return self.num_free_blocks - self.blocks_to_admit(hit, num_tokens) >= reserve

    def admit(self, seq_id: SeqId, hit: PrefixHit, num_tokens: int, *, num_prompt_tokens: int) -> BlockCopies:
        """Give a blockless sequence the cached blocks of `hit` plus room for `num_tokens`
        tokens; it will write from `hit.num_tokens` on."""
        if self._tables.get(seq_id) or seq_id in self._swapped:
            raise ValueError(f"{seq_id} already holds blocks")
        if self.blocks_to_admit(hit, num_tokens) > self.num_free_blocks:
            raise NoFreeBlocksError(f"{seq_id}: not enough free blocks to admit")
        for block in hit.blocks:
            self.gpu.incref(block)
        self._open_table(seq_id, list(hit.blocks))
        self._keys[seq_id] = list(hit.keys)
        if self.enable_prefix_caching:
            self.prefix_stats.queries += num_prompt_tokens
            self.prefix_stats.hits += min(hit.num_tokens, num_prompt_tokens)
        return self._make_writable(seq_id, hit.num_tokens, num_tokens)

    # --- growth of a sequence that holds blocks ---------------------------------------

    def blocks_to_grow(self, seq_id: SeqId, write_from: int, num_tokens: int) -> int:
        return self._blocks_to_write(self._tables.get(seq_id, []), write_from, num_tokens)

    def grow(self, seq_id: SeqId, write_from: int, num_tokens: int) -> BlockCopies:
        """Make room for tokens up to `num_tokens` and make the blocks covering positions
        [write_from, num_tokens) private and mutable (all or nothing)."""
        copies = self.try_grow(seq_id, write_from, num_tokens)
        if copies is None:
            needed = self.blocks_to_grow(seq_id, write_from, num_tokens)
            raise NoFreeBlocksError(f"{seq_id}: needs {needed} more blocks, {self.num_free_blocks} free")
        return copies

    def try_grow(self, seq_id: SeqId, write_from: int, num_tokens: int) -> BlockCopies | None:
        """grow(), or None with nothing changed when the free blocks do not suffice (one
        pass instead of a check then a grow: the scheduler asks this of every running
        sequence at every step)."""
        table = self._tables.get(seq_id)
        if table is not None and num_tokens - write_from == 1 and write_from < len(table) * self.block_size:
            # A decode into a block it holds: nothing to do unless that block is shared or cached.
            block = table[write_from // self.block_size]
            if block.ref_count == 1 and block.key is None:
                return []
        if self._blocks_to_write(table or [], write_from, num_tokens) > self.num_free_blocks:
            return None
        if table is None:
            self._open_table(seq_id, [])
        self._keys.setdefault(seq_id, [])
        return self._make_writable(seq_id, write_from, num_tokens)

    def _blocks_to_write(self, table: list[Block], write_from: int, num_tokens: int) -> int:
        new = max(0, self.blocks_for(num_tokens) - len(table))
        first, end = write_from // self.block_size, min(len(table), self.blocks_for(num_tokens))
        copies = sum(1 for block in table[first:end] if block.ref_count > 1 or block.key is not None)
        return new + copies

    def _make_writable(self, seq_id: SeqId, write_from: int, num_tokens: int) -> BlockCopies:
        table = self._tables[seq_id]
        copies: BlockCopies = []
        for index in range(write_from // self.block_size, min(len(table), self.blocks_for(num_tokens))):
            shared = table[index]
            if shared.ref_count > 1 or shared.key is not None:
                private = self.gpu.allocate()
                copies.append((shared.block_id, private.block_id))
                table[index] = private
                self.gpu.decref(shared)
        changed = bool(copies)
        while len(table) < self.blocks_for(num_tokens):
            table.append(self.gpu.allocate())
            changed = True
        if changed:
            self._changed[self._rows[seq_id]] = table
        # Every block from write_from's on is now private; the last one is never full (or
        # cached) while writes reach into it.
        self.writable[seq_id] = len(table) * self.block_size
        return copies

    def cache_full_blocks(self, seq_id: SeqId, token_ids: list[int], num_computed_tokens: int) -> None:
        """Index the sequence's blocks that are now full of computed tokens (all of them
        known: `num_computed_tokens` must not exceed `len(token_ids)`)."""
        if not self.enable_prefix_caching:
            return
        keys = self._keys[seq_id]
        bs = self.block_size
        if num_computed_tokens < (len(keys) + 1) * bs:
            return
        table = self._tables[seq_id]
        for index in range(len(keys), num_computed_tokens // bs):
            key = BlockKey(keys[-1].hash if keys else None, tuple(token_ids[index * bs : (index + 1) * bs]))
            self.gpu.cache(table[index], key)
            keys.append(key)

    # --- sharing and release ----------------------------------------------------------

    def fork(self, parent_id: SeqId, child_id: SeqId) -> None:
        """The child starts with the parent's blocks; writes to shared ones copy first."""
        if child_id in self._tables or child_id in self._swapped:
            raise ValueError(f"{child_id} already holds blocks")
        table = self._tables[parent_id]
        for block in table:
            self.gpu.incref(block)
        self._open_table(child_id, list(table))
        self._keys[child_id] = list(self._keys[parent_id])
        # Both now share every block: their next writes copy first.
        self.writable.pop(parent_id, None)

    def free(self, seq_id: SeqId) -> None:
        """Drop every reference of `seq_id`, device and swapped (a no-op for an unknown id).
        Blocks are released last first, so a prefix's tail is evicted before its head."""
        for block in reversed(self._close_table(seq_id)):
            self.gpu.decref(block)
        for block in reversed(self._swapped.pop(seq_id, [])):
            self.cpu.decref(block)
        self._keys.pop(seq_id, None)

    # --- swap -------------------------------------------------------------------------

    def can_swap_out(self, seq_id: SeqId) -> bool:
        return len(self._tables.get(seq_id, ())) <= self.cpu.num_free

    def swap_out(self, seq_id: SeqId) -> BlockCopies:
        """Move the sequence's blocks to CPU blocks; returns (device block, CPU block) copies."""
        table = self._tables[seq_id]
        if len(table) > self.cpu.num_free:
            raise NoFreeBlocksError(f"{seq_id}: swap space has {self.cpu.num_free} free blocks, needs {len(table)}")
        self._close_table(seq_id)
        copies: BlockCopies = []
        swapped = []
        for block in table:
            cpu_block = self.cpu.allocate()
            copies.append((block.block_id, cpu_block.block_id))
            swapped.append(cpu_block)
        for block in reversed(table):
            self.gpu.decref(block)
        self._swapped[seq_id] = swapped
        return copies

    def blocks_to_swap_in(self, seq_id: SeqId, num_tokens: int) -> int:
        return max(len(self._swapped[seq_id]), self.blocks_for(num_tokens))

    def can_swap_in(self, seq_id: SeqId, num_tokens: int, *, use_watermark: bool = True) -> bool:
        reserve = self._watermark_blocks if use_watermark else 0
        return self.num_free_blocks - self.blocks_to_swap_in(seq_id, num_tokens) >= reserve

    def swap_in(self, seq_id: SeqId) -> BlockCopies:
        """Bring a swapped sequence back into fresh device blocks; returns (CPU block, device block) copies."""
        swapped = self._swapped[seq_id]
        if len(swapped) > self.num_free_blocks:
            raise NoFreeBlocksError(f"{seq_id}: needs {len(swapped)} blocks to swap in, {self.num_free_blocks} free")
        del self._swapped[seq_id]
        table = [self.gpu.allocate() for _ in swapped]
        copies = [(cpu_block.block_id, block.block_id) for cpu_block, block in zip(swapped, table)]
        for cpu_block in reversed(swapped):
            self.cpu.decref(cpu_block)
        for block, key in zip(table, self._keys[seq_id]):
            self.gpu.cache(block, key)
        self._open_table(seq_id, table)
        return copies

    def check_invariants(self) -> None:
        """Raises AssertionError unless every reference count equals the number of tables
        (device or swapped) that hold the block."""
        for pool, tables in ((self.gpu, self._tables), (self.cpu, self._swapped)):
            pool.check_invariants()
            holders = [0] * pool.num_blocks
            for table in tables.values():
                for block in table:
                    holders[block.block_id] += 1
            for block in pool.blocks:
                assert block.ref_count == holders[block.block_id], (
                    f"block {block.block_id}: ref_count {block.ref_count}, held by {holders[block.block_id]} tables"
                )
        rows = sorted(self._rows.values())
        assert set(self._rows) == set(self._tables), "every device table holds a row, and only those"
        for seq_id, end in self.writable.items():
            table = self._tables[seq_id]
            # (Which blocks a write can still reach depends on the sequence's position, which
            # only the engine knows: blocks below it may be shared, the one it writes never
            # is; a fork, which shares that one, ends the sequence's entry.)
            assert end == len(table) * self.block_size, f"{seq_id}: writable past its table"
        assert len(set(rows)) == len(rows) and not set(rows) & set(self._free_rows), "a row has two owners"
