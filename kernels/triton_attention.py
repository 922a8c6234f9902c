"""Unified Triton paged attention: prefill, chunked prefill and decode in one launch.

Same signature and semantics as `kernels.reference.paged_attention_reference`, plus an
optional `num_splits`. The design (learned from vLLM's unified kernel and flash-decoding):

- One program per (sequence, tile of query tokens, KV head[, context split]). Its rows are
  (query token × query head of that KV head's group), so every K/V tile it loads serves
  the whole group once and `tl.dot` always sees M >= 16 rows, even for a single decode token.
- Keys are gathered through the block table one position at a time, so the key tile width
  is independent of the cache's block size.
- Query ``i`` of a sequence with ``q_len`` new tokens and ``seq_len`` total tokens sits at
  position ``seq_len - q_len + i`` and sees keys ``0..position`` (bottom-right causal
  alignment), which covers plain prefill, a chunk after a cached prefix, and decode.
- Sliding window (SLIDING_WINDOW > 0): query position p also needs key >= p - W + 1, and
  a program starts at the first key tile its earliest query can see.
- Softmax runs online in float32 (base 2, with log2(e) folded into the scale).
- Split-K (flash-decoding): with few programs and long contexts, each program covers one
  slice of the context and writes a normalised partial output plus its log-sum-exp in
  float32; a second kernel merges the slices.

Grids come from tensor shapes and the host ints `max_query_len` / `max_seq_len` only: no
device value is read back, so the launch can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from kernels.reference import FP8_DTYPE
from kernels.triton_store import check_kv_cache, check_launchable

# Context slices shorter than this are not worth a second kernel's merge.
MIN_KEYS_PER_SPLIT = 128
MAX_SPLITS = 32
# Largest grid y/z extent CUDA accepts; bounds split-K's merge grid, which has one row per query.
MAX_GRID_YZ = 65535
_PROGRAMS_PER_SM = 2


@triton.jit
def _paged_attention_kernel(
    query,
    key_cache,
    value_cache,
    block_tables,
    query_start_loc,
    seq_lens,
    out,
    partial_out,
    partial_lse,
    qk_scale,
    k_scale,
    v_scale,
    stride_q_tok,
    stride_q_head,
    stride_q_dim,
    stride_kc_block,
    stride_kc_row,
    stride_kc_head,
    stride_kc_dim,
    stride_vc_block,
    stride_vc_row,
    stride_vc_head,
    stride_vc_dim,
    stride_bt_seq,
    stride_bt_block,
    stride_o_tok,
    stride_o_head,
    stride_o_dim,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    FP32_DOT: tl.constexpr,
    KV_FP8: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,
):
    seq = tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS

    q_begin = tl.load(query_start_loc + seq)
    q_len = tl.load(query_start_loc + seq + 1) - q_begin
    first_q = q_tile * BLOCK_Q
    if first_q >= q_len:
        return
    cached_len = tl.load(seq_lens + seq) - q_len

    rows = tl.arange(0, BLOCK_M)
    q_idx = first_q + rows // GROUP_PAD
    head_in_group = rows % GROUP_PAD
    row_valid = (q_idx < q_len) & (head_in_group < GROUP)
    tokens = (q_begin + q_idx).to(tl.int64)
    heads = kv_head * GROUP + head_in_group
    q_pos = cached_len + q_idx
    dims = tl.arange(0, DIM_PAD)
    dim_valid = dims < HEAD_DIM
    row_mask = row_valid[:, None] & dim_valid[None, :]

    q = tl.load(
        query + tokens[:, None] * stride_q_tok + heads[:, None] * stride_q_head + dims[None, :] * stride_q_dim,
        mask=row_mask,
        other=0.0,
    )
    if FP32_DOT:
        q = q.to(tl.float32)

    # Keys this program may need: up to its last query's position; then its split's share.
    kv_end = cached_len + tl.minimum(first_q + BLOCK_Q, q_len)
    num_tiles = tl.cdiv(kv_end, TILE_N)
    if SLIDING_WINDOW > 0:
        # Tiles wholly behind the earliest query's window are skipped.
        first_tile = tl.maximum(cached_len + first_q - SLIDING_WINDOW + 1, 0) // TILE_N
    else:
        first_tile = 0
    tiles_per_split = tl.cdiv(num_tiles - first_tile, NUM_SPLITS)
    tile_begin = first_tile + split * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    block_table = block_tables + seq * stride_bt_seq
    for tile in range(tile_begin, tile_end):
        pos = tile * TILE_N + tl.arange(0, TILE_N)
        pos_valid = pos < kv_end
        block = tl.load(block_table + (pos // BLOCK_SIZE) * stride_bt_block, mask=pos_valid, other=0).to(tl.int64)
        row_in_block = pos % BLOCK_SIZE

        k = tl.load(  # transposed: [DIM_PAD, TILE_N]
            key_cache
            + block[None, :] * stride_kc_block
            + row_in_block[None, :] * stride_kc_row
            + kv_head * stride_kc_head
            + dims[:, None] * stride_kc_dim,
            mask=dim_valid[:, None] & pos_valid[None, :],
            other=0.0,
        )
        if KV_FP8:
            k = k.to(tl.float32) * k_scale
            if not FP32_DOT:
                k = k.to(q.dtype)
        if FP32_DOT:
            k = k.to(tl.float32)
            s = tl.dot(q, k, input_precision="ieee") * qk_scale
        else:
            s = tl.dot(q, k) * qk_scale
        # Causality also hides every position >= seq_len, as no query sits beyond the context.
        visible = pos[None, :] <= q_pos[:, None]
        if SLIDING_WINDOW > 0:
            visible = visible & (pos[None, :] > q_pos[:, None] - SLIDING_WINDOW)
        s = tl.where(visible, s, float("-inf"))

        # A row may see no key in this tile (or in this whole split): keep its max at -inf
        # but subtract 0 instead, so its probabilities are exactly 0 rather than NaN.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_shift = tl.where(m_new > float("-inf"), m_new, 0.0)
        p = tl.exp2(s - m_shift[:, None])
        alpha = tl.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)

        v = tl.load(
            value_cache
            + block[:, None] * stride_vc_block
            + row_in_block[:, None] * stride_vc_row
            + kv_head * stride_vc_head
            + dims[None, :] * stride_vc_dim,
            mask=pos_valid[:, None] & dim_valid[None, :],
            other=0.0,
        )
        if KV_FP8:
            v = v.to(tl.float32) * v_scale
            if not FP32_DOT:
                v = v.to(q.dtype)
        if FP32_DOT:
            v = v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    # Rows that saw no key at all (an empty split, or a padded lane with seq_len 0) output 0.
    has_keys = l_i > 0.0
    o = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    if NUM_SPLITS == 1:
        o_ptrs = out + tokens[:, None] * stride_o_tok + heads[:, None] * stride_o_head + dims[None, :] * stride_o_dim
        tl.store(o_ptrs, o.to(out.dtype.element_ty), mask=row_mask)
    else:
        partial_row = (tokens * NUM_HEADS + heads) * NUM_SPLITS + split
        tl.store(partial_out + partial_row[:, None] * HEAD_DIM + dims[None, :], o, mask=row_mask)
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(partial_lse + partial_row, lse, mask=row_valid)


@triton.jit
def _merge_splits_kernel(
    partial_out,
    partial_lse,
    out,
    query_start_loc,
    stride_o_tok,
    stride_o_head,
    stride_o_dim,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    q_idx = tl.program_id(1)
    head = tl.program_id(2)
    q_begin = tl.load(query_start_loc + seq)
    if q_idx >= tl.load(query_start_loc + seq + 1) - q_begin:
        return
    token = (q_begin + q_idx).to(tl.int64)

    splits = tl.arange(0, SPLITS_PAD)
    split_valid = splits < NUM_SPLITS
    dims = tl.arange(0, DIM_PAD)
    first_row = (token * NUM_HEADS + head) * NUM_SPLITS
    lse = tl.load(partial_lse + first_row + splits, mask=split_valid, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    weights = tl.exp2(lse - tl.where(lse_max > float("-inf"), lse_max, 0.0))
    total = tl.sum(weights, 0)
    parts = tl.load(
        partial_out + (first_row + splits[:, None]) * HEAD_DIM + dims[None, :],
        mask=split_valid[:, None] & (dims[None, :] < HEAD_DIM),
        other=0.0,
    )
    o = tl.sum(parts * weights[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    o_ptrs = out + token * stride_o_tok + head * stride_o_head + dims * stride_o_dim
    tl.store(o_ptrs, o.to(out.dtype.element_ty), mask=dims < HEAD_DIM)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _default_num_splits(device: torch.device, programs: int, max_query_len: int, max_seq_len: int) -> int:
    """Split the context only when the grid would leave most of the GPU idle."""
    if device.type != "cuda":
        return 1
    target = _PROGRAMS_PER_SM * _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    if programs >= target or max_query_len > MAX_GRID_YZ:
        return 1
    splits = min(MAX_SPLITS, -(-target // programs), max(1, max_seq_len // MIN_KEYS_PER_SPLIT))
    return 1 << (splits.bit_length() - 1)  # a power of two bounds the number of compiled variants


def _check_inputs(
    query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, max_query_len, max_seq_len, out, sliding_window
):
    _, _, num_kv_heads, head_dim = check_kv_cache(key_cache, value_cache)
    if query.dim() != 3 or query.shape[2] != head_dim or query.shape[1] % num_kv_heads != 0:
        raise ValueError(
            f"query must be [num_tokens, num_heads, {head_dim}] with num_heads a multiple of "
            f"{num_kv_heads} KV heads, got {tuple(query.shape)}"
        )
    if seq_lens.dim() != 1 or query_start_loc.shape != (seq_lens.shape[0] + 1,):
        raise ValueError(
            f"seq_lens must be [num_seqs] and query_start_loc [num_seqs + 1], got "
            f"{tuple(seq_lens.shape)} and {tuple(query_start_loc.shape)}"
        )
    if block_tables.dim() != 2 or block_tables.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"block_tables must be [{seq_lens.shape[0]}, max_blocks], got {tuple(block_tables.shape)}")
    for name, tensor in (("block_tables", block_tables), ("query_start_loc", query_start_loc), ("seq_lens", seq_lens)):
        if tensor.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {tensor.dtype}")
    for name, tensor in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens)):
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if out is not None and (out.shape != query.shape or out.device != query.device):
        raise ValueError(f"out must match query's shape {tuple(query.shape)} and device, got {tuple(out.shape)} on {out.device}")
    for name, tensor in (("query", query), ("block_tables", block_tables), ("query_start_loc", query_start_loc), ("seq_lens", seq_lens)):
        if tensor.device != key_cache.device:
            raise ValueError(f"{name} is on {tensor.device} but the cache is on {key_cache.device}")
    if max_query_len < 0 or max_seq_len < 0:
        raise ValueError(f"max_query_len and max_seq_len must be >= 0, got {max_query_len} and {max_seq_len}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")


def paged_attention_triton(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # int32 [num_seqs, max_blocks]
    query_start_loc: torch.Tensor,  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor,  # int32 [num_seqs]
    scale: float,
    max_query_len: int,  # >= every sequence's query length: rows beyond it are not computed
    max_seq_len: int,
    out: torch.Tensor | None = None,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    num_splits: int | None = None,  # context slices per program; None chooses from the grid size
    sliding_window: int | None = None,
) -> torch.Tensor:
    _check_inputs(
        query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, max_query_len, max_seq_len, out,
        sliding_window,
    )
    check_launchable(_paged_attention_kernel, query.device)
    if out is None:
        out = torch.empty_like(query)
    num_seqs = seq_lens.shape[0]
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    num_heads = query.shape[1]
    if query.shape[0] == 0 or num_seqs == 0 or max_query_len == 0:
        return out

    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    dim_pad = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs every dimension >= 16
    # Enough rows for the longest query block (up to 64), never fewer than 16 or one whole group.
    block_m = max(group_pad, min(64, max(16, triton.next_power_of_2(max_query_len * group_pad))))
    block_q = block_m // group_pad
    q_tiles = triton.cdiv(max_query_len, block_q)
    if q_tiles > MAX_GRID_YZ:
        raise ValueError(f"max_query_len {max_query_len} exceeds what one launch covers ({MAX_GRID_YZ * block_q})")
    programs = num_seqs * q_tiles * num_kv_heads
    if num_splits is None:
        num_splits = _default_num_splits(query.device, programs, max_query_len, max_seq_len)
    elif num_splits < 1 or (num_splits > 1 and max_query_len > MAX_GRID_YZ):
        raise ValueError(f"num_splits must be >= 1 (and 1 when max_query_len > {MAX_GRID_YZ}), got {num_splits}")

    if num_splits == 1:
        partial_out = partial_lse = out  # unused: the kernel writes the final output itself
    else:
        partial_out = torch.empty((query.shape[0], num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device)
        partial_lse = torch.empty((query.shape[0], num_heads, num_splits), dtype=torch.float32, device=query.device)
    # bf16/fp16 tiles feed tensor cores directly on the GPU; the interpreter computes
    # 16-bit arithmetic wrongly, and mixed query/cache dtypes cannot share one dot. An FP8
    # cache is dequantised to the query's dtype in the kernel.
    kv_fp8 = key_cache.dtype == FP8_DTYPE
    fp32_dot = (
        query.device.type != "cuda"
        or query.dtype == torch.float32
        or (query.dtype != key_cache.dtype and not kv_fp8)
    )

    _paged_attention_kernel[(num_seqs, q_tiles, num_kv_heads * num_splits)](
        query,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        out,
        partial_out,
        partial_lse,
        scale * math.log2(math.e),
        k_scale,
        v_scale,
        *query.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        *block_tables.stride(),
        *out.stride(),
        NUM_HEADS=num_heads,
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_DIM=head_dim,
        DIM_PAD=dim_pad,
        BLOCK_SIZE=block_size,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        TILE_N=64 if dim_pad <= 64 else 32,
        NUM_SPLITS=num_splits,
        FP32_DOT=fp32_dot,
        KV_FP8=kv_fp8,
        SLIDING_WINDOW=sliding_window or 0,
        num_warps=4,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_seqs, max_query_len, num_heads)](
            partial_out,
            partial_lse,
            out,
            query_start_loc,
            *out.stride(),
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            DIM_PAD=triton.next_power_of_2(head_dim),
            NUM_SPLITS=num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
        )
    return out
