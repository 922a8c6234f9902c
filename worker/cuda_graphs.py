"""Decode steps replayed from CUDA graphs.

A decode step launches a few kernels per layer for very little work each; at small batch
sizes the launches, not the GPU, set the pace. So decode forwards are captured once per
bucket of batch sizes (1, 2, 4, 8, 16, 24, ... as nano-vllm and vLLM do) over static input
buffers, and a step copies its inputs into the buffers and replays the smallest bucket
that holds it. Lanes past the real batch are padding: slot -1 (nothing is stored) and
context length 0 (attention reads nothing and outputs zeros); their rows are dropped.

Everything the captured kernels see is fixed at capture time except buffer contents:
`max_seq_len` is the model's context length, so the attention kernels' grids never
depend on a step's lengths. Without `capture()` the same padded buffers run eagerly,
which is how the padding is tested on a CPU.
"""

from __future__ import annotations

import torch

from kernels import AttentionMetadata
from worker.models.base import CausalLM

_SMALL_SIZES = (1, 2, 4)
_SIZE_STEP = 8


def bucket_sizes(max_batch: int) -> list[int]:
    sizes = [s for s in _SMALL_SIZES if s < max_batch]
    sizes += range(_SIZE_STEP, max_batch, _SIZE_STEP)
    return sizes + [max_batch]


class DecodeGraphs:
    def __init__(self, model: CausalLM, max_batch: int, max_blocks_per_seq: int, max_seq_len: int, device: torch.device):
        self.model = model
        self.sizes = bucket_sizes(max_batch)
        self.max_seq_len = max_seq_len
        self.device = device
        self.input_ids = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_batch,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((max_batch, max_blocks_per_seq), dtype=torch.int32, device=device)
        # One query token per lane, padding lanes included.
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}

    def fits(self, batch: int) -> bool:
        return batch <= self.sizes[-1]

    def bucket(self, batch: int) -> int:
        return next(size for size in self.sizes if size >= batch)

    @torch.inference_mode()
    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        # Largest first, so smaller graphs reuse the memory pool the largest one reserved.
        for size in reversed(self.sizes):
            self._forward(size)  # compiles the kernels for this shape outside the capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._outputs[size] = self._forward(size)
            self._graphs[size] = graph
        torch.cuda.synchronize(self.device)

    def run(
        self,
        input_ids: torch.Tensor,  # int64 [batch], on the host
        positions: torch.Tensor,  # int64 [batch]
        slots: torch.Tensor,  # int64 [batch]
        seq_lens: torch.Tensor,  # int32 [batch]
        block_tables: torch.Tensor,  # int32 [batch, width]
    ) -> torch.Tensor:
        """Hidden states [batch, hidden] of one decode token per sequence."""
        batch = seq_lens.shape[0]
        size = self.bucket(batch)
        self._load(self.input_ids, input_ids, size, 0)
        self._load(self.positions, positions, size, 0)
        self._load(self.slot_mapping, slots, size, -1)
        self._load(self.seq_lens, seq_lens, size, 0)
        # Entries past a sequence's last block are never read, so stale ones may stay.
        self.block_tables[:batch, : block_tables.shape[1]].copy_(block_tables, non_blocking=True)
        if size in self._graphs:
            self._graphs[size].replay()
            return self._outputs[size][:batch]
        return self._forward(size)[:batch]

    @staticmethod
    def _load(buffer: torch.Tensor, values: torch.Tensor, size: int, pad: int) -> None:
        """The batch's values, then `pad` in the lanes up to the bucket's size."""
        batch = values.shape[0]
        buffer[:batch].copy_(values, non_blocking=True)
        buffer[batch:size].fill_(pad)

    def _forward(self, size: int) -> torch.Tensor:
        metadata = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            max_query_len=1,
            max_seq_len=self.max_seq_len,
        )
        return self.model(self.input_ids[:size], self.positions[:size], metadata)
