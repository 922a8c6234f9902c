"""Rotary position embeddings: inverse frequencies from the checkpoint's rope settings, and
a cos/sin table for every position computed once, so a step only gathers rows."""

from __future__ import annotations

import math

import torch
from torch import nn

from kernels import cpu_elementwise

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(hf_config) -> dict:
    """The rope settings as one dict with ``rope_theta`` and ``rope_type``.

    transformers >= 5 keeps them in ``config.rope_parameters``; older releases spread them
    over ``config.rope_theta`` and ``config.rope_scaling`` (where ``type`` is an older
    spelling of ``rope_type``). Both are accepted.
    """
    params = getattr(hf_config, "rope_parameters", None)
    if params is None:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params = dict(params)
    params["rope_type"] = params.get("rope_type", params.get("type")) or "default"
    if params["rope_type"] not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_type {params['rope_type']!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})"
        )
    return params


def inverse_frequencies(params: dict, head_dim: int) -> torch.Tensor:
    """float32 [head_dim // 2], computed exactly as the reference does so float32 logits agree."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (float(params["rope_theta"]) ** exponents)
    if params["rope_type"] == "linear":
        return inv_freq / params["factor"]
    if params["rope_type"] == "llama3":
        return _llama3_scaled(inv_freq, params)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    """Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the band
    between the two thresholds interpolated smoothly."""
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_context = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = ~(wavelen < old_context / high) & ~(wavelen > old_context / low)
    return torch.where(in_band, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin of every position up to `max_positions`, in the model dtype."""

    def __init__(self, head_dim: int, max_positions: int, params: dict):
        super().__init__()
        self.head_dim = head_dim
        self.params = params
        self.register_buffer("cos", torch.empty(max_positions, head_dim // 2), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, head_dim // 2), persistent=False)

    def init_buffers(self) -> None:
        inv_freq = inverse_frequencies(self.params, self.head_dim).to(self.cos.device)
        positions = torch.arange(self.cos.shape[0], device=self.cos.device, dtype=torch.float32)
        angles = positions[:, None] * inv_freq[None, :]
        self.cos.copy_(angles.cos())
        self.sin.copy_(angles.sin())

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows for `positions`, shaped [T, 1, head_dim // 2] to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def at(self, positions: torch.Tensor) -> "PositionedRotary":
        return PositionedRotary(self, positions)


class PositionedRotary:
    """One forward's rotation, shared by its layers: on the CPU a kernel rotating q and k in
    place from the tables; elsewhere the rows for the positions, gathered once (at the
    first layer) and applied by `apply_rotary`."""

    def __init__(self, table: RotaryEmbedding, positions: torch.Tensor):
        self.table = table
        self.positions = positions
        self.rows: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, heads, head_dim] and k [T, kv_heads, head_dim] rotated (possibly in place)."""
        if cpu_elementwise.usable(q, k) and q.dtype == self.table.cos.dtype:
            cpu_elementwise.rotary_embedding_cpu(q, k, self.table.cos, self.table.sin, self.positions)
            return q, k
        if self.rows is None:
            self.rows = self.table(self.positions)
        cos, sin = self.rows
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [T, heads, head_dim] by the half-split (GPT-NeoX / Hugging Face) convention."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
