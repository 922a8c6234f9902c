"""Attention over the paged KV cache: a PyTorch reference and Triton kernels, one interface.

`get_attention_backend(name)` returns the pair (store_kv, paged_attention) with the
signatures of `kernels.reference`, the plain oracle every implementation is tested
against. "cpu" is the C++ kernel that reads the paged cache in place (kernels.cpu_attention,
built at first use with the rest of kernels.cpu_extension), the CPU engine's path; "torch"
fused SDPA over gathered blocks (kernels.torch_attention), its pure-PyTorch fallback where
the C++ kernels cannot be built; "triton" the GPU kernels. "auto" picks Triton on CUDA and
cpu elsewhere. The decoder's elementwise ops have their CPU kernels in
kernels.cpu_elementwise.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from kernels.metadata import AttentionMetadata
from kernels.reference import store_kv_reference
from kernels.torch_attention import paged_attention_torch

BACKENDS = ("auto", "cpu", "torch", "triton")


class AttentionBackend(NamedTuple):
    name: str
    store_kv: Callable
    paged_attention: Callable


def get_attention_backend(name: str, device_type: str) -> AttentionBackend:
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")
    if name == "auto":
        name = "triton" if device_type == "cuda" else "cpu"
    if name == "cpu":
        if device_type != "cpu":
            raise ValueError(f"attention_backend 'cpu' runs on the CPU only, not on {device_type}")
        from kernels import cpu_attention, cpu_extension

        if cpu_extension.load():
            return AttentionBackend("cpu", cpu_attention.store_kv_cpu, cpu_attention.paged_attention_cpu)
        name = "torch"  # load() warned why
    if name == "torch":
        return AttentionBackend("torch", store_kv_reference, paged_attention_torch)
    from kernels.triton_attention import paged_attention_triton
    from kernels.triton_store import store_kv_triton

    return AttentionBackend("triton", store_kv_triton, paged_attention_triton)


__all__ = ["AttentionMetadata", "AttentionBackend", "get_attention_backend", "BACKENDS"]
