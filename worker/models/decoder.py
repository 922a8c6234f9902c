"""One implementation of the Llama-style decoder (pre-norm RMSNorm, rotary, grouped-query
attention, gated MLP) shared by Llama, Mistral, Qwen2 and Qwen3, which differ only in the
flags of `DecoderFlags`.

Modules are named like the Hugging Face checkpoints' so tensors map by name; q/k/v and
gate/up are each fused into one matmul at load time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from kernels import AttentionBackend, AttentionMetadata, cpu_elementwise
from worker.models.attention import PagedAttention
from worker.models.base import CausalLM, WeightTarget
from worker.models.layers import MergedLinear, RMSNorm, activation
from worker.models.parallel_layers import ParallelLMHead, RowParallelLinear, VocabParallelEmbedding
from worker.models.rotary import PositionedRotary, RotaryEmbedding, rope_parameters
from worker.tp.group import TensorParallel


@dataclass(frozen=True)
class DecoderFlags:
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before rotary


def _llama_flags(cfg) -> DecoderFlags:
    attention_bias = bool(getattr(cfg, "attention_bias", False))
    return DecoderFlags(qkv_bias=attention_bias, o_bias=attention_bias, mlp_bias=bool(getattr(cfg, "mlp_bias", False)))


def _qwen3_flags(cfg) -> DecoderFlags:
    attention_bias = bool(getattr(cfg, "attention_bias", False))
    return DecoderFlags(qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=True)


DECODER_FLAGS: dict[str, Callable[[object], DecoderFlags]] = {
    "LlamaForCausalLM": _llama_flags,
    "MistralForCausalLM": lambda cfg: DecoderFlags(),
    "Qwen2ForCausalLM": lambda cfg: DecoderFlags(qkv_bias=True),
    "Qwen3ForCausalLM": _qwen3_flags,
}

# Checkpoint projection name -> (fused module name, shard index).
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def _head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def _num_kv_heads(cfg) -> int:
    return getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads


def layer_sliding_windows(cfg) -> list[int | None]:
    """Each layer's attention window (None: full attention), as transformers reads the
    config: Mistral's `sliding_window` covers every layer; Qwen2/Qwen3 window only with
    `use_sliding_window`, and only layers from `max_window_layers` on (their `layer_types`
    when the config lists them)."""
    num_layers = cfg.num_hidden_layers
    window = getattr(cfg, "sliding_window", None)
    if not window or getattr(cfg, "use_sliding_window", True) is False:
        return [None] * num_layers
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types:
        return [window if kind == "sliding_attention" else None for kind in layer_types]
    first = getattr(cfg, "max_window_layers", None) or 0
    return [window if i >= first else None for i in range(num_layers)]


class DecoderAttention(nn.Module):
    """This rank's query heads and the KV heads they read: q/k/v column-parallel, o_proj
    row-parallel (the block's one all-reduce)."""

    def __init__(self, cfg, flags: DecoderFlags, backend: AttentionBackend, sliding_window: int | None,
                 tp: TensorParallel):
        super().__init__()
        head_dim = _head_dim(cfg)
        num_heads = tp.split(cfg.num_attention_heads, "num_attention_heads")
        num_kv_heads, first_kv_head = tp.kv_heads(_num_kv_heads(cfg), cfg.num_attention_heads)
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        first_q, first_kv = tp.rank * self.q_size, first_kv_head * head_dim
        self.qkv_proj = MergedLinear(cfg.hidden_size, [self.q_size, self.kv_size, self.kv_size], bias=flags.qkv_bias,
                                     source_starts=[first_q, first_kv, first_kv])
        self.o_proj = RowParallelLinear(self.q_size, cfg.hidden_size, flags.o_bias, tp, first_column=first_q)
        if flags.qk_norm:
            self.q_norm = RMSNorm(head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, cfg.rms_norm_eps)
        self.qk_norm = flags.qk_norm
        self.attn = PagedAttention(num_heads, num_kv_heads, head_dim, head_dim**-0.5, backend, sliding_window)

    def forward(self, x: torch.Tensor, rotary: PositionedRotary, md: AttentionMetadata) -> torch.Tensor:
        num_tokens, a = x.shape[0], self.attn
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, a.num_heads, a.head_dim)
        k = k.view(num_tokens, a.num_kv_heads, a.head_dim)
        v = v.view(num_tokens, a.num_kv_heads, a.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(q, k)
        return self.o_proj(self.attn(q, k, v, md))


class GatedMLP(nn.Module):
    """This rank's intermediate columns: gate/up column-parallel, down_proj row-parallel."""

    def __init__(self, cfg, flags: DecoderFlags, tp: TensorParallel):
        super().__init__()
        size = tp.split(cfg.intermediate_size, "intermediate_size")
        first = tp.rank * size
        self.gate_up_proj = MergedLinear(cfg.hidden_size, [size, size], bias=flags.mlp_bias, source_starts=[first, first])
        self.down_proj = RowParallelLinear(size, cfg.hidden_size, flags.mlp_bias, tp, first_column=first)
        self.act = activation(cfg.hidden_act)
        self.silu = cfg.hidden_act in ("silu", "swish")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.silu and gate_up.dim() == 2 and gate_up.is_contiguous() and cpu_elementwise.usable(gate_up):
            return self.down_proj(cpu_elementwise.silu_and_mul_cpu(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg, flags: DecoderFlags, backend: AttentionBackend, sliding_window: int | None,
                 tp: TensorParallel):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DecoderAttention(cfg, flags, backend, sliding_window, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg, flags, tp)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, rotary: PositionedRotary,
                md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it is added): each norm adds
        the previous sublayer's output to the stream as it normalises (the first layer's
        stream is the embedding itself)."""
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h, rotary, md), residual)
        return self.mlp(h), residual


class DecoderStack(nn.Module):
    def __init__(self, cfg, flags: DecoderFlags, backend: AttentionBackend, tp: TensorParallel):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, flags, backend, window, tp) for window in layer_sliding_windows(cfg)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(_head_dim(cfg), cfg.max_position_embeddings, rope_parameters(cfg))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        rotary = self.rotary.at(positions)
        h, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            h, residual = layer(h, residual, rotary, md)
        return self.norm(h) if residual is None else self.norm(h, residual)[0]


class DecoderLM(CausalLM):
    def __init__(self, hf_config, flags: DecoderFlags, backend: AttentionBackend, tie_word_embeddings: bool,
                 tp: TensorParallel):
        super().__init__(
            hf_config,
            num_layers=hf_config.num_hidden_layers,
            num_kv_heads=tp.kv_heads(_num_kv_heads(hf_config), hf_config.num_attention_heads)[0],
            head_dim=_head_dim(hf_config),
            vocab_size=hf_config.vocab_size,
            tp=tp,
        )
        self.model = DecoderStack(hf_config, flags, backend, tp)
        self.lm_head = None if tie_word_embeddings else ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, tp)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, attn_metadata)

    def output_embedding(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def init_buffers(self) -> None:
        self.model.rotary.init_buffers()

    def weight_target(self, name: str) -> WeightTarget | None:
        if name.startswith("lm_head.") and self.lm_head is None:
            return None  # tied: the output projection is the input embedding
        if "rotary_emb." in name:
            return None  # older checkpoints saved the inverse frequencies; we derive them
        parts = name.split(".")
        for i, part in enumerate(parts):
            if part in _FUSED:
                fused, shard = _FUSED[part]
                return WeightTarget(".".join([*parts[:i], fused, *parts[i + 1 :]]), shard)
        return WeightTarget(name)
