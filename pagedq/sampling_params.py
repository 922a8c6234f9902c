"""SamplingParams: the one definition of how a request is sampled.

Field names and defaults follow vLLM so its users feel at home. It is a pydantic model
so the same class validates offline calls (raising ValueError that names the field),
HTTP request bodies (422) and job payloads read back from Redis, by the same rules
(pagedq.request_rules: finite numbers, valid text, int64 seeds).
"""

from __future__ import annotations

from pydantic import ConfigDict, Field, StrictStr, field_validator, model_validator

from pagedq.request_rules import SEED_MAX, SEED_MIN, ValidInput

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
    top_k: int = Field(0, ge=-1, description="0 or -1 disables top-k.")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = Field(16, ge=1, description="None: up to the model's context length.")
    min_tokens: int = Field(0, ge=0)
    logprobs: int | None = Field(None, ge=0, le=20)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
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
        return value

    @model_validator(mode="after")
    def _check_consistency(self) -> SamplingParams:
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
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
