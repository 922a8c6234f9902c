"""The layers tensor parallelism splits besides the column-parallel `MergedLinear`: the
row-parallel linear that ends each attention and MLP block (its one all-reduce), and the
vocabulary split of the input embedding and the output head.

Each knows which part of the checkpoint's tensor it holds (`checkpoint_region`, read by
`CausalLM.load_weights`), so a rank reads only its slices. With one rank each is the
plain layer, and nothing extra runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker.models.layers import Linear, Region, linear
from worker.tp.group import TensorParallel


class RowParallelLinear(Linear):
    """Input features split: each rank multiplies its slice of the input (the heads or MLP
    columns it computed) by its columns of the weight; the partial products are summed
    over the ranks, then the bias (held whole by every rank) is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel, first_column: int):
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp
        self.first_column = first_column

    def checkpoint_region(self, param: str, shard: int | None) -> Region | None:
        return (1, self.first_column, self.in_features) if param == "weight" else None

    def product_bias(self) -> torch.Tensor | None:
        return self.bias if self.tp.size == 1 else None  # added after the all-reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(x)
        out = self.tp.all_reduce(linear(x, self.weight, None, self.packed))
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """Each rank holds a contiguous run of vocabulary rows (the last rank's padded with
    zeros); a token's embedding comes from the rank holding it, the others adding zeros."""

    def __init__(self, vocab_size: int, dim: int, tp: TensorParallel):
        first, rows = tp.vocab_rows(vocab_size)
        super().__init__(rows, dim)
        self.tp = tp
        self.first_row = first
        # Rows of the checkpoint this rank holds; the padding beyond stays zero.
        self.rows_in_checkpoint = max(0, min(rows, vocab_size - first))

    def checkpoint_region(self, param: str, shard: int | None) -> Region | None:
        return 0, self.first_row, self.rows_in_checkpoint

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(input_ids)
        local = input_ids - self.first_row
        elsewhere = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(elsewhere, 0), self.weight)
        out.masked_fill_(elsewhere.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection of an untied model, split by vocabulary rows as the input
    embedding is; `CausalLM.compute_logits` multiplies by it and gathers the columns."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("the LM head is applied by compute_logits")
