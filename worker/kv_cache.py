"""The paged KV cache's memory: per layer a key and a value tensor
`[num_blocks, block_size, num_kv_heads, head_dim]` on the device, an optional swap space
of the same layout in CPU memory, and the block moves the block manager asks for."""

from __future__ import annotations

import torch

from kernels.reference import FP8_DTYPE
from worker.host_copy import to_device
from worker.models.base import CausalLM

# "auto": the model's dtype. "fp8": e4m3 with a per-layer scale (1.0, as vLLM's default),
# half the bytes of bf16, so twice the tokens in the same memory.
KV_CACHE_DTYPES = {"auto": None, "fp8": FP8_DTYPE, "fp8_e4m3": FP8_DTYPE}


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {sorted(KV_CACHE_DTYPES)}, got {name!r}")
    return KV_CACHE_DTYPES[name] or model_dtype


class KVCache:
    def __init__(self, layers: list[tuple[torch.Tensor, torch.Tensor]]):
        self.layers = layers
        self.swap_layers: list[tuple[torch.Tensor, torch.Tensor]] = []

    @staticmethod
    def block_bytes(model: CausalLM, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * model.num_layers * block_size * model.num_kv_heads * model.head_dim * elem

    @classmethod
    def for_model(cls, model: CausalLM, block_size: int, dtype: torch.dtype, num_blocks: int, device: torch.device) -> KVCache:
        shape = (num_blocks, block_size, model.num_kv_heads, model.head_dim)
        return cls([
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(model.num_layers)
        ])

    @property
    def num_blocks(self) -> int:
        return self.layers[0][0].shape[0]

    @property
    def bytes_per_block(self) -> int:
        key = self.layers[0][0]
        return 2 * len(self.layers) * key[0].numel() * key.element_size()

    def bind(self, model: CausalLM) -> None:
        model.bind_kv_caches(self.layers)

    def allocate_swap_space(self, num_blocks: int) -> None:
        """CPU blocks for swapped-out sequences; pinned when the cache is on a GPU so the
        copies are DMA transfers."""
        pin = self.layers[0][0].is_cuda
        shape = (num_blocks, *self.layers[0][0].shape[1:])
        dtype = self.layers[0][0].dtype
        self.swap_layers = [
            (torch.empty(shape, dtype=dtype, pin_memory=pin), torch.empty(shape, dtype=dtype, pin_memory=pin))
            for _ in self.layers
        ]

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Device block -> device block, all layers (copy-on-write)."""
        if copies:
            self._move(self.layers, self.layers, copies)

    def swap_out(self, copies: list[tuple[int, int]]) -> None:
        """Device block -> CPU block."""
        if copies:
            self._move(self.layers, self.swap_layers, copies)

    def swap_in(self, copies: list[tuple[int, int]]) -> None:
        """CPU block -> device block."""
        if copies:
            self._move(self.swap_layers, self.layers, copies)

    @staticmethod
    def _move(sources, destinations, copies: list[tuple[int, int]]) -> None:
        src_device, dst_device = sources[0][0].device, destinations[0][0].device
        src_ids = to_device([s for s, _ in copies], torch.int64, src_device)
        dst_ids = to_device([d for _, d in copies], torch.int64, dst_device)
        for src_layer, dst_layer in zip(sources, destinations):
            for src, dst in zip(src_layer, dst_layer):
                # Gather first, then scatter: every read happens before any write, so a block
                # may be both a source and a later destination within one step.
                # Asynchronous only host-to-device: a device-to-host copy must be complete
                # before the CPU reads it.
                gathered = src[src_ids].to(dst.device, non_blocking=dst.is_cuda)
                # index_put_, not index_copy_: the latter has no FP8 kernel on CPU.
                dst.index_put_((dst_ids,), gathered)
