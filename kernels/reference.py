"""Plain PyTorch paged attention and KV-store: the oracle every other implementation
(the C++ CPU kernel, kernels.torch_attention, the Triton kernels) is tested against.
Same signatures.

Sliding-window attention (Mistral, Qwen2's upper layers): with `sliding_window=W` the
query at position p sees only keys at positions p - W + 1 .. p (Hugging Face's
`kv_idx > q_idx - sliding_window`), one mask term beside the causal one. None: no window.

An FP8 cache (float8_e4m3fn) holds value / scale, saturated to e4m3's range; readers
multiply by the scale again. `k_scale` and `v_scale` are 1.0 for any other cache dtype.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    if cache_dtype == FP8_DTYPE:
        return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return x.to(cache_dtype)


def from_cache(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    if x.dtype == FP8_DTYPE:
        return (x.float() * scale).to(dtype)
    return x.to(dtype)


def store_kv_reference(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # int64 [num_tokens], -1 = skip
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block_size = key_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, offsets] = to_cache(key[keep], key_cache.dtype, k_scale)
    value_cache[blocks, offsets] = to_cache(value[keep], value_cache.dtype, v_scale)


def paged_attention_reference(
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
    """Causal attention of each packed query block over its sequence's paged context.

    Single-token queries (decodes) are computed together in one batched product; longer
    query blocks (prefill chunks) one sequence at a time. Arithmetic is float32. A lane
    with no context (a padded CUDA-graph lane) outputs zeros.
    """
    if out is None:
        out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    q_lens = [b - a for a, b in zip(starts[:-1], starts[1:])]
    decode_seqs = [s for s, n in enumerate(q_lens) if n == 1]
    kv = (key_cache, k_scale, value_cache, v_scale)
    if decode_seqs:
        _decode(query, kv, block_tables, starts, lens, decode_seqs, scale, out, sliding_window)
    for s, n in enumerate(q_lens):
        if n > 1:
            _prefill(query, kv, block_tables[s], starts[s], n, lens[s], scale, out, sliding_window)
    return out


def outside_window(key_pos: torch.Tensor, query_pos: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """True where a key is too far behind its query to be seen (broadcasts like `<`)."""
    if sliding_window is None:
        return torch.zeros(torch.broadcast_shapes(key_pos.shape, query_pos.shape), dtype=torch.bool, device=key_pos.device)
    return key_pos <= query_pos - sliding_window


def _gathered_context(cache: torch.Tensor, cache_scale: float, block_ids: torch.Tensor) -> torch.Tensor:
    """[..., blocks] block ids -> [..., blocks * block_size, kv_heads, head_dim] in float32."""
    gathered = cache[block_ids.long()]
    return from_cache(gathered.flatten(-4, -3), torch.float32, cache_scale)


def _decode(query, kv, block_tables, starts, lens, seqs, scale, out, sliding_window):
    key_cache, k_scale, value_cache, v_scale = kv
    block_size = key_cache.shape[1]
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    dev = query.device
    rows = torch.tensor([starts[s] for s in seqs], device=dev)
    ctx = torch.tensor([lens[s] for s in seqs], device=dev)
    num_blocks = -(-max(lens[s] for s in seqs) // block_size)
    tables = block_tables[torch.tensor(seqs, device=dev)][:, :num_blocks]
    k = _gathered_context(key_cache, k_scale, tables)  # [S, C, KVH, D]
    v = _gathered_context(value_cache, v_scale, tables)
    q = query[rows].float().view(len(seqs), num_kv_heads, -1, head_dim)  # [S, KVH, G, D]
    scores = torch.einsum("skgd,sckd->skgc", q, k) * scale
    key_pos = torch.arange(k.shape[1], device=dev)[None, :]
    beyond = (key_pos >= ctx[:, None]) | outside_window(key_pos, ctx[:, None] - 1, sliding_window)  # [S, C]
    scores.masked_fill_(beyond[:, None, None, :], float("-inf"))
    probs = scores.softmax(dim=-1).nan_to_num_(0.0)  # all-masked rows: zeros, not NaN
    o = torch.einsum("skgc,sckd->skgd", probs, v)
    out[rows] = o.reshape(len(seqs), -1, head_dim).to(out.dtype)


def _prefill(query, kv, block_table, start, q_len, seq_len, scale, out, sliding_window):
    key_cache, k_scale, value_cache, v_scale = kv
    block_size = key_cache.shape[1]
    num_kv_heads = key_cache.shape[2]
    num_blocks = -(-seq_len // block_size)
    k = _gathered_context(key_cache, k_scale, block_table[:num_blocks])[:seq_len]  # [C, KVH, D]
    v = _gathered_context(value_cache, v_scale, block_table[:num_blocks])[:seq_len]
    q = query[start : start + q_len].float()  # [Q, H, D]
    group = q.shape[1] // num_kv_heads
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,chd->hqc", q, k) * scale
    # Bottom-right causal alignment: the query block is the last q_len positions of the context.
    q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)[:, None]
    key_pos = torch.arange(seq_len, device=query.device)[None, :]
    scores.masked_fill_((key_pos > q_pos) | outside_window(key_pos, q_pos, sliding_window), float("-inf"))
    o = torch.einsum("hqc,chd->qhd", scores.softmax(dim=-1), v)
    out[start : start + q_len] = o.to(out.dtype)
