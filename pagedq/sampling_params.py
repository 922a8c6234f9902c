"""SamplingParams: the one definition of how a request is sampled.

Field names and defaults follow vLLM so its users feel at home. It is a pydantic model
so the same class validates offline calls (raising ValueError that names the field),
HTTP request bodies (422) and job payloads read back from Redis, by the same rules
(pagedq.request_rules: finite numbers, valid text, int64 seeds).
"""

from __future__ import annotations

from pydantic import ConfigDict, Field, StrictStr, field_validator, model_validator

from pagedq.request_rules import INT64_MAX, INT64_MIN, ValidInput
from pagedq.structured_outputs_params import StructuredOutputsParams

# vLLM clamps each logit_bias value to this range (as OpenAI's API defines it).
LOGIT_BIAS_LIMIT = 100.0

# The most stop strings, and the most bad words, a request may give: each one costs work at
# every step of every output (a stop string searched for in the new text, a bad word's prefix
# compared with the output's end), so one request's long list slowed every other request's
# steps (10,000 stop strings stalled a bystander's stream 2.4 s; 20,000 bad words, 40 ms a
# step). vLLM sets no limit; OpenAI's API allows 4 stop strings.
MAX_STRINGS = 1024

# Sampling with these settings is deterministic argmax.
_GREEDY_EPS = 1e-5


class SamplingParams(ValidInput):
    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True)

    n: int = Field(1, ge=1, description="Number of output sequences for the prompt.")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    temperature: float = Field(1.0, ge=0.0, description="0 means greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, le=INT64_MAX, description="0 or -1 disables top-k.")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: StrictStr | list[StrictStr] | None = Field(None, description=f"At most {MAX_STRINGS} strings.")
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = Field(16, ge=1, le=INT64_MAX, description="None: up to the model's context length.")
    min_tokens: int = Field(0, ge=0, le=INT64_MAX)
    logprobs: int | None = Field(None, ge=0, le=20)
    prompt_logprobs: int | None = Field(
        None, ge=0, le=20,
        description="Per prompt token after the first, its logprob given the tokens before it, with the top "
        "`prompt_logprobs` alternatives (vLLM's; computed without the prefix cache).",
    )
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = Field(
        None, description="Added to a token's logit before sampling (token id -> bias, clamped to [-100, 100])."
    )
    allowed_token_ids: list[int] | None = Field(None, min_length=1, description="Only these tokens may be sampled.")
    bad_words: list[StrictStr] | None = Field(
        None, max_length=MAX_STRINGS,
        description="Words never generated: a word's last token is banned wherever its other tokens precede it.",
    )
    structured_outputs: StructuredOutputsParams | None = Field(
        None, description="The output follows a JSON schema, a regex, a choice or a grammar (vLLM's field)."
    )
    spaces_between_special_tokens: bool = Field(
        True,
        description="vLLM's field, accepted for compatibility: pagedq decodes with fast (tokenizers) tokenizers, "
        "which put no spaces between special tokens either way, as vLLM's fast detokenizer does.",
    )

    @field_validator("stop")
    @classmethod
    def _stop_strings_not_empty(cls, value: str | list[str] | None):
        items = [value] if isinstance(value, str) else (value or [])
        if any(s == "" for s in items):
            raise ValueError("stop strings must be non-empty")
        if len(items) > MAX_STRINGS:
            raise ValueError(f"at most {MAX_STRINGS} stop strings (got {len(items)})")
        return value

    @field_validator("allowed_token_ids")
    @classmethod
    def _allowed_once_each(cls, value: list[int] | None):
        """Each id once: the sampler masks every listed id of every output at every step, and
        150,000 repeats of a few ids in one request slowed every other request's steps."""
        return None if value is None else list(dict.fromkeys(value))

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _token_id_keys(cls, value):
        """JSON object keys are text ("50256"), as OpenAI's API sends them: read as token ids."""
        if isinstance(value, dict):
            try:
                return {int(k) if isinstance(k, str) else k: v for k, v in value.items()}
            except ValueError:
                raise ValueError("keys must be token ids (integers)") from None
        return value

    @field_validator("logit_bias")
    @classmethod
    def _clamp_bias(cls, value: dict[int, float] | None):
        if value is None:
            return None
        return {k: min(max(v, -LOGIT_BIAS_LIMIT), LOGIT_BIAS_LIMIT) for k, v in value.items()}

    @field_validator("bad_words")
    @classmethod
    def _bad_words_not_empty(cls, value: list[str] | None):
        if value is not None and any(not word.strip() for word in value):
            raise ValueError("bad words must be non-empty")
        return value

    @model_validator(mode="after")
    def _check_consistency(self) -> SamplingParams:
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens: must be at most max_tokens ({self.min_tokens} > {self.max_tokens})")
        return self

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def effective_top_k(self) -> int:
        """Top-k with both disabling spellings (0, -1) folded into 0."""
        return max(self.top_k, 0)
