"""Facts about a local Hugging Face checkpoint that both the api and the engine need,
read without importing torch or building the model."""

from __future__ import annotations

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


def check_model_dir(model: str | Path) -> Path:
    path = Path(model)
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model: {str(model)!r} is not a local Hugging Face checkpoint directory (no config.json); "
            "pagedq loads weights only from disk"
        )
    return path


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
    if needed > max_model_len:
        raise PromptTooLong(
            f"prompt: {prompt_tokens} tokens + max_tokens {max_tokens or 1} = {needed}, "
            f"more than the model's context length of {max_model_len} (max_model_len)"
        )
