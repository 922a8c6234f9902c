"""Paged attention in pure PyTorch: fused SDPA over keys and values gathered out of the
paged cache. The CPU engine's fallback where the C++ kernel (kernels.cpu_attention)
cannot be built; 2-3x slower than it on decode-heavy steps. Same signature as
`kernels.reference.paged_attention_reference`, against which it is tested.

On a CPU the cost is the gather: every step copies each sequence's keys and values out
of their blocks. Decodes are batched into one SDPA call per group of similar context
lengths, each padded only to its group's longest, so little is gathered for nothing;
prefill chunks run one sequence at a time with a bottom-right causal mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.reference import from_cache, outside_window

# A decode group is closed when padding it to its longest context would gather more than
# this factor over what its sequences hold.
_MAX_PADDING = 1.25


def paged_attention_torch(
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
    if out is None:
        out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    kv = (key_cache, k_scale, value_cache, v_scale)
    decodes = []
    for s, (begin, end) in enumerate(zip(starts[:-1], starts[1:])):
        if end - begin == 1:
            decodes.append(s)
        elif end > begin:
            _prefill(query, kv, block_tables[s], begin, end - begin, lens[s], scale, out, sliding_window)
    for group in _decode_groups(decodes, lens):
        _decode(query, kv, block_tables, [starts[s] for s in group], [lens[s] for s in group], group, scale, out, sliding_window)
    return out


def _decode_groups(seqs: list[int], lens: list[int]) -> list[list[int]]:
    groups: list[list[int]] = []
    held = 0
    for s in sorted(seqs, key=lambda s: lens[s], reverse=True):
        # Sorted longest first, so a group's first member sets its padded length.
        if groups and lens[groups[-1][0]] * (len(groups[-1]) + 1) <= _MAX_PADDING * (held + lens[s]):
            groups[-1].append(s)
            held += lens[s]
        else:
            groups.append([s])
            held = lens[s]
    return groups


def _gather(cache: torch.Tensor, cache_scale: float, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[seqs, blocks] block ids -> [seqs, kv_heads, blocks * block_size, head_dim] in `dtype`."""
    num_seqs, num_blocks = block_ids.shape
    _, block_size, num_kv_heads, head_dim = cache.shape
    rows = from_cache(cache.index_select(0, block_ids.reshape(-1).long()), dtype, cache_scale)
    return rows.view(num_seqs, num_blocks * block_size, num_kv_heads, head_dim).transpose(1, 2)


def _decode(query, kv, block_tables, rows, ctx, seqs, scale, out, sliding_window):
    key_cache, k_scale, value_cache, v_scale = kv
    dev, block_size = query.device, key_cache.shape[1]
    longest = max(ctx)
    if longest == 0:  # padded lanes only
        out[rows] = 0
        return
    tables = block_tables[torch.tensor(seqs, device=dev), : -(-longest // block_size)]
    k, v = _gather(key_cache, k_scale, tables, query.dtype), _gather(value_cache, v_scale, tables, query.dtype)
    lengths = torch.tensor(ctx, device=dev)
    key_pos = torch.arange(k.shape[2], device=dev)[None, :]
    mask = (key_pos < lengths[:, None]) & ~outside_window(key_pos, lengths[:, None] - 1, sliding_window)  # [S, C]
    row_index = torch.tensor(rows, device=dev)
    q = query[row_index].unsqueeze(2)  # [S, H, 1, D]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True)
    o = o.squeeze(2).nan_to_num_(0.0)  # a lane with no context: zeros, as in the reference
    out[row_index] = o.to(out.dtype)


def _prefill(query, kv, block_table, start, q_len, seq_len, scale, out, sliding_window):
    key_cache, k_scale, value_cache, v_scale = kv
    dev, block_size = query.device, key_cache.shape[1]
    table = block_table[None, : -(-seq_len // block_size)]
    k = _gather(key_cache, k_scale, table, query.dtype)[:, :, :seq_len]
    v = _gather(value_cache, v_scale, table, query.dtype)[:, :, :seq_len]
    q = query[start : start + q_len].transpose(0, 1).unsqueeze(0)  # [1, H, Q, D]
    if q_len == seq_len and (sliding_window is None or sliding_window >= seq_len):
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        # The query block is the last q_len positions of the context (bottom-right causal).
        q_pos = torch.arange(seq_len - q_len, seq_len, device=dev)[:, None]
        key_pos = torch.arange(seq_len, device=dev)[None, :]
        mask = (key_pos <= q_pos) & ~outside_window(key_pos, q_pos, sliding_window)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    out[start : start + q_len] = o[0].transpose(0, 1).to(out.dtype)
