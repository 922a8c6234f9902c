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
        device = next(model.parameters()).device
        # The last id: never a special token of pagedq's tiny tokenizers (those come first).
        self._logits = torch.zeros(model.vocab_size, dtype=torch.float32, device=device)
        self._logits[-1] = 1.0

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata) -> torch.Tensor:
        return input_ids.new_empty((input_ids.shape[0], 0), dtype=torch.float32)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._logits.expand(hidden.shape[0], -1)

    def bind_kv_caches(self, kv_caches) -> None:
        self.inner.bind_kv_caches(kv_caches)
