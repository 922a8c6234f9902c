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
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Literal

from blockmgr import BlockCopies, BlockManager
from pagedq.sequence import Sequence, SequenceStatus

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
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int

    @property
    def completes_prompt(self) -> bool:
        """After this step the sequence has no uncomputed tokens, so it samples one."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # Device work to do before the forward pass, in this order (see BlockManager).
    swap_out: BlockCopies = field(default_factory=list)  # (device block, CPU block)
    block_copies: BlockCopies = field(default_factory=list)  # copy-on-write (source, destination)
    swap_in: BlockCopies = field(default_factory=list)  # (CPU block, device block)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class PreemptionStats:
    recompute: int = 0
    swap: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self._waiting: list[tuple[tuple[int, int, int], Sequence]] = []  # heap by sort_key
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.preemptions = PreemptionStats()

    # --- queue membership -------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        heapq.heappush(self._waiting, (seq.sort_key, seq))

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of whichever queue holds it and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.swapped:
            self.swapped.remove(seq)
        else:
            entries = [entry for entry in self._waiting if entry[1] is not seq]
            if len(entries) != len(self._waiting):
                self._waiting = entries
                heapq.heapify(self._waiting)
        self.block_manager.free(seq.seq_id)

    def finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq.seq_id)
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
            self.block_manager.fork(parent.seq_id, child.seq_id)
            child.num_computed_tokens = parent.num_computed_tokens
            child.status = SequenceStatus.RUNNING
            self.running.append(child)

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
        return min(self.swapped, key=lambda s: s.sort_key) if self.swapped else self._waiting[0][1]

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self.running or self.swapped)

    # --- the policy -------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        self.running.sort(key=lambda s: s.sort_key)
        bm = self.block_manager

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.num_uncomputed_tokens == 0:
                i += 1  # a beam waiting for the rest of its group
                continue
            start = seq.num_computed_tokens
            target = start + min(seq.num_uncomputed_tokens, budget)
            while (copies := bm.try_grow(seq.seq_id, start, target)) is None:
                # Sorted, so the last running sequence is the lowest-priority newest one;
                # it has not been scheduled yet this step (it is at or after index i).
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            out.block_copies += copies
            out.scheduled.append(ScheduledSequence(seq, target - start))
            budget -= target - start
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
        bm = self.block_manager
        slots = sum(self._slots(s) for s in self.running)
        self.swapped.sort(key=lambda s: s.sort_key)
        while self.swapped and budget > 0 and slots < self.config.max_num_seqs:
            seq = self.swapped[0]
            start = seq.num_computed_tokens
            target = start + min(seq.num_uncomputed_tokens, budget)
            if not bm.can_swap_in(seq.seq_id, target, use_watermark=bool(self.running)):
                break
            self.swapped.pop(0)
            out.swap_in += bm.swap_in(seq.seq_id)
            # Swapped-in blocks are private and only full ones are keyed, so growing them
            # allocates new blocks and never copies one (a copy would run before the swap-in).
            out.block_copies += bm.grow(seq.seq_id, start, target)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            slots += self._slots(seq)
            if target > start:  # else a parked beam: running again, nothing to compute
                out.scheduled.append(ScheduledSequence(seq, target - start))
                budget -= target - start
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        bm = self.block_manager
        slots = sum(self._slots(s) for s in self.running)
        while self._waiting and budget > 0:
            seq = self._waiting[0][1]
            if slots + self._slots(seq) > self.config.max_num_seqs:
                break
            hit = bm.find_prefix(seq.token_ids)
            target = hit.num_tokens + min(seq.num_tokens - hit.num_tokens, budget)
            # With nothing running, the watermark protects nobody; waiting on it would stall.
            if not bm.can_admit(hit, target, use_watermark=bool(self.running)):
                break
            heapq.heappop(self._waiting)
            out.block_copies += bm.admit(seq.seq_id, hit, target, num_prompt_tokens=len(seq.prompt_token_ids))
            if seq.request.metrics.first_scheduled_time is None:
                seq.request.num_cached_tokens = hit.num_tokens
            seq.num_computed_tokens = hit.num_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            slots += self._slots(seq)
            out.scheduled.append(ScheduledSequence(seq, target - hit.num_tokens))
            budget -= target - hit.num_tokens

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        seq.num_preemptions += 1
        out.preempted.append(seq)
        if self.config.preemption_mode == "swap" and self.block_manager.can_swap_out(seq.seq_id):
            out.swap_out += self.block_manager.swap_out(seq.seq_id)
            seq.status = SequenceStatus.SWAPPED
            self.swapped.append(seq)
            self.preemptions.swap += 1
            return
        self.block_manager.free(seq.seq_id)
        seq.num_computed_tokens = 0
        self.preemptions.recompute += 1
        self.add(seq)
