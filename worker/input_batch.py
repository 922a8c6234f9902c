"""A step's inputs, prepared from what changed since the last step.

Persistent state: every sequence holding KV blocks has a row (the block manager's
`row()`), and its block table lives in that row of one preallocated array (on a GPU, a
device array beside it). A step brings the rows whose tables changed (a decode step
changes a row once per block_size tokens; admission, forks, swaps and copies-on-write
change whole rows) and the step's own small arrays: token ids, positions, and where each
scheduled sequence starts. Everything per token (positions, slot mapping, sequence
lengths, which rows' logits to keep) comes from a handful of numpy operations over those
arrays, never a Python loop over tokens.

On a GPU the step's integers go to the device in one non-blocking copy from pinned
memory (two staging buffers, used alternately: a copy may still be in flight while the
next step is prepared; a buffer is refilled only once its last copy is done), and a
sequence whose last token was sampled by the step before takes it from that step's
sampled ids, which never left the device. On a CPU the same arrays are used in place.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kernels import AttentionMetadata


@dataclass
class StepPlan:
    """What the engine core asks of one forward: the scheduled sequences in order."""

    rows: list[int]  # each sequence's block-table row
    starts: list[int]  # the position of its first new token
    query_lens: list[int]  # how many new tokens it computes
    # The new tokens back to back; a token not yet known on the host (sampled by the step
    # before, still on the device) holds 0 here, at an index of `pending_at`, and is read
    # from row `pending_from` (the same position) of the previous step's sampled ids.
    token_ids: list[int]
    pending_at: list[int]
    pending_from: list[int]
    # Scheduled sequences (indices into rows) whose last token's logits are wanted.
    logits_of: list[int]
    # Table rows changed since the last step: (row, block ids).
    changed_rows: list[tuple[int, list[int]]]
    # Whose each scheduled sequence is (the engine core's sequences; the device side never
    # reads them): what a failure is traced back to.
    owners: list
    # Indices into token_ids whose logits come back too, after the sequences' rows (the
    # positions whose next prompt token a request asked the logprob of: prompt_logprobs).
    extra_logits: list[int] = field(default_factory=list)

    def extra_rows_of(self, indices: list[int]) -> list[int]:
        """Which of `extra_logits` (their positions there, in order) `subset(indices)` keeps."""
        firsts = np.cumsum([0, *self.query_lens])
        owner = np.searchsorted(firsts, self.extra_logits, side="right") - 1
        kept = set(indices)
        return [k for k, i in enumerate(owner.tolist()) if i in kept]

    def subset(self, indices: list[int]) -> StepPlan:
        """The plan of the scheduled sequences at `indices` (increasing) alone."""
        firsts = [0]
        for length in self.query_lens:
            firsts.append(firsts[-1] + length)
        pending = dict(zip(self.pending_at, self.pending_from))
        token_ids: list[int] = []
        pending_at: list[int] = []
        pending_from: list[int] = []
        moved: dict[int, int] = {}  # token index here -> in the subset
        for i in indices:
            for t in range(firsts[i], firsts[i + 1]):
                if t in pending:
                    pending_at.append(len(token_ids))
                    pending_from.append(pending[t])
                moved[t] = len(token_ids)
                token_ids.append(self.token_ids[t])
        position = {i: j for j, i in enumerate(indices)}
        return StepPlan(
            rows=[self.rows[i] for i in indices], starts=[self.starts[i] for i in indices],
            query_lens=[self.query_lens[i] for i in indices], token_ids=token_ids, pending_at=pending_at,
            pending_from=pending_from, logits_of=[position[i] for i in self.logits_of if i in position],
            changed_rows=self.changed_rows, owners=[self.owners[i] for i in indices],
            extra_logits=[moved[t] for t in self.extra_logits if t in moved],
        )


@dataclass
class StepInputs:
    """One step's inputs on the model's device."""

    input_ids: torch.Tensor  # int64 [num_tokens]
    positions: torch.Tensor  # int64 [num_tokens]
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # int64: rows of the packed tokens whose logits are wanted

    @property
    def is_decode_only(self) -> bool:
        return self.metadata.max_query_len == 1


class InputBatch:
    def __init__(self, max_blocks_per_seq: int, block_size: int, device: torch.device, vocab_size: int,
                 initial_rows: int = 64):
        self.block_size = block_size
        self.max_blocks = max_blocks_per_seq
        self.device = device
        self.vocab_size = vocab_size
        self._on_gpu = device.type == "cuda"
        self._tables_host = np.zeros((initial_rows, max_blocks_per_seq), dtype=np.int32)
        self._tables_device = (
            torch.zeros((initial_rows, max_blocks_per_seq), dtype=torch.int32, device=device) if self._on_gpu else None
        )
        self._staging: list[torch.Tensor] = []
        # Per staging buffer, the event recorded after its last copy was queued.
        self._copied: list[torch.cuda.Event] = []
        self._next_staging = 0

    def prepare(self, plan: StepPlan, last_sampled: torch.Tensor | None) -> StepInputs:
        """The step's inputs; `last_sampled` is the previous step's sampled ids (on the
        device), where `plan.pending` tokens are read from."""
        bs = self.block_size
        self._apply_changed_rows(plan.changed_rows)
        num_seqs = len(plan.rows)
        rows = np.asarray(plan.rows, dtype=np.int64)
        starts = np.asarray(plan.starts, dtype=np.int64)
        token_ids = np.asarray(plan.token_ids, dtype=np.int64)
        num_tokens = len(token_ids)
        if num_tokens == num_seqs:  # decode only: one token per sequence
            q_lens = 1
            positions = starts
            token_rows = rows
            query_start_loc = np.arange(num_seqs + 1, dtype=np.int64)
            logits_indices = np.asarray(plan.logits_of, dtype=np.int64)
            max_query_len = 1
        else:
            q_lens = np.asarray(plan.query_lens, dtype=np.int64)
            query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
            np.cumsum(q_lens, out=query_start_loc[1:])
            seq_of_token = np.repeat(np.arange(num_seqs), q_lens)
            positions = np.arange(num_tokens) - query_start_loc[seq_of_token] + starts[seq_of_token]
            token_rows = rows[seq_of_token]
            logits_indices = query_start_loc[1:][np.asarray(plan.logits_of, dtype=np.int64)] - 1
            max_query_len = int(q_lens.max())
        if plan.extra_logits:
            logits_indices = np.concatenate([logits_indices, np.asarray(plan.extra_logits, dtype=np.int64)])
        seq_lens = starts + q_lens
        max_seq_len = int(seq_lens.max())
        width = -(-max_seq_len // bs)
        slots = self._tables_host[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
        pending_index = np.asarray(plan.pending_at, dtype=np.int64)
        pending_rows = np.asarray(plan.pending_from, dtype=np.int64)
        if self._on_gpu:
            changed_rows, changed_data = self._changed_arrays(plan.changed_rows)
            (ids_d, positions_d, slots_d, qsl_d, seq_lens_d, logits_d, rows_d, changed_rows_d, changed_data_d,
             pending_index_d, pending_rows_d) = self._to_device(
                token_ids, positions, slots, query_start_loc, seq_lens, logits_indices, rows, changed_rows, changed_data,
                pending_index, pending_rows,
            )
            if len(changed_rows):
                self._tables_device[changed_rows_d] = changed_data_d.view(len(changed_rows), self.max_blocks).to(torch.int32)
            tables = self._tables_device.index_select(0, rows_d)[:, :width]
            qsl_d, seq_lens_d = qsl_d.to(torch.int32), seq_lens_d.to(torch.int32)
        else:
            ids_d, positions_d, slots_d, logits_d, pending_index_d, pending_rows_d = (
                torch.from_numpy(a) for a in (token_ids, positions, slots, logits_indices, pending_index, pending_rows)
            )
            qsl_d = torch.from_numpy(query_start_loc.astype(np.int32))
            seq_lens_d = torch.from_numpy(seq_lens.astype(np.int32))
            tables = torch.from_numpy(self._tables_host[rows, :width])
        if plan.pending_at:
            if last_sampled is None:
                raise RuntimeError("a pending token without the previous step's sampled ids")
            # Clamped: an id outside the vocabulary fails its request when the host sees it,
            # and must not fail this step's forward for everyone first.
            ids_d[pending_index_d] = last_sampled[pending_rows_d].clamp(0, self.vocab_size - 1)
        metadata = AttentionMetadata(
            slot_mapping=slots_d, block_tables=tables, query_start_loc=qsl_d, seq_lens=seq_lens_d,
            max_query_len=max_query_len, max_seq_len=max_seq_len,
        )
        return StepInputs(ids_d, positions_d, metadata, logits_d)

    def _apply_changed_rows(self, changed: list[tuple[int, list[int]]]) -> None:
        """Into the host tables (the device's follow in the step's one copy)."""
        if not changed:
            return
        needed = max(row for row, _ in changed) + 1
        if needed > len(self._tables_host):
            self._grow(needed)
        tables = self._tables_host
        for row, block_ids in changed:
            tables[row, : len(block_ids)] = block_ids

    def _changed_arrays(self, changed: list[tuple[int, list[int]]]) -> tuple[np.ndarray, np.ndarray]:
        rows = np.asarray([row for row, _ in changed], dtype=np.int64)
        return rows, self._tables_host[rows].astype(np.int64).ravel()

    def _grow(self, needed: int) -> None:
        size = max(needed, 2 * len(self._tables_host))
        grown = np.zeros((size, self.max_blocks), dtype=np.int32)
        grown[: len(self._tables_host)] = self._tables_host
        self._tables_host = grown
        if self._on_gpu:
            device_grown = torch.zeros((size, self.max_blocks), dtype=torch.int32, device=self.device)
            device_grown[: len(self._tables_device)] = self._tables_device
            self._tables_device = device_grown

    def _to_device(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        """One pinned staging buffer holds every array; one non-blocking copy moves it."""
        total = sum(len(a) for a in arrays)
        index = self._staging_buffer(total)
        staging = self._staging[index]
        host = staging.numpy()
        offset = 0
        for array in arrays:
            host[offset : offset + len(array)] = array
            offset += len(array)
        device = staging[:total].to(self.device, non_blocking=True)
        self._copied[index].record()
        out, offset = [], 0
        for array in arrays:
            out.append(device[offset : offset + len(array)])
            offset += len(array)
        return out

    def _staging_buffer(self, size: int) -> int:
        """The index of a staging buffer of at least `size` that no queued copy still reads.
        Two buffers, used in turn: the previous step's copy may still be in flight while
        this one is filled. In the engine's loop the other buffer's copy is done by now (steps
        overlap at most two deep, and a step's copy is done once its sampled ids have reached
        the host), so the wait costs nothing there; a caller that prepares forwards faster
        than the device runs them (ModelRunner.compile_served_shapes) waits here instead of
        overwriting an earlier forward's inputs before the device has read them."""
        if len(self._staging) < 2:
            self._staging.append(torch.empty(max(size, 4096), dtype=torch.int64, pin_memory=True))
            self._copied.append(torch.cuda.Event())
            buffer_index = len(self._staging) - 1
        else:
            buffer_index = self._next_staging
            self._copied[buffer_index].synchronize()
            if len(self._staging[buffer_index]) < size:
                self._staging[buffer_index] = torch.empty(2 * size, dtype=torch.int64, pin_memory=True)
        self._next_staging = 1 - buffer_index
        return buffer_index
