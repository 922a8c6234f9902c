"""Tokenizes prompts in the api and rejects what could never run, before anything is queued."""

from __future__ import annotations

import threading

from pagedq.model_info import PromptTooLong, check_prompt_fits, load_hf_config, load_tokenizer, resolve_max_model_len
from pagedq.protocol import GenerateRequest
from pagedq.settings import Settings


class PromptChecker:
    def __init__(self, settings: Settings):
        model = settings.require_model()
        hf_config = load_hf_config(model)
        self.tokenizer = load_tokenizer(model)
        self.vocab_size = int(hf_config.vocab_size)
        self.max_model_len = resolve_max_model_len(hf_config, settings.max_model_len)
        self.max_prompt_tokens = settings.max_prompt_tokens
        # Fast tokenizers are not safe to share across the threadpool's threads.
        self._lock = threading.Lock()

    def prompt_token_ids(self, request: GenerateRequest) -> list[int]:
        """The prompt as token ids; ValueError (naming the field) for anything the engine would refuse."""
        self._check_token_ids("stop_token_ids", request.stop_token_ids or [])
        if request.prompt_token_ids is not None:
            ids = request.prompt_token_ids
            self._check_token_ids("prompt_token_ids", ids)
        else:
            with self._lock:
                ids = self.tokenizer.encode(request.prompt)
        self._check_length(len(ids), request.max_tokens)
        return ids

    def chat_token_ids(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """The messages through the checkpoint's chat template, as token ids."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("messages: this model's tokenizer has no chat template; use /v1/completions")
        with self._lock:
            encoded = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
        # transformers 5 answers a BatchEncoding, earlier versions a list.
        return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)

    def token_texts(self, ids: list[int]) -> list[str]:
        """Each token's own text (a token that ends mid-character decodes to U+FFFD)."""
        with self._lock:
            return [self.tokenizer.decode([token_id]) for token_id in ids]

    def _check_token_ids(self, field: str, ids: list[int]) -> None:
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"{field}: ids must be in [0, {self.vocab_size}); got {bad[:5]}")

    def _check_length(self, prompt_tokens: int, max_tokens: int | None) -> None:
        if self.max_prompt_tokens is not None and prompt_tokens > self.max_prompt_tokens:
            raise PromptTooLong(f"prompt: {prompt_tokens} tokens, more than the limit of {self.max_prompt_tokens}")
        check_prompt_fits(prompt_tokens, max_tokens, self.max_model_len)
