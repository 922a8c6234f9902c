"""The block manager against a simulated KV cache.

The state machine plays the model runner: it keeps (token id, writer) in every slot of a
fake device and CPU cache, applies exactly the copies the manager returns (copy-on-write,
swap out, swap in) and writes each step's new tokens through the block tables. After every
random operation (admit with prefix-cache lookup, append, fork, free, swap out, swap in)
each live sequence must read back its own tokens and every reference count must equal
the number of tables holding the block; every write must land in a block its sequence
holds alone and that is not in the prefix cache. At the end, freeing everything must free every block.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, precondition, rule

from blockmgr import BlockManager, NoFreeBlocksError, block_pool

BLOCK_SIZE = 4
NUM_BLOCKS = 12
NUM_CPU_BLOCKS = 6
# A small alphabet so random prompts share prefixes and hit the cache.
tokens = st.lists(st.integers(0, 2), min_size=1, max_size=14)


class BlockManagerMachine(RuleBasedStateMachine):
    seqs = Bundle("seqs")

    @initialize(caching=st.booleans(), watermark=st.sampled_from([0.0, 0.1]))
    def setup(self, caching, watermark):
        self.bm = BlockManager(
            NUM_BLOCKS, BLOCK_SIZE, watermark=watermark, enable_prefix_caching=caching, num_cpu_blocks=NUM_CPU_BLOCKS
        )
        self.device = [[None] * BLOCK_SIZE for _ in range(NUM_BLOCKS)]
        self.host = [[None] * BLOCK_SIZE for _ in range(NUM_CPU_BLOCKS)]
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.swapped: set[str] = set()
        self.next_id = 0

    # --- the fake model runner --------------------------------------------------------

    def _copy(self, src_mem, dst_mem, copies):
        snapshot = [list(src_mem[s]) for s, _ in copies]  # every read before any write
        for (_, d), rows in zip(copies, snapshot):
            dst_mem[d] = rows

    def _write(self, seq_id: str, start: int, end: int) -> None:
        table = self.bm.block_table(seq_id)
        for p in range(start, end):
            block = self.bm.gpu.blocks[table[p // BLOCK_SIZE]]
            # Copy-on-write: a step writes only into blocks its sequence holds alone and
            # that are not in the prefix cache (a cached block's contents are its key).
            assert block.ref_count == 1 and block.key is None, f"{seq_id} writes into shared or cached block {block.block_id}"
            self.device[block.block_id][p % BLOCK_SIZE] = (self.tokens[seq_id][p], seq_id)
        self.computed[seq_id] = end
        self.bm.cache_full_blocks(seq_id, self.tokens[seq_id], end)

    # --- operations -------------------------------------------------------------------

    @rule(target=seqs, prompt=tokens, chunk=st.integers(1, 14))
    def admit(self, prompt, chunk):
        hit = self.bm.find_prefix(prompt)
        target = min(len(prompt), hit.num_tokens + chunk)
        if not self.bm.can_admit(hit, target):
            with pytest.raises(NoFreeBlocksError) if self.bm.blocks_to_admit(hit, target) > self.bm.num_free_blocks else _nothing():
                self.bm.admit("never", hit, target, num_prompt_tokens=len(prompt))
            self.bm.free("never")
            return None
        seq_id = f"s{self.next_id}"
        self.next_id += 1
        self.tokens[seq_id] = list(prompt)
        self._copy(self.device, self.device, self.bm.admit(seq_id, hit, target, num_prompt_tokens=len(prompt)))
        # The cached prefix must already hold this prompt's tokens.
        self.computed[seq_id] = hit.num_tokens
        self._check_reads(seq_id)
        self._write(seq_id, hit.num_tokens, target)
        return seq_id

    @precondition(lambda self: self.tokens)
    @rule(seq=seqs, new=tokens, chunk=st.integers(1, 6))
    def append(self, seq, new, chunk):
        if seq not in self.tokens or seq in self.swapped:
            return
        if self.computed[seq] == len(self.tokens[seq]):
            self.tokens[seq] += new
        start = self.computed[seq]
        target = min(len(self.tokens[seq]), start + chunk)
        before = (self.bm.num_free_blocks, self.bm.block_table(seq))
        copies = self.bm.try_grow(seq, start, target)
        if copies is None:
            assert (self.bm.num_free_blocks, self.bm.block_table(seq)) == before  # nothing changed
            with pytest.raises(NoFreeBlocksError):
                self.bm.grow(seq, start, target)
            return
        self._copy(self.device, self.device, copies)
        self._write(seq, start, target)

    @rule(target=seqs, parent=seqs)
    def fork(self, parent):
        if parent not in self.tokens or parent in self.swapped:
            return None
        child = f"s{self.next_id}"
        self.next_id += 1
        self.bm.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])
        self.computed[child] = self.computed[parent]
        return child

    @rule(seq=consumes(seqs))
    def free(self, seq):
        if seq in self.tokens:
            self.bm.free(seq)
            del self.tokens[seq], self.computed[seq]
            self.swapped.discard(seq)

    @rule(seq=seqs)
    def swap_out(self, seq):
        if seq not in self.tokens or seq in self.swapped or not self.bm.can_swap_out(seq):
            return
        self._copy(self.device, self.host, self.bm.swap_out(seq))
        self.swapped.add(seq)

    @rule(seq=seqs)
    def swap_in(self, seq):
        if seq not in self.swapped or not self.bm.can_swap_in(seq, self.computed[seq], use_watermark=False):
            return
        self._copy(self.host, self.device, self.bm.swap_in(seq))
        self.swapped.discard(seq)

    # --- what must always hold --------------------------------------------------------

    def _check_reads(self, seq_id: str) -> None:
        if seq_id in self.swapped:
            memory, table = self.host, [b.block_id for b in self.bm._swapped[seq_id]]
        else:
            memory, table = self.device, self.bm.block_table(seq_id)
        read = [memory[table[p // BLOCK_SIZE]][p % BLOCK_SIZE][0] for p in range(self.computed[seq_id])]
        assert read == self.tokens[seq_id][: self.computed[seq_id]], f"{seq_id} reads back wrong tokens"

    @invariant()
    def every_sequence_reads_its_own_tokens(self):
        for seq_id in self.tokens:
            self._check_reads(seq_id)

    @invariant()
    def reference_counts_match_tables(self):
        self.bm.check_invariants()

    def teardown(self):
        for seq_id in list(self.tokens):
            self.bm.free(seq_id)
        self.bm.check_invariants()
        assert self.bm.num_free_blocks == NUM_BLOCKS and self.bm.num_swapped_blocks == 0


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_hash_collision_is_a_miss_not_a_wrong_block(monkeypatch):
    # Every key hashes alike: only comparing the tokens tells the blocks apart.
    monkeypatch.setattr(block_pool, "content_hash", lambda parent_hash, token_ids: 0)
    bm = BlockManager(8, BLOCK_SIZE)
    bm.admit("a", bm.find_prefix([1, 2, 3, 4, 5]), 5, num_prompt_tokens=5)
    bm.cache_full_blocks("a", [1, 2, 3, 4, 5], 5)
    assert bm.find_prefix([4, 3, 2, 1, 9]).num_tokens == 0
    assert bm.find_prefix([1, 2, 3, 4, 9]).num_tokens == 4


def test_freed_blocks_stay_cached_until_evicted_least_recent_first():
    bm = BlockManager(4, BLOCK_SIZE, watermark=0.0)
    for seq_id, prompt in (("a", [1] * 8), ("b", [2] * 8)):
        bm.admit(seq_id, bm.find_prefix(prompt + [0]), 9, num_prompt_tokens=9)
        bm.cache_full_blocks(seq_id, prompt + [0], 8)
        bm.free(seq_id)  # each held two full (cached) blocks and a partial one
    # b's three blocks came from the free queue's head: a's partial block (never cached),
    # the never-used block, then a's tail; a's head is still cached.
    assert bm.num_free_blocks == 4 and bm.gpu.num_cached == 3
    assert bm.find_prefix([1] * 8 + [0]).num_tokens == 4
    assert bm.find_prefix([2] * 8 + [0]).num_tokens == 8
    # Two more blocks: b's uncached partial block first, then the least recently freed
    # cached block, a's head; b's prefix survives.
    bm.grow("c", 0, 2 * BLOCK_SIZE)
    assert bm.find_prefix([1] * 8 + [0]).num_tokens == 0
    assert bm.find_prefix([2] * 8 + [0]).num_tokens == 8


def test_watermark_keeps_blocks_back_at_admission_only():
    bm = BlockManager(10, BLOCK_SIZE, watermark=0.2)
    hit = bm.find_prefix([0] * 33)
    assert not bm.can_admit(hit, 33)  # 9 blocks needed, 2 kept back
    assert bm.can_admit(hit, 32) and bm.can_admit(hit, 33, use_watermark=False)
    bm.admit("a", hit, 32, num_prompt_tokens=33)
    assert bm.try_grow("a", 32, 33) is not None  # a running sequence may eat into the watermark


def test_double_free_and_unknown_blocks_are_errors():
    bm = BlockManager(2, BLOCK_SIZE)
    block = bm.gpu.allocate()
    bm.gpu.decref(block)
    with pytest.raises(ValueError, match="freed more times"):
        bm.gpu.decref(block)
    with pytest.raises(ValueError, match="already holds"):
        bm.grow("a", 0, 1)
        bm.fork("a", "a")


def test_recomputing_a_fully_cached_prompt_copies_its_last_block():
    bm = BlockManager(8, BLOCK_SIZE)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]  # exactly two blocks
    bm.admit("first", bm.find_prefix(prompt), 8, num_prompt_tokens=8)
    bm.cache_full_blocks("first", prompt, 8)
    cached = bm.block_table("first")
    bm.free("first")
    hit = bm.find_prefix(prompt)
    assert [b.block_id for b in hit.blocks] == cached and hit.num_tokens == 7
    # Position 7 is recomputed for its logits: it lands in a private copy of the last block.
    copies = bm.admit("again", hit, 8, num_prompt_tokens=8)
    table = bm.block_table("again")
    assert table[0] == cached[0] and table[1] != cached[1]
    assert copies == [(cached[1], table[1])]
    assert bm.gpu.blocks[cached[1]].key is not None  # the cached block is untouched and still cached
    bm.check_invariants()
