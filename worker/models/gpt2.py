"""GPT-2: learned absolute positions, LayerNorm, a fused c_attn projection and a plain MLP.

Hugging Face stores GPT-2's projections as Conv1D weights ([in, out]); they are
transposed into nn.Linear ([out, in]) at load time.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels import AttentionBackend, AttentionMetadata
from worker.models.attention import PagedAttention
from worker.models.base import CausalLM, WeightTarget
from worker.models.layers import MergedLinear, activation
from worker.models.parallel_layers import ParallelLMHead, RowParallelLinear, VocabParallelEmbedding
from worker.tp.group import TensorParallel

_CONV1D = ("c_attn", "c_proj", "c_fc")


class GPT2Attention(nn.Module):
    """This rank's heads: c_attn (q, k and v stacked in one checkpoint tensor) column-parallel,
    c_proj row-parallel."""

    def __init__(self, cfg, layer_idx: int, backend: AttentionBackend, tp: TensorParallel):
        super().__init__()
        hidden = cfg.n_embd
        head_dim = hidden // cfg.n_head
        num_heads = tp.split(cfg.n_head, "n_head")
        scale = head_dim**-0.5 if cfg.scale_attn_weights else 1.0
        if cfg.scale_attn_by_inverse_layer_idx:
            scale /= layer_idx + 1
        size = num_heads * head_dim
        first = tp.rank * size
        self.c_attn = MergedLinear(hidden, [size] * 3, bias=True, source_starts=[first] * 3)
        self.c_proj = RowParallelLinear(size, hidden, True, tp, first_column=first)
        self.attn = PagedAttention(num_heads, num_heads, head_dim, scale, backend)

    def forward(self, x: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        shape = (x.shape[0], self.attn.num_heads, self.attn.head_dim)
        q, k, v = (t.view(shape) for t in self.c_attn(x).chunk(3, dim=-1))
        return self.c_proj(self.attn(q, k, v, md))


class GPT2MLP(nn.Module):
    def __init__(self, cfg, tp: TensorParallel):
        super().__init__()
        inner = tp.split(cfg.n_inner or 4 * cfg.n_embd, "n_inner")
        first = tp.rank * inner
        self.c_fc = MergedLinear(cfg.n_embd, [inner], bias=True, source_starts=[first])
        self.c_proj = RowParallelLinear(inner, cfg.n_embd, True, tp, first_column=first)
        self.act = activation(cfg.activation_function)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, cfg, layer_idx: int, backend: AttentionBackend, tp: TensorParallel):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.attn = GPT2Attention(cfg, layer_idx, backend, tp)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.mlp = GPT2MLP(cfg, tp)

    def forward(self, h: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        h = h + self.attn(self.ln_1(h), md)
        return h + self.mlp(self.ln_2(h))


class GPT2Stack(nn.Module):
    def __init__(self, cfg, backend: AttentionBackend, tp: TensorParallel):
        super().__init__()
        self.wte = VocabParallelEmbedding(cfg.vocab_size, cfg.n_embd, tp)
        self.wpe = nn.Embedding(cfg.n_positions, cfg.n_embd)
        self.h = nn.ModuleList(GPT2Block(cfg, i, backend, tp) for i in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        h = self.wte(input_ids) + self.wpe(positions)
        for block in self.h:
            h = block(h, md)
        return self.ln_f(h)


class GPT2LM(CausalLM):
    def __init__(self, hf_config, backend: AttentionBackend, tie_word_embeddings: bool, tp: TensorParallel):
        super().__init__(
            hf_config,
            num_layers=hf_config.n_layer,
            num_kv_heads=tp.split(hf_config.n_head, "n_head"),
            head_dim=hf_config.n_embd // hf_config.n_head,
            vocab_size=hf_config.vocab_size,
            tp=tp,
        )
        self.transformer = GPT2Stack(hf_config, backend, tp)
        self.lm_head = None if tie_word_embeddings else ParallelLMHead(hf_config.vocab_size, hf_config.n_embd, tp)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata) -> torch.Tensor:
        return self.transformer(input_ids, positions, attn_metadata)

    def output_embedding(self) -> torch.Tensor:
        return self.transformer.wte.weight if self.lm_head is None else self.lm_head.weight

    def weight_target(self, name: str) -> WeightTarget | None:
        if name.startswith("lm_head."):
            return None if self.lm_head is None else WeightTarget(name)
        if not name.startswith("transformer."):
            name = "transformer." + name  # the original OpenAI-converted checkpoints lack the prefix
        parts = name.split(".")
        if parts[-2] == "attn" and parts[-1] in ("bias", "masked_bias"):
            return None  # causal-mask buffers saved by older transformers releases
        transpose = parts[-1] == "weight" and parts[-2] in _CONV1D
        if parts[-2] == "c_attn":
            return WeightTarget(name, transpose=transpose, stacked=True)
        return WeightTarget(name, shard=0 if parts[-2] == "c_fc" else None, transpose=transpose)
