"""Tokenizes prompts in the api and rejects what could never run, before anything is queued.

A prompt longer than any prompt of `max_model_len` tokens could be is refused by its length
alone, before it is tokenized: no token covers more characters than the vocabulary's
longest, so a text of more than max_model_len times that many characters cannot fit. A
long text is first tokenized by its beginning only: when that already holds more tokens
than the limit (give or take the word cut in two), the whole cannot fit either. So the
work a prompt costs is bounded by the limit, not by its size. What is tokenized in the api's
threads borrows one of a few tokenizer copies (a fast tokenizer is not safe to share between
threads), so one long prompt holds one copy, never every other client's submit; a short
prompt tokenized on the event loop (tokenized_inline) uses the loop's own copy, so the loop
never waits for a thread's.
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
from collections.abc import Iterator
from contextlib import contextmanager


from pagedq.model_info import (
    PromptTooLong,
    check_prompt_fits,
    generation_defaults,
    load_hf_config,
    load_tokenizer,
    resolve_max_model_len,
)
from pagedq.protocol import GenerateRequest
from pagedq.request_rules import check_width
from pagedq.sampling_params import SamplingParams
from pagedq.settings import Settings


# Tokenizer copies: as many prompts are tokenized at once (a copy loads in well under a second).
_TOKENIZER_COPIES = 4
# A long prompt's beginning tokenized first: this many characters per allowed token (text
# averages 3-5); and the tokens a word cut at that point may have more than when whole.
_HEAD_CHARS_PER_TOKEN = 8
_CUT_WORD_TOKENS = 64
# Prompts up to this many characters in all are tokenized on the event loop: a few hundred
# microseconds at most, less than the hop to a thread and back costs (~0.5 ms of the api's
# CPU per request on the project's 2-core machine, the GIL handed over twice). Longer ones,
# and chat templates, go to a thread; token ids are only checked, always on the loop.
INLINE_PROMPT_CHARS = 1024
# apply_chat_template's own arguments: the service sets them, chat_template_kwargs does not.
_TEMPLATE_ARGUMENTS = {
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
}


def _on_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def tokenized_inline(prompts: list[str | list[int]]) -> bool:
    """Whether these prompts (texts or token ids) are quick enough to prepare on the event loop."""
    return sum(len(prompt) for prompt in prompts if isinstance(prompt, str)) <= INLINE_PROMPT_CHARS


class PromptChecker:
    def __init__(self, settings: Settings):
        model = settings.require_model()
        hf_config = load_hf_config(model)
        self.tokenizer = load_tokenizer(model)
        self.vocab_size = int(hf_config.vocab_size)
        self.max_model_len = resolve_max_model_len(hf_config, settings.max_model_len)
        # Vocabulary entries are at least as long as the text their token covers (byte-level
        # ones spell each byte as a character); twice that allows for normalizers.
        longest_token = max(len(token) for token in self.tokenizer.get_vocab())
        self.max_prompt_chars = 2 * self.max_model_len * longest_token
        self.max_prompt_tokens = settings.max_prompt_tokens
        self.token_limit = min(self.max_model_len, self.max_prompt_tokens or self.max_model_len)
        # Checked once here (a bad value is the checkpoint's fault, not a request's).
        defaults = generation_defaults(model)
        self.generation_defaults = SamplingParams(**defaults).model_dump(include=set(defaults))
        self.compact_json = settings.structured_outputs_disable_any_whitespace
        # The workers' engines are built from the same settings.
        self.max_num_seqs = settings.max_num_seqs
        self.seqs_per_request = settings.seqs_per_request
        self._tokenizers: queue.SimpleQueue = queue.SimpleQueue()
        self._tokenizers.put(self.tokenizer)
        for _ in range(_TOKENIZER_COPIES - 1):
            self._tokenizers.put(load_tokenizer(model))
        self._model = model
        # Each event loop's thread's own copy (made by load_loop_tokenizer(), or at its first use).
        self._per_loop = threading.local()

    def load_loop_tokenizer(self) -> None:
        """Make the calling event loop's own tokenizer copy now (the api's start), not at its first short prompt."""
        if getattr(self._per_loop, "tokenizer", None) is None:
            self._per_loop.tokenizer = load_tokenizer(self._model)

    @contextmanager
    def borrowed(self) -> Iterator:
        """A tokenizer copy no other thread uses meanwhile: on an event loop, the loop's own."""
        if _on_event_loop():
            self.load_loop_tokenizer()
            yield self._per_loop.tokenizer
            return
        tokenizer = self._tokenizers.get()
        try:
            yield tokenizer
        finally:
            self._tokenizers.put(tokenizer)

    def _check_chars(self, field: str, chars: int) -> None:
        if chars > self.max_prompt_chars:
            raise PromptTooLong(
                f"{field}: {chars} characters, more than a prompt of the model's {self.max_model_len} tokens can hold "
                f"({self.max_prompt_chars} characters at most)"
            )

    def with_generation_defaults(self, request: GenerateRequest) -> GenerateRequest:
        """The request with the sampling fields it left out taken from the checkpoint's
        generation config, as vLLM does by default (beam search does not sample), and a JSON
        shape's whitespace from the server's setting when the request did not say."""
        missing = {name: value for name, value in self.generation_defaults.items() if name not in request.model_fields_set}
        shape = request.structured_outputs
        if (self.compact_json and shape is not None and shape.kind in ("json", "json_object")
                and "disable_any_whitespace" not in shape.model_fields_set):
            # The server's default (settings.structured_outputs_disable_any_whitespace); a request's own choice wins.
            missing["structured_outputs"] = shape.model_copy(update={"disable_any_whitespace": True})
        if not missing or request.use_beam_search:
            return request
        return request.model_copy(update=missing)

    def prompt_token_ids(self, request: GenerateRequest, keep_last: int | None = None) -> list[int]:
        """The prompt as token ids; ValueError (naming the field) for anything the engine would refuse.
        `keep_last`: vLLM's truncate_prompt_tokens, the prompt's last N tokens (-1: as many as fit)."""
        if request.use_beam_search:
            check_width("beam_width", request.beam_width, self.max_num_seqs, self.seqs_per_request)
        else:
            check_width("n", request.n, self.max_num_seqs, self.seqs_per_request)
        for field in ("stop_token_ids", "allowed_token_ids", "logit_bias"):
            self._check_token_ids(field, list(getattr(request, field) or ()))
        if request.prompt_token_ids is not None:
            ids = request.prompt_token_ids
            self._check_token_ids("prompt_token_ids", ids)
        elif request.messages is not None:
            ids = self.chat_token_ids([message.model_dump() for message in request.messages])
        else:
            ids = self._encode(request.prompt, whole=keep_last is not None)
        if keep_last is not None:
            ids = ids[-(self.token_limit if keep_last == -1 else keep_last):]
        self._check_length(len(ids), request.max_tokens)
        return ids

    def _encode(self, text: str, whole: bool = False) -> list[int]:
        """`whole`: tokenized in full even when long (its end is kept), else refused by its beginning."""
        self._check_chars("prompt", len(text))
        try:
            with self.borrowed() as tokenizer:
                head = _HEAD_CHARS_PER_TOKEN * self.token_limit
                if len(text) > head and not whole:
                    head_tokens = len(tokenizer.encode(text[:head]))
                    if head_tokens > self.token_limit + _CUT_WORD_TOKENS:
                        raise PromptTooLong(
                            f"prompt: its first {head} of {len(text)} characters are already {head_tokens} tokens, "
                            f"more than the limit of {self.token_limit}"
                        )
                return tokenizer.encode(text)
        except (TypeError, UnicodeError) as exc:  # schemas refuse lone surrogates; anything else the tokenizer refuses
            raise ValueError(f"prompt: the tokenizer cannot encode it ({exc})") from None

    def chat_token_ids(self, messages: list[dict], add_generation_prompt: bool = True,
                       template_kwargs: dict | None = None, tools: list[dict] | None = None) -> list[int]:
        """The messages (and the tools they may call, in OpenAI's shape) through the
        checkpoint's chat template, as token ids; `template_kwargs`: vLLM's
        chat_template_kwargs, variables the template reads."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("messages: this model's tokenizer has no chat template; send a plain prompt")
        # vLLM's rule: the request's own fields win; apply_chat_template's arguments given as
        # template variables (add_generation_prompt, tokenize, ...) are dropped.
        template_kwargs = {k: v for k, v in (template_kwargs or {}).items() if k not in _TEMPLATE_ARGUMENTS}
        self._check_chars("messages", sum(len(str(message.get("content") or "")) for message in messages))
        # A variable may be rendered once per message (a template's eos_token is): 80 KB of
        # them made a rendered prompt that took the api's memory whole as it was tokenized.
        if template_kwargs and (kwargs_chars := len(json.dumps(template_kwargs))) * len(messages) > self.max_prompt_chars:
            raise PromptTooLong(
                f"chat_template_kwargs: {kwargs_chars} characters, which the chat template may render in each of the "
                f"{len(messages)} messages: more than a prompt holds ({self.max_prompt_chars} characters at most)"
            )
        with self.borrowed() as tokenizer:
            try:
                text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                                     tokenize=False, **template_kwargs)
            except Exception as exc:  # jinja2's errors: the template refused these messages, tools or variables
                raise ValueError(f"messages: the model's chat template refused them: {exc}") from None
            # Checked before it is tokenized (~300 bytes of memory a character): what the
            # template added (tools, variables) counts too.
            self._check_chars("messages", len(text))
            # As apply_chat_template(tokenize=True) does: the template wrote the special tokens.
            return tokenizer.encode(text, add_special_tokens=False)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A text's token ids, however many (POST /tokenize); bounded by characters only."""
        self._check_chars("prompt", len(text))
        with self.borrowed() as tokenizer:
            return tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def detokenize(self, ids: list[int], field: str = "tokens") -> str:
        self._check_token_ids(field, ids)
        with self.borrowed() as tokenizer:
            return tokenizer.decode(ids)

    def token_strings(self, ids: list[int]) -> list[str]:
        """Each token as the vocabulary spells it (vLLM's token_strs)."""
        with self.borrowed() as tokenizer:
            return tokenizer.convert_ids_to_tokens(ids)

    def token_texts(self, ids: list[int]) -> list[str]:
        """Each token's own text (a token that ends mid-character decodes to U+FFFD)."""
        with self.borrowed() as tokenizer:
            return [tokenizer.decode([token_id]) for token_id in ids]

    def _check_token_ids(self, field: str, ids: list[int]) -> None:
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"{field}: ids must be in [0, {self.vocab_size}); got {bad[:5]}")

    def _check_length(self, prompt_tokens: int, max_tokens: int | None) -> None:
        if self.max_prompt_tokens is not None and prompt_tokens > self.max_prompt_tokens:
            raise PromptTooLong(f"prompt: {prompt_tokens} tokens, more than the limit of {self.max_prompt_tokens}")
        check_prompt_fits(prompt_tokens, max_tokens, self.max_model_len)
