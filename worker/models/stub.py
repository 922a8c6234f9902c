"""A forward that costs nothing, for measuring the host's own cost per step.

`EngineArgs(stub_forward=True)` (benchmarks only: `pagedq bench host`) keeps the real
model's shape, so the KV cache, block tables and every input the runner prepares are
what they would be, but the forward neither reads the cache nor multiplies anything: it
returns fixed logits in which one ordinary token always wins. Everything around the
forward (scheduling, input preparation, sampling, output processing) runs for real.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels import AttentionMetadata
from worker.models.base import CausalLM


class StubForward(nn.Module):
    def __init__(self, model: CausalLM):
        super().__init__()
        self.inner = model
        self.num_layers = model.num_layers
        self.num_kv_heads = model.num_kv_heads
        self.head_dim = model.head_dim
        self.vocab_size = model.vocab_size
        self._device = next(model.parameters()).device
        self._logits = self._fixed_logits(256)

    def _fixed_logits(self, rows: int) -> torch.Tensor:
        # The last id wins: never a special token of pagedq's tiny tokenizers (those come first).
        logits = torch.zeros((rows, self.vocab_size), dtype=torch.float32, device=self._device)
        logits[:, -1] = 1.0
        return logits

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata) -> torch.Tensor:
        return input_ids.new_empty((input_ids.shape[0], 0), dtype=torch.float32)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden.shape[0]
        if rows > self._logits.shape[0]:
            self._logits = self._fixed_logits(2 * rows)
        return self._logits[:rows]

    def bind_kv_caches(self, kv_caches) -> None:
        self.inner.bind_kv_caches(kv_caches)
