"""The contract of summary batches, shared by the api (which runs them) and the CLI and
Client (which submit them and read their results).

A summary batch is a Batch API batch whose endpoint is SUMMARIES_ENDPOINT: each input line
is one document (`{"custom_id", "method": "POST", "url": SUMMARIES_ENDPOINT, "body":
{"text": ...}}`), the batch's `summary` options say how to summarize, and each output line's
body is a SummaryBody: one summary per document, however long the document, made in stages
(map: each chunk of the document summarized; reduce: the partial summaries combined, again
while they do not fit one prompt).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pagedq.request_rules import INT64_MAX, ValidInput

SUMMARIES_ENDPOINT = "/v1/summaries"

# The instruction comes before the text, so every chunk's prompt starts with the same
# tokens and shares their KV blocks through the prefix cache.
DEFAULT_MAP_TEMPLATE = "Summarize the following part of a longer document in a few sentences.\n\n{text}"
DEFAULT_REDUCE_TEMPLATE = (
    "The following are summaries of consecutive parts of one document. "
    "Combine them into one concise summary.\n\n{text}"
)
TEXT_FIELD = "{text}"
DEFAULT_MAX_TOKENS = 256


class SummarizeOptions(ValidInput):
    """How a summary batch summarizes (POST /v1/batches' `summary` field): finite numbers,
    valid text and int64 counts, as every request's."""

    model_config = ConfigDict(extra="forbid")

    map_template: str = Field(DEFAULT_MAP_TEMPLATE, description="Prompt for each chunk; {text} is the chunk.")
    reduce_template: str = Field(DEFAULT_REDUCE_TEMPLATE,
                                 description="Prompt that combines partial summaries; {text} is them, blank-line separated.")
    chat: bool = Field(False, description="Send the prompts through the model's chat template as the user's message.")
    max_tokens: int | None = Field(None, ge=1, le=INT64_MAX, description="Tokens each summary (partial or final) may have. "
                                   f"Default: {DEFAULT_MAX_TOKENS}, or what the model's context leaves room for.")
    temperature: float | None = Field(None, ge=0, description="Default: the checkpoint's generation config.")
    overlap_tokens: int = Field(32, ge=0, le=INT64_MAX, description="Tokens each chunk repeats from the end of the one before.")

    @field_validator("map_template", "reduce_template")
    @classmethod
    def _one_text_field(cls, template: str) -> str:
        if template.count(TEXT_FIELD) != 1:
            raise ValueError(f"must contain {TEXT_FIELD} exactly once, where the text goes")
        return template


Stage = Literal["map", "reduce"]


class StageUsage(BaseModel):
    """The requests and tokens of one stage of one document."""

    stage: int
    kind: Stage
    requests: int
    prompt_tokens: int = 0
    completion_tokens: int = 0


class DocumentProgress(BaseModel):
    """Where one document of a running summary batch is (the batch object's `documents`)."""

    custom_id: str | None
    status: Literal["in_progress", "completed", "failed", "cancelled"]
    stage: int
    kind: Stage
    requests: int
    done: int


class SummaryBody(BaseModel):
    """A summary batch's output line body."""

    object: Literal["summary"] = "summary"
    summary: str
    stages: list[StageUsage]
    usage: dict[str, int]
