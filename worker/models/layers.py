"""Small building blocks shared by every architecture."""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu_elementwise

# Names as Hugging Face configs spell them (`hidden_act`, `activation_function`).
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_new": partial(F.gelu, approximate="tanh"),
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in _ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported (supported: {sorted(_ACTIVATIONS)})")
    return _ACTIVATIONS[name]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with `residual`, the residual stream's next sum and the next sublayer's
        input at once: (norm(x + residual), x + residual). On the CPU one kernel does either
        in one pass (the fused one in place, into x and residual)."""
        if x.is_contiguous() and (residual is None or residual.is_contiguous()) and cpu_elementwise.usable(x):
            rows = x.view(-1, x.shape[-1])
            if residual is None:
                return cpu_elementwise.rms_norm_cpu(rows, self.weight, self.eps).view(x.shape)
            cpu_elementwise.fused_add_rms_norm_cpu(rows, residual.view(-1, x.shape[-1]), self.weight, self.eps)
            return x, residual
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 and scale in the model dtype, as the reference implementation
        # does, so half-precision results round the same way.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return normed * self.weight


# On the CPU, matmuls through oneDNN (the op PyTorch's own compiler emits for CPU linears)
# with weights packed once into its blocked layout: float32 ran 2.2-2.7x faster than
# F.linear's MKL sgemm on this AMD machine at float32 rounding (max difference to float64
# 6e-6 vs MKL's 2e-6 on a 512x2816 product); bfloat16 1.2x (batch 64) to 2.3x (batch 1)
# faster than F.linear's own oneDNN call, which re-reads the plain weight every time.
ONEDNN_DTYPES = (torch.float32, torch.bfloat16)
_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
# The batch size the packed layout is tuned for; every other size runs on it too.
_PACK_BATCH_HINT = 64


def pack_for_cpu(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` in oneDNN's blocked layout (an opaque tensor only `linear` reads), or None
    where oneDNN does not serve this weight."""
    if not _ONEDNN or weight.device.type != "cpu" or weight.dtype not in ONEDNN_DTYPES:
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_BATCH_HINT)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    if packed is not None and x.dtype == packed.dtype:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear computed by `linear`, through a packed copy of the weight once
    `pack_for_cpu()` has made one (after the checkpoint is loaded)."""

    packed: torch.Tensor | None = None

    def pack_for_cpu(self) -> None:
        self.packed = pack_for_cpu(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed)


# Which part of a checkpoint tensor a parameter holds: (dimension, first index, length),
# in the parameter's own orientation ([out, in] for a linear's weight).
Region = tuple[int, int, int]


class MergedLinear(Linear):
    """Several projections of the same input computed by one matmul (q/k/v, gate/up), or
    one; column-parallel under tensor parallelism.

    The checkpoint stores each projection separately; shard ``i`` loads into its own
    range of output rows. Under tensor parallelism each projection is this rank's slice
    of the checkpoint's: its rows start at ``source_starts[i]`` there.
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, source_starts: list[int] | None = None):
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = list(output_sizes)
        self.source_starts = list(source_starts) if source_starts is not None else [0] * len(output_sizes)

    def shard_rows(self, index: int) -> tuple[int, int]:
        """(first output row, number of rows) of shard ``index``."""
        return sum(self.output_sizes[:index]), self.output_sizes[index]

    def checkpoint_region(self, param: str, shard: int | None) -> Region | None:
        """Weight and bias alike: the projection's rows of this rank."""
        return 0, self.source_starts[shard], self.output_sizes[shard]
