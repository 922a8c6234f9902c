"""Which architectures pagedq runs, and building one from a local checkpoint directory."""

from __future__ import annotations

from pathlib import Path

import torch

from kernels import AttentionBackend
from pagedq.model_info import ARCHITECTURE_BY_MODEL_TYPE, check_model_dir, load_hf_config
from worker.models.base import CausalLM
from worker.models.checkpoint import SafetensorsCheckpoint
from worker.models.decoder import DECODER_FLAGS, DecoderLM
from worker.models.gpt2 import GPT2LM
from worker.tp.group import SINGLE, TensorParallel

SUPPORTED_ARCHITECTURES: tuple[str, ...] = (*DECODER_FLAGS, "GPT2LMHeadModel")

def architecture_of(hf_config) -> str:
    names = list(getattr(hf_config, "architectures", None) or [])
    if not names and getattr(hf_config, "model_type", None) in ARCHITECTURE_BY_MODEL_TYPE:
        names = [ARCHITECTURE_BY_MODEL_TYPE[hf_config.model_type]]
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    raise ValueError(
        f"model: architecture {names or hf_config.model_type!r} is not supported; "
        f"supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _build(architecture: str, hf_config, attention: AttentionBackend, tie_word_embeddings: bool,
           tp: TensorParallel) -> CausalLM:
    if architecture == "GPT2LMHeadModel":
        return GPT2LM(hf_config, attention, tie_word_embeddings, tp)
    return DecoderLM(hf_config, DECODER_FLAGS[architecture](hf_config), attention, tie_word_embeddings, tp)


def check_tensor_parallel(hf_config, size: int) -> None:
    """Refuses, with a ValueError naming tensor_parallel_size, a model whose heads, KV heads
    or MLP do not split across `size` ranks, before any rank starts: rank 0's shard is
    built on the meta device (which costs nothing), as every rank will build its own."""
    with torch.device("meta"):
        _build(architecture_of(hf_config), hf_config, None, True, TensorParallel(0, size))


def load_model(
    model_dir: str | Path, dtype: torch.dtype, device: torch.device, attention: AttentionBackend,
    tp: TensorParallel = SINGLE, hf_config=None,
) -> CausalLM:
    """Build the checkpoint's architecture with its weights in `dtype` on `device` (under
    tensor parallelism, rank `tp.rank`'s shard of them); `hf_config`: its config, when the
    caller has it already."""
    path = check_model_dir(model_dir)
    hf_config = hf_config if hf_config is not None else load_hf_config(path)
    architecture = architecture_of(hf_config)
    checkpoint = SafetensorsCheckpoint(path)
    tie = bool(getattr(hf_config, "tie_word_embeddings", False)) or "lm_head.weight" not in checkpoint.names
    # Built on the meta device so no time or memory goes into initialising weights that
    # the checkpoint overwrites; materialised uninitialised, then filled.
    with torch.device("meta"):
        model = _build(architecture, hf_config, attention, tie, tp)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.load_weights(checkpoint.tensors())
    model.init_buffers()
    model.eval().requires_grad_(False)
    model.pack_for_cpu()
    return model
