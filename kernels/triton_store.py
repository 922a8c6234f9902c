"""Triton kernel that writes each token's key and value into its paged-cache slot.

Same signature and semantics as `kernels.reference.store_kv_reference`: token ``t`` goes to
block ``slot_mapping[t] // block_size``, row ``slot_mapping[t] % block_size``; slot -1 marks a
padded lane (CUDA-graph batches) that must leave the cache untouched.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from kernels.reference import FP8_DTYPE, FP8_MAX


@triton.jit
def _store_kv_kernel(
    key,
    value,
    key_cache,
    value_cache,
    slot_mapping,
    k_scale,
    v_scale,
    stride_k_tok,
    stride_k_head,
    stride_k_dim,
    stride_v_tok,
    stride_v_head,
    stride_v_dim,
    stride_kc_block,
    stride_kc_row,
    stride_kc_head,
    stride_kc_dim,
    stride_vc_block,
    stride_vc_row,
    stride_vc_head,
    stride_vc_dim,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
    FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping + token)
    if slot < 0:
        return
    block = (slot // BLOCK_SIZE).to(tl.int64)
    row = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, DIM_PAD)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)

    k = tl.load(key + token * stride_k_tok + heads * stride_k_head + dims * stride_k_dim, mask=mask, other=0.0)
    v = tl.load(value + token * stride_v_tok + heads * stride_v_head + dims * stride_v_dim, mask=mask, other=0.0)
    if FP8:
        # Scaled into e4m3's range and saturated, as the reference does.
        k = tl.clamp(k.to(tl.float32) / k_scale, -FP8_MAX, FP8_MAX)
        v = tl.clamp(v.to(tl.float32) / v_scale, -FP8_MAX, FP8_MAX)
    k_dst = key_cache + block * stride_kc_block + row * stride_kc_row + heads * stride_kc_head + dims * stride_kc_dim
    v_dst = value_cache + block * stride_vc_block + row * stride_vc_row + heads * stride_vc_head + dims * stride_vc_dim
    tl.store(k_dst, k.to(key_cache.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(value_cache.dtype.element_ty), mask=mask)


def check_kv_cache(key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """The paged-cache layout both kernels rely on; returns (num_blocks, block_size, kv_heads, head_dim)."""
    if key_cache.dim() != 4:
        raise ValueError(f"key_cache must be [num_blocks, block_size, kv_heads, head_dim], got shape {tuple(key_cache.shape)}")
    if value_cache.shape != key_cache.shape or value_cache.dtype != key_cache.dtype:
        raise ValueError(
            f"value_cache must match key_cache: {tuple(value_cache.shape)} {value_cache.dtype} vs "
            f"{tuple(key_cache.shape)} {key_cache.dtype}"
        )
    if value_cache.device != key_cache.device:
        raise ValueError(f"value_cache is on {value_cache.device}, key_cache on {key_cache.device}")
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    return num_blocks, block_size, num_kv_heads, head_dim


def check_launchable(kernel: object, device: torch.device) -> None:
    """Compiled kernels need CUDA tensors; the interpreter runs them on CPU tensors, but only
    if TRITON_INTERPRET=1 was set before triton was first imported (triton.language's own
    helpers are compiled or interpreted from then on). Fail clearly, not inside the launcher."""
    if device.type != "cuda" and not isinstance(kernel, InterpretedFunction):
        raise ValueError(
            f"Triton kernels need CUDA tensors, got {device}; on CPU set TRITON_INTERPRET=1 "
            "before the process first imports triton"
        )


def store_kv_triton(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # int64 [num_tokens], -1 = skip
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    _, block_size, num_kv_heads, head_dim = check_kv_cache(key_cache, value_cache)
    expected = (slot_mapping.shape[0], num_kv_heads, head_dim)
    if slot_mapping.dim() != 1 or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be a 1-D int32/int64 tensor, got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    for name, tensor in (("key", key), ("value", value)):
        if tuple(tensor.shape) != expected:
            raise ValueError(f"{name} must have shape {expected} to match slot_mapping and the cache, got {tuple(tensor.shape)}")
    for name, tensor in (("key", key), ("value", value), ("slot_mapping", slot_mapping)):
        if tensor.device != key_cache.device:
            raise ValueError(f"{name} is on {tensor.device} but the cache is on {key_cache.device}")
    check_launchable(_store_kv_kernel, key_cache.device)
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        k_scale,
        v_scale,
        *key.stride(),
        *value.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        DIM_PAD=triton.next_power_of_2(head_dim),
        FP8=key_cache.dtype == FP8_DTYPE,
        FP8_MAX=FP8_MAX,
    )
