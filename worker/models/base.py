"""The contract between the model runner and every model implementation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from kernels import AttentionMetadata
from worker.models.attention import PagedAttention
from worker.models.layers import Linear, MergedLinear, Region, build_kernels_ahead, linear, pack_for_cpu
from worker.tp.group import TensorParallel

# A checkpoint tensor, or a safetensors slice of one that reads only what is indexed.
TensorSource = object


@dataclass(frozen=True)
class WeightTarget:
    """Where one checkpoint tensor goes."""

    param: str  # a name from model.named_parameters()
    shard: int | None = None  # the projection's index inside a MergedLinear
    transpose: bool = False  # GPT-2's Conv1D stores weights as [in, out]
    # One checkpoint tensor holding every projection of a MergedLinear stacked along its
    # output dimension (GPT-2's c_attn), each loaded as that projection's shard.
    stacked: bool = False


class CausalLM(nn.Module):
    """A decoder-only language model over a packed token axis and a paged KV cache.

    Subclasses build their modules (named like the checkpoint's, so most tensors map by
    name), implement `forward`, `weight_target` and `output_embedding`.
    """

    def __init__(self, hf_config, *, num_layers: int, num_kv_heads: int, head_dim: int, vocab_size: int,
                 tp: TensorParallel):
        super().__init__()
        self.hf_config = hf_config
        self.tp = tp
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads  # this rank's: what its KV cache holds
        self.head_dim = head_dim
        self.vocab_size = vocab_size

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        """[T] token ids at [T] positions, every scheduled sequence packed back to back ->
        final hidden states [T, hidden]."""
        raise NotImplementedError

    def output_embedding(self) -> torch.Tensor:
        """The [vocab, hidden] matrix that maps hidden states to logits."""
        raise NotImplementedError

    def weight_target(self, name: str) -> WeightTarget | None:
        """Where checkpoint tensor `name` loads; None for tensors to skip."""
        raise NotImplementedError

    def init_buffers(self) -> None:
        """Fill tables derived from the config (not the checkpoint) once the model is on its device."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits over the whole vocabulary (under tensor parallelism every rank's
        vocabulary columns, gathered, less the last rank's padding)."""
        logits = linear(hidden, self.output_embedding(), packed=self._packed_output).float()
        if self.tp.size == 1:
            return logits
        return self.tp.gather_columns(logits)[:, : self.vocab_size]

    _packed_output: torch.Tensor | None = None

    def pack_for_cpu(self) -> None:
        """Packs every linear's weight, and the output embedding, for oneDNN (see
        worker.models.layers); a no-op off the CPU. Weights must not change afterwards."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack_for_cpu()
        self._packed_output = pack_for_cpu(self.output_embedding())

    def build_cpu_kernels(self, token_rows: int, logit_rows: int) -> int:
        """Has oneDNN build the kernels of the cheap row counts of every packed linear shape
        now (worker.models.layers.build_kernels_ahead): each layer's projections see up to
        `token_rows` rows, the output embedding up to `logit_rows`. Returns the products run;
        0 off the CPU."""
        built, shapes = 0, set()
        for module in self.modules():
            if isinstance(module, Linear) and module.packed is not None:
                bias = module.product_bias()
                # oneDNN keeps a kernel per shape, not per weight: the layers share theirs.
                shape = (tuple(module.weight.shape), module.weight.dtype, bias is not None)
                if shape not in shapes:
                    shapes.add(shape)
                    built += build_kernels_ahead(module.weight, bias, module.packed, token_rows)
        if self._packed_output is not None:
            built += build_kernels_ahead(self.output_embedding(), None, self._packed_output, logit_rows)
        return built

    def bind_kv_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        layers = [m for m in self.modules() if isinstance(m, PagedAttention)]
        if len(kv_caches) != len(layers):
            raise ValueError(f"expected {len(layers)} (key_cache, value_cache) pairs, got {len(kv_caches)}")
        for layer, (key_cache, value_cache) in zip(layers, kv_caches):
            layer.kv_cache = (key_cache, value_cache)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, TensorSource]]) -> None:
        """Copy each checkpoint tensor into its parameter (casting to the parameter's dtype
        and device); every parameter, and every shard of a merged one, must be filled.
        A parameter holding part of a tensor (tensor parallelism: its owner's
        `checkpoint_region`) reads only that part."""
        params = dict(self.named_parameters())
        pending = {(name, shard) for name in params for shard in self._shards_of(name)}
        for ckpt_name, source in weights:
            target = self.weight_target(ckpt_name)
            if target is None:
                continue
            if target.param not in params:
                raise ValueError(f"checkpoint tensor {ckpt_name!r} has no place in {type(self).__name__}")
            owner = self._owner(target.param)
            shards = self._shards_of(target.param) if target.stacked else [target.shard]
            for stack_index, shard in enumerate(shards):
                dest = params[target.param]
                if shard is not None:
                    start, rows = owner.shard_rows(shard)
                    dest = dest.narrow(0, start, rows)
                region = getattr(owner, "checkpoint_region", None)
                region = region(target.param.rpartition(".")[2], shard) if region is not None else None
                tensor = _read(source, region, target.transpose, (stack_index, len(shards)) if target.stacked else None)
                if region is not None and tensor.shape[region[0]] < dest.shape[region[0]]:
                    dest.zero_()  # the vocabulary's padding rows
                    dest = dest.narrow(region[0], 0, tensor.shape[region[0]])
                if dest.shape != tensor.shape:
                    raise ValueError(
                        f"checkpoint tensor {ckpt_name!r} gives shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
                    )
                dest.copy_(tensor)
                pending.discard((target.param, shard))
        if pending:
            missing = sorted(f"{name}[{shard}]" if shard is not None else name for name, shard in pending)
            raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {missing[:5]}")

    def _owner(self, param_name: str) -> nn.Module:
        return self.get_submodule(param_name.rpartition(".")[0])

    def _shards_of(self, param_name: str) -> list[int | None]:
        owner = self._owner(param_name)
        return list(range(len(owner.output_sizes))) if isinstance(owner, MergedLinear) else [None]


def _read(source: TensorSource, region: Region | None, transpose: bool, stacked: tuple[int, int] | None) -> torch.Tensor:
    """The part of a checkpoint tensor that `region` names (None: all of it), in the
    parameter's orientation. `stacked` (index, count): the tensor stacks `count` equal
    projections along its output dimension, and the region lies in projection `index`."""
    shape = list(source.get_shape() if hasattr(source, "get_shape") else source.shape)
    if stacked is not None:
        out_dim = 1 if transpose else 0
        index, count = stacked
        size = shape[out_dim] // count
        region = region if region is not None else (0, 0, size)
        region = (region[0], index * size + region[1], region[2])
    if region is None:
        tensor = source[:]
    else:
        dim, start, length = region
        if transpose and len(shape) == 2:
            dim = 1 - dim
        tensor = source[(slice(None),) * dim + (slice(start, start + length),)]
    return tensor.t() if transpose else tensor
