"""The per-step description of a packed batch that every attention backend reads."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Sequences are packed one after another along the token axis.

    Sequence ``s`` owns query rows ``query_start_loc[s]:query_start_loc[s+1]``; its total
    context (cached tokens plus this step's new ones) is ``seq_lens[s]``, so its query row
    ``i`` sits at position ``seq_lens[s] - q_len + i`` and attends causally to every key up
    to and including that position.
    """

    slot_mapping: torch.Tensor  # int64 [num_tokens]; -1 marks padding that must not be stored
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq]
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    # Host-side bounds known when the batch is packed, so kernels size their grids
    # without reading device tensors back (CUDA-graph safe).
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]
