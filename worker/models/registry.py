"""Which architectures pagedq runs, and building one from a local checkpoint directory."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from kernels import AttentionBackend
from pagedq.model_info import check_model_dir, context_length, load_hf_config
from worker.models.base import CausalLM
from worker.models.checkpoint import SafetensorsCheckpoint
from worker.models.decoder import DECODER_FLAGS, DecoderLM
from worker.models.gpt2 import GPT2LM

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES: tuple[str, ...] = (*DECODER_FLAGS, "GPT2LMHeadModel")

# For configs written without an `architectures` list.
_ARCHITECTURE_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
}


def architecture_of(hf_config) -> str:
    names = list(getattr(hf_config, "architectures", None) or [])
    if not names and getattr(hf_config, "model_type", None) in _ARCHITECTURE_BY_MODEL_TYPE:
        names = [_ARCHITECTURE_BY_MODEL_TYPE[hf_config.model_type]]
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    raise ValueError(
        f"model: architecture {names or hf_config.model_type!r} is not supported; "
        f"supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _build(architecture: str, hf_config, attention: AttentionBackend, tie_word_embeddings: bool) -> CausalLM:
    if architecture == "GPT2LMHeadModel":
        return GPT2LM(hf_config, attention, tie_word_embeddings)
    return DecoderLM(hf_config, DECODER_FLAGS[architecture](hf_config), attention, tie_word_embeddings)


def _warn_if_sliding_window(hf_config) -> None:
    window = getattr(hf_config, "sliding_window", None) if getattr(hf_config, "use_sliding_window", True) else None
    if window and window < context_length(hf_config):
        logger.warning(
            "sliding-window attention (window %d) is not implemented: every layer attends to the full context, "
            "so sequences longer than %d tokens differ from the reference model", window, window,
        )


def load_model(
    model_dir: str | Path, dtype: torch.dtype, device: torch.device, attention: AttentionBackend
) -> CausalLM:
    """Build the checkpoint's architecture with its weights in `dtype` on `device`."""
    path = check_model_dir(model_dir)
    hf_config = load_hf_config(path)
    architecture = architecture_of(hf_config)
    checkpoint = SafetensorsCheckpoint(path)
    tie = bool(getattr(hf_config, "tie_word_embeddings", False)) or "lm_head.weight" not in checkpoint.names
    _warn_if_sliding_window(hf_config)
    # Built on the meta device so no time or memory goes into initialising weights that
    # the checkpoint overwrites; materialised uninitialised, then filled.
    with torch.device("meta"):
        model = _build(architecture, hf_config, attention, tie)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.load_weights(checkpoint.tensors())
    model.init_buffers()
    model.eval().requires_grad_(False)
    model.pack_for_cpu()
    return model
