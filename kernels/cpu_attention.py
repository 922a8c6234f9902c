"""Paged attention and KV store for the CPU engine: a C++ kernel (csrc/cpu_attention.cpp)
that reads keys and values where they sit in the paged cache, every sequence of a step
(decodes, prefills, chunks after a cached prefix) in one call. Same signatures as
`kernels.reference`, against which it is tested.

The kernel is part of the CPU extension (kernels.cpu_extension), built at first use;
where it cannot be built the engine falls back to the pure-PyTorch path,
kernels.torch_attention.
"""

from __future__ import annotations

import torch


def store_kv_cpu(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # int64 [num_tokens], -1 = skip
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    torch.ops.pagedq_cpu.store_kv(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)


def paged_attention_cpu(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # int32 [num_seqs, max_blocks]
    query_start_loc: torch.Tensor,  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor,  # int32 [num_seqs]
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    out: torch.Tensor | None = None,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int | None = None,
) -> torch.Tensor:
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    if out is None:
        out = torch.empty_like(query)
    torch.ops.pagedq_cpu.paged_attention(
        query.contiguous(), key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale, k_scale, v_scale,
        sliding_window or 0, out,
    )
    return out
