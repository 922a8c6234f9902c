"""Small building blocks shared by every architecture."""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 and scale in the model dtype, as the reference implementation
        # does, so half-precision results round the same way.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return normed * self.weight


class MergedLinear(nn.Linear):
    """Several projections of the same input computed by one matmul (q/k/v, gate/up).

    The checkpoint stores each projection separately; shard ``i`` loads into its own
    range of output rows.
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool):
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = list(output_sizes)

    def shard_rows(self, index: int) -> tuple[int, int]:
        """(first output row, number of rows) of shard ``index``."""
        return sum(self.output_sizes[:index]), self.output_sizes[index]
