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
_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
# oneDNN's bfloat16 linears need AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT: on a CPU with AVX2
# only, packing a bfloat16 weight raises, and its linears stay F.linear's.
ONEDNN_DTYPES = (torch.float32, torch.bfloat16) if _ONEDNN and torch.ops.mkldnn._is_mkldnn_bf16_supported() else (
    torch.float32,)
# The batch size the packed layout is tuned for; every other size runs on it too.
_PACK_BATCH_HINT = 64
# oneDNN builds (JIT-compiles) a kernel for each input row count it meets and keeps it in a
# cache of 1,024: a new count cost 0.6 ms per linear against 2-4 ms for the product itself
# on SmolLM2's shapes (8x the product on the tiny test model's), and ~0.8 MB of memory
# kept. An engine's steps meet every row count from 1 to max_num_batched_tokens, so its
# first minutes built hundreds of kernels (the tiny model's first pass over 512 requests
# took 9% more CPU and 330 MB more memory than with the buckets below) and a varied load
# kept evicting them. So inputs are padded to one of a few row counts: exact up to 32
# (small products cost in proportion to their rows: one row padded to 8 took 2.5x as
# long), then 16 steps per doubling (at most 1/16 of the rows padding), 160 counts up to
# 8,192: five linear shapes per model fit the cache.
_EXACT_ROWS = 32
_STEPS_PER_DOUBLING = 16


def padded_rows(rows: int) -> int:
    """The row count `rows` input rows are padded to for oneDNN (see above)."""
    if rows <= _EXACT_ROWS:
        return rows
    step = (1 << (rows.bit_length() - 1)) // _STEPS_PER_DOUBLING
    return (rows + step - 1) // step * step


def padded_row_counts(max_rows: int) -> list[int]:
    """Every row count that inputs of 1 to `max_rows` rows are padded to, ascending."""
    return sorted({padded_rows(rows) for rows in range(1, max_rows + 1)})


# Building a kernel costs about what a product of this many multiply-adds does (0.4-0.6 ms
# on this project's CPU): a row count is built ahead only where its product costs no more,
# i.e. where the first step to meet it would spend at least as long building as computing.
# On the tiny test model that is every count up to the token budget (576 products, 0.22 s
# at start); on SmolLM2 the few dozen smallest counts of its projections (98, 0.05 s).
_BUILD_AHEAD_MACS = 1 << 24


def build_kernels_ahead(weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor, max_rows: int) -> int:
    """Runs the packed product once at each padded row count up to `max_rows` whose product
    is cheap (see `_BUILD_AHEAD_MACS`), so oneDNN builds those kernels now rather than in
    the first steps that meet them; returns how many it ran."""
    out_features, in_features = weight.shape
    built = 0
    for rows in padded_row_counts(max_rows):
        if rows * in_features * out_features > _BUILD_AHEAD_MACS:
            break
        linear(torch.zeros(rows, in_features, dtype=weight.dtype), weight, bias, packed)
        built += 1
    return built


def pack_for_cpu(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` in oneDNN's blocked layout (an opaque tensor only `linear` reads), or None
    where oneDNN does not serve this weight."""
    if not _ONEDNN or weight.device.type != "cpu" or weight.dtype not in ONEDNN_DTYPES:
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_BATCH_HINT)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    if packed is not None and x.dtype == packed.dtype:
        rows = x.shape[0]
        padded = padded_rows(rows) if x.dim() == 2 else rows
        if padded != rows:
            x = F.pad(x, (0, 0, 0, padded - rows))
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")[:rows]
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear computed by `linear`, through a packed copy of the weight once
    `pack_for_cpu()` has made one (after the checkpoint is loaded)."""

    packed: torch.Tensor | None = None

    def pack_for_cpu(self) -> None:
        self.packed = pack_for_cpu(self.weight)

    def product_bias(self) -> torch.Tensor | None:
        """The bias the packed product adds (part of its oneDNN kernel's shape)."""
        return self.bias

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
