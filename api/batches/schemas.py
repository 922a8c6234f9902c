"""The Batch API's wire objects (OpenAI's batch object, the create body), what Redis keeps
of a batch, the ids of its jobs and the lines of its output and error files."""

from __future__ import annotations

import json
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedq.request_rules import ValidInput
from pagedq.summaries import DocumentProgress, SummarizeOptions

BatchStatus = Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"]
ACTIVE: frozenset[str] = frozenset({"validating", "in_progress", "finalizing", "cancelling"})
COMPLETION_WINDOWS = {"24h": 24 * 3600}
BATCH_ID_PATTERN = re.compile(r"^batch_[0-9a-f]{32}$")


class RequestCounts(BaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchUsage(BaseModel):
    """OpenAI's batch usage: the tokens of the requests that completed."""

    input_tokens: int = 0
    input_tokens_details: dict[str, int] = Field(default_factory=lambda: {"cached_tokens": 0})
    output_tokens: int = 0
    output_tokens_details: dict[str, int] = Field(default_factory=lambda: {"reasoning_tokens": 0})
    total_tokens: int = 0

    def add(self, prompt_tokens: int, completion_tokens: int) -> None:
        self.input_tokens += prompt_tokens
        self.output_tokens += completion_tokens
        self.total_tokens = self.input_tokens + self.output_tokens


class BatchObject(BaseModel):
    """OpenAI's batch object (plus, for a summary batch, its options and each document's progress)."""

    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    model: str | None = None
    errors: dict | None = None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = Field(default_factory=RequestCounts)
    # Set when the batch ends (it sums the completed requests' usage from their results).
    usage: BatchUsage | None = None
    metadata: dict[str, str] | None = None
    summary: SummarizeOptions | None = None
    documents: list[DocumentProgress] | None = None


class BatchRecord(BatchObject):
    """What Redis keeps: the batch object plus the fan-out's position."""

    lines_read: int = 0
    request_sha256: str
    # The tenant that created it (api.auth.Caller.tenant); its line jobs and files are that tenant's too.
    owner: str = ""

    def public(self) -> dict:
        public = BatchObject.model_validate(self.model_dump(exclude={"lines_read", "request_sha256", "owner"}))
        # A plain batch is OpenAI's object exactly.
        return public.model_dump(exclude={"summary", "documents"} if self.summary is None else set())


class BatchCreate(ValidInput):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = Field(None, max_length=16)
    output_expires_after: dict | None = Field(None, description="Accepted; output files expire with PAGEDQ_FILES_TTL_S.")
    summary: SummarizeOptions | None = Field(
        None, description="With endpoint /v1/summaries: how each document (line) is summarized (pagedq's extension).")


def line_job_id(batch_id: str, index: int) -> str:
    """The job of a plain batch's line."""
    return f"{batch_id}-{index}"


def stage_job_id(batch_id: str, index: int, stage: int, part: int) -> str:
    """The job of one part of one stage of a summary batch's document (line): fixed by its
    place, so a stage queued twice would be the same jobs, never new ones."""
    return f"{batch_id}-{index}-{stage}-{part}"


def error_line(batch_id: str, index: int, custom_id: str | None, code: str, message: str) -> str:
    """A line that never produced an HTTP-style response (OpenAI's `error` field)."""
    return json.dumps({"id": f"batch_req_{line_job_id(batch_id, index)}", "custom_id": custom_id, "response": None,
                       "error": {"code": code, "message": message}})


def response_line(batch_id: str, index: int, custom_id: str | None, status_code: int, body: dict) -> str:
    request_id = line_job_id(batch_id, index)
    return json.dumps({"id": f"batch_req_{request_id}", "custom_id": custom_id,
                       "response": {"status_code": status_code, "request_id": request_id, "body": body}, "error": None})
