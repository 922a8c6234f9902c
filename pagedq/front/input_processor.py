"""A request's way in: the prompt tokenized and every rule checked before anything reaches
the engine core, which takes only token ids it can run (pagedq.request_rules is the rule
the api and the worker apply too). A refusal is a ValueError naming the field; nothing is
queued and no other request notices.
"""

from __future__ import annotations

from typing import Any

from pagedq.beam_search import BeamSearchParams
from pagedq.model_info import check_prompt_fits
from pagedq.request_rules import check_width, unencodable_text
from pagedq.sampling_params import SamplingParams

# What `add_request` accepts as a prompt, as vLLM's LLM.generate does.
PromptType = str | dict[str, Any]


class InputProcessor:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, max_num_seqs: int,
                 max_seqs_per_request: int | None = None):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_seqs_per_request = max_seqs_per_request

    def params(self, params: SamplingParams | BeamSearchParams | None) -> tuple[SamplingParams, BeamSearchParams | None]:
        """(the sampling settings, the beam search's when it is one); beams share greedy
        settings and the sampler never sees beams."""
        params = SamplingParams() if params is None else params
        if isinstance(params, BeamSearchParams):
            shared = SamplingParams(temperature=0.0, max_tokens=params.max_tokens, ignore_eos=params.ignore_eos)
            return shared, params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params: expected SamplingParams or BeamSearchParams, got {type(params).__name__}")
        return params, None

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(the prompt's text if it had one, its token ids)."""
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids"}
            if unknown or len(prompt) != 1:
                raise ValueError(f"prompt: a dict needs exactly one of 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
            if "prompt_token_ids" in prompt:
                token_ids = prompt["prompt_token_ids"]
                if not isinstance(token_ids, (list, tuple)) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in token_ids
                ):
                    raise ValueError("prompt_token_ids: must be a list of integers")
                return None, list(token_ids)
            prompt = prompt["prompt"]
        if not isinstance(prompt, str):
            raise ValueError(f"prompt: expected a string or a dict, got {type(prompt).__name__}")
        if (why := unencodable_text(prompt)) is not None:
            raise ValueError(f"prompt: {why}")
        if self.tokenizer is None:
            raise ValueError("prompt: text prompts need a tokenizer (the engine was built with skip_tokenizer_init)")
        return prompt, self.tokenizer.encode(prompt)

    def check(self, token_ids: list[int], params: SamplingParams, beam: BeamSearchParams | None) -> None:
        if not token_ids:
            raise ValueError("prompt: must not be empty")
        check_prompt_fits(len(token_ids), None, self.max_model_len)
        for field, ids in (("prompt_token_ids", token_ids), ("stop_token_ids", params.stop_token_ids),
                           ("allowed_token_ids", params.allowed_token_ids), ("logit_bias", params.logit_bias)):
            bad = [t for t in ids or () if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"{field}: ids must be in [0, {self.vocab_size}), got {bad[:5]}")
        if beam is not None:
            check_width("beam_width", beam.beam_width, self.max_num_seqs, self.max_seqs_per_request)
        else:
            check_width("n", params.n, self.max_num_seqs, self.max_seqs_per_request)
        if params.logprobs is not None and params.logprobs > self.vocab_size:
            raise ValueError(f"logprobs: {params.logprobs} alternatives, more than the vocabulary's {self.vocab_size} tokens")
        if self.tokenizer is None and params.stop_strings:
            raise ValueError("stop: stop strings need a tokenizer (the engine was built with skip_tokenizer_init)")
        for field in ("bad_words", "structured_outputs"):
            if self.tokenizer is None and getattr(params, field):
                raise ValueError(f"{field}: needs a tokenizer (the engine was built with skip_tokenizer_init)")

    def bad_words_token_ids(self, params: SamplingParams) -> list[list[int]]:
        """Each bad word as the token sequences it can appear as: alone, and after a space
        (vLLM V1's two spellings; a leading-space token is a different id in BPE vocabularies)."""
        spellings = [spelling for word in params.bad_words or () for spelling in (word, " " + word.lstrip())]
        if not spellings:
            return []
        # One batch call, and duplicates found in a set: a list of 20,000 words, tokenized one
        # by one and de-duplicated by list search, held the worker's loop for minutes.
        sequences: dict[tuple[int, ...], None] = {}
        for ids in self.tokenizer(spellings, add_special_tokens=False)["input_ids"]:
            if ids:
                sequences.setdefault(tuple(ids))
        return [list(ids) for ids in sequences]
