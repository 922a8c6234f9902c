"""The attention step every architecture shares: write this step's K/V into the paged
cache, then attend over each sequence's whole cached context."""

from __future__ import annotations

import torch
from torch import nn

from kernels import AttentionBackend, AttentionMetadata


class PagedAttention(nn.Module):
    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, backend: AttentionBackend,
        sliding_window: int | None = None,
    ):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.backend = backend
        # Keys more than this many positions behind a query are not attended (None: all are).
        self.sliding_window = sliding_window
        # (key_cache, value_cache), each [num_blocks, block_size, num_kv_heads, head_dim];
        # owned by the model runner and bound before the first forward.
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        # An FP8 cache stores keys / k_scale and values / v_scale.
        self.k_scale = 1.0
        self.v_scale = 1.0

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,
        md: AttentionMetadata,
    ) -> torch.Tensor:  # [T, num_heads * head_dim]
        if self.kv_cache is None:
            raise RuntimeError("bind_kv_caches() must be called before the first forward")
        key_cache, value_cache = self.kv_cache
        self.backend.store_kv(k, v, key_cache, value_cache, md.slot_mapping, self.k_scale, self.v_scale)
        out = self.backend.paged_attention(
            q, key_cache, value_cache, md.block_tables, md.query_start_loc, md.seq_lens,
            self.scale, md.max_query_len, md.max_seq_len, k_scale=self.k_scale, v_scale=self.v_scale,
            sliding_window=self.sliding_window,
        )
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
