"""Which sequences run in the next engine step, and how many tokens each.

Policy (continuous batching with chunked prefill):
1. Running sequences go first, in priority order (smaller value first, then arrival).
   Each gets what it has not computed yet — one token for a decode, the rest of its
   prompt for a prefill — capped by what is left of the step's token budget, so a long
   prompt is prefilled over several steps while the others keep decoding.
2. When the cache cannot hold a running sequence's new tokens, the lowest-priority,
   newest running sequence is preempted. By recompute: its blocks are freed and it goes
   back to the waiting queue with all its tokens (prompt and output so far) to prefill
   again, usually from the prefix cache. By swap (when configured and the swap space has
   room): its blocks move to CPU memory and come back before anyone new is admitted.
   The request is never dropped.
3. If nothing was preempted, swapped sequences come back in priority order; then, if
   none is left swapped, waiting sequences are admitted in priority order while the
   budget, `max_num_seqs` and the cache (keeping the watermark free) allow. A waiting
   sequence starts after the longest prefix the cache already holds. The head of the
   queue blocks those behind it, so a large request is not starved by small ones.

Steps in flight (see pagedq.core.engine_core): a sequence's `num_tokens` counts the token
a step in flight will sample for it, so the next step computes that token's position. A
sequence whose last allowed token is in flight has nothing left to schedule; nor has one
whose request must see its tokens on the host first (`CoreRequest.sync`), until they are.
The scheduler decides; the engine core advances each sequence after a step is launched.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Literal

from blockmgr import BlockCopies, BlockManager, PrefixHit
from pagedq.core.request import Sequence, SequenceStatus

PreemptionMode = Literal["recompute", "swap"]
PREEMPTION_MODES = ("recompute", "swap")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    preemption_mode: PreemptionMode = "recompute"

    def __post_init__(self) -> None:
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")


@dataclass
class SchedulerOutput:
    # The scheduled sequences in order, and how many new tokens each computes this step.
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # Sequences admitted from the waiting queue this step (a preempted one may come again).
    admitted: list[Sequence] = field(default_factory=list)
    # Device work to do before the forward pass, in this order (see BlockManager).
    swap_out: BlockCopies = field(default_factory=list)  # (device block, CPU block)
    block_copies: BlockCopies = field(default_factory=list)  # copy-on-write (source, destination)
    swap_in: BlockCopies = field(default_factory=list)  # (CPU block, device block)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def _add(self, seq: Sequence, num_new_tokens: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new_tokens)


@dataclass
class PreemptionStats:
    recompute: int = 0
    swap: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        # A heap by sort_key (the uid breaks ties between a sequence and its recomputed self).
        self._waiting: list[tuple[tuple[int, int, int], int, Sequence]] = []
        self.running: list[Sequence] = []
        self._running_sorted = True
        self.swapped: list[Sequence] = []
        self.preemptions = PreemptionStats()

    # --- queue membership -------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        heapq.heappush(self._waiting, (seq.sort_key, seq.uid, seq))

    def _run(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self._running_sorted = False

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of whichever queue holds it and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            entries = [entry for entry in self._waiting if entry[2] is not seq]
            if len(entries) != len(self._waiting):
                self._waiting = entries
                heapq.heapify(self._waiting)
        self.block_manager.free(seq.uid)

    def finish(self, seq: Sequence) -> None:
        """A sequence is done, from whichever queue (with steps in flight it may have been
        preempted after sampling its last token)."""
        self.remove(seq)
        seq.status = SequenceStatus.FINISHED

    def fork(self, parent: Sequence, children: list[Sequence]) -> None:
        """Children start running with the parent's blocks and computed tokens. A parent
        that was preempted since (a beam waiting for its group) has no device blocks to
        share: its children wait to be recomputed."""
        for child in children:
            if parent.status is not SequenceStatus.RUNNING:
                child.num_computed_tokens = 0
                self.add(child)
                continue
            self.block_manager.fork(parent.uid, child.uid)
            child.num_computed_tokens = parent.num_computed_tokens
            self._run(child)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_swapped(self) -> int:
        return len(self.swapped)

    def next_in_line(self) -> Sequence:
        """The sequence that runs next once there is room: the first swapped one, else the waiting head."""
        return min(self.swapped, key=lambda s: s.sort_key) if self.swapped else self._waiting[0][2]

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self.running or self.swapped)

    # --- the policy -------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        if not self._running_sorted:
            self.running.sort(key=_sort_key)
            self._running_sorted = True
        bm = self.block_manager
        writable = bm.writable
        running = self.running
        seqs, num_new = out.seqs, out.num_new_tokens

        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            computed = seq.num_computed_tokens
            total = len(seq.token_ids) + seq.num_pending
            if computed == total or (seq.num_pending and (seq.request.sync or seq.at_length_limit)):
                # A beam waiting for the rest of its group; or its token in flight must be
                # seen first; or that token is its last.
                i += 1
                continue
            if total - computed == 1 and computed < writable.get(seq.uid, 0):
                # A decode inside blocks it owns alone: nothing to allocate or copy.
                seqs.append(seq)
                num_new.append(1)
                budget -= 1
                i += 1
                continue
            target = computed + min(total - computed, budget)
            while (copies := bm.try_grow(seq.uid, computed, target)) is None:
                # Sorted, so the last running sequence is the lowest-priority newest one;
                # it has not been scheduled yet this step (it is at or after index i).
                victim = running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            if copies:
                out.block_copies += copies
            seqs.append(seq)
            num_new.append(target - computed)
            budget -= target - computed
            i += 1

        if not out.preempted:
            budget = self._swap_in(out, budget)
            if not self.swapped:
                self._admit_waiting(out, budget)
        return out

    def _slots(self, seq: Sequence) -> int:
        """Running slots a sequence holds: a first sequence that will branch into n reserves n."""
        return 1 if seq.request.branched else seq.request.width

    def _swap_in(self, out: SchedulerOutput, budget: int) -> int:
        if not self.swapped:
            return budget
        bm = self.block_manager
        slots = sum(self._slots(s) for s in self.running)
        self.swapped.sort(key=lambda s: s.sort_key)
        while self.swapped and budget > 0 and slots < self.config.max_num_seqs:
            seq = self.swapped[0]
            start = seq.num_computed_tokens
            target = start + min(seq.num_uncomputed_tokens, budget)
            if not bm.can_swap_in(seq.uid, target, use_watermark=bool(self.running)):
                break
            self.swapped.pop(0)
            out.swap_in += bm.swap_in(seq.uid)
            # Swapped-in blocks are private and only full ones are keyed, so growing them
            # allocates new blocks and never copies one (a copy would run before the swap-in).
            out.block_copies += bm.grow(seq.uid, start, target)
            self._run(seq)
            slots += self._slots(seq)
            if target > start:  # else a parked beam: running again, nothing to compute
                out._add(seq, target - start)
                budget -= target - start
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        if not self._waiting:
            return
        bm = self.block_manager
        slots = sum(self._slots(s) for s in self.running)
        while self._waiting and budget > 0:
            seq = self._waiting[0][2]
            if slots + self._slots(seq) > self.config.max_num_seqs:
                break
            hit = bm.find_prefix(seq.token_ids) if seq.request.reads_prefix_cache else PrefixHit()
            target = hit.num_tokens + min(seq.num_tokens - hit.num_tokens, budget)
            # With nothing running, the watermark protects nobody; waiting on it would stall.
            if not bm.can_admit(hit, target, use_watermark=bool(self.running)):
                break
            heapq.heappop(self._waiting)
            out.block_copies += bm.admit(seq.uid, hit, target, num_prompt_tokens=seq.num_prompt_tokens)
            if seq.request.first_scheduled_time is None:
                seq.request.num_cached_tokens = hit.num_tokens
            seq.num_computed_tokens = hit.num_tokens
            self._run(seq)
            slots += self._slots(seq)
            out.admitted.append(seq)
            out._add(seq, target - hit.num_tokens)
            budget -= target - hit.num_tokens

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        seq.num_preemptions += 1
        out.preempted.append(seq)
        if self.config.preemption_mode == "swap" and self.block_manager.can_swap_out(seq.uid):
            out.swap_out += self.block_manager.swap_out(seq.uid)
            seq.status = SequenceStatus.SWAPPED
            self.swapped.append(seq)
            self.preemptions.swap += 1
            return
        self.block_manager.free(seq.uid)
        seq.num_computed_tokens = 0
        self.preemptions.recompute += 1
        self.add(seq)


def _sort_key(seq: Sequence) -> tuple[int, int, int]:
    return seq.sort_key
