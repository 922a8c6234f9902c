"""The decoder's per-layer elementwise ops on the CPU in one pass each (C++,
csrc/cpu_elementwise.cpp, part of kernels.cpu_extension): RMSNorm with the residual add
folded in, rotary embedding of q and k in place, and SiLU(gate) * up. Each computes what
the PyTorch code in worker.models computes, rounding where it rounds (bfloat16 results
identical, float32 within a sum's reordering), and is tested against it.

`usable(*tensors)` says whether these ops serve the given tensors: on the CPU, rows
contiguous, and the extension built (not with PAGEDQ_CPU_KERNEL=0).
"""

from __future__ import annotations

import torch

from kernels import cpu_extension


def usable(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.stride(-1) == 1 for t in tensors) and cpu_extension.load()


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [rows, D] contiguous, normalised and scaled by `weight` [D]."""
    out = torch.empty_like(x)
    torch.ops.pagedq_cpu.rms_norm(x, weight, eps, out)
    return out


def fused_add_rms_norm_cpu(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: residual += x, then x = rms_norm(residual) * weight (both [rows, D] contiguous)."""
    torch.ops.pagedq_cpu.fused_add_rms_norm(x, residual, weight, eps)


def rotary_embedding_cpu(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         positions: torch.Tensor) -> None:
    """In place: q [T, H, D] and k [T, KH, D] (rows contiguous) rotated by the rows of the
    tables cos / sin [max_positions, D / 2] at positions (int64 [T])."""
    torch.ops.pagedq_cpu.rotary_embedding(q, k, cos, sin, positions.contiguous())


def silu_and_mul_cpu(x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :I]) * x[:, I:] for x [T, 2I] contiguous."""
    out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype, device=x.device)
    torch.ops.pagedq_cpu.silu_and_mul(x, out)
    return out
